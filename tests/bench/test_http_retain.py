"""``python -m bench http-retain`` runs against two real servers and reports each kind it was asked for; the
figures that are not timings hold (as many chunks timed on each server as asked)."""

from __future__ import annotations

import pytest

from bench.http_retain import header, row, run


def test_both_servers_are_timed_chunk_for_chunk():
    results = dict(run(["latents"], chunks=2, pixels=(64, 96), threads=1))
    assert list(results) == ["latents"]
    figures = results["latents"]
    assert figures["chunks"] == 2
    assert figures["kept_p50_ms"] > 0 and figures["none_p50_ms"] > 0
    assert figures["kept_p95_ms"] >= figures["kept_p50_ms"] and figures["none_p95_ms"] >= figures["none_p50_ms"]
    assert figures["p50_ratio"] == pytest.approx(figures["kept_p50_ms"] / figures["none_p50_ms"])
    lines = [*header(None), row("latents", figures)]
    assert lines[0].startswith("| kind | chunks | p50 ws_resume_units default | p50 at 0 |")
    assert lines[2].startswith("| latents | 2 | ")
