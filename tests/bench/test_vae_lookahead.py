"""Smoke test of ``python -m bench vae-lookahead``: the report holds every N, and the error it reports behaves
as a look-ahead error must (zero from the decoder's own look-ahead on, more frames out early below it)."""

from __future__ import annotations

from bench.vae_lookahead import format_report, measure
from models.checkpoints import build_vae
from models.vae import StreamingDecoder


def test_the_report_covers_every_lookahead_and_is_exact_from_the_decoders_own():
    decoder = StreamingDecoder(build_vae("tiny-vae"))
    report = measure(decoder, frames=12, height=2, width=2, lookaheads=range(0, decoder.lookahead + 1))
    rows = {row["lookahead"]: row for row in report["rows"]}
    assert set(rows) == set(range(decoder.lookahead + 1))
    assert rows[decoder.lookahead]["max_abs"] <= 1e-4
    assert rows[0]["max_abs"] > 1e-3
    assert rows[0]["frames_before_flush"] > rows[decoder.lookahead]["frames_before_flush"]
    assert "| 0 |" in format_report(report)
