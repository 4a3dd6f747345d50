"""Smoke test of ``python -m bench decode``: a real server process with the tiny refiner and the tiny VAE, latents
and video sessions over WebSockets, a watcher that never reads; the report holds every figure. Timings are not
judged here."""

from __future__ import annotations

from bench.decode import format_decode, run_decode


def test_decode_benchmark_runs_every_phase():
    report = run_decode(preset="tiny", height=2, width=2, sessions=2, rounds=1, blocks=2, threads=1)
    figures = report["figures"]
    assert set(figures) == {"latents x1", "video x1", "latents x2", "video x2", "video x1 + stalled watcher"}
    for name, run in figures.items():
        sessions = 2 if name.endswith("x2") else 1
        assert run["blocks"] == sessions * 2 and run["blocks_per_s"] > 0, name
        assert 0 < run["latency_p50_s"] <= run["latency_p99_s"], name
    engine = report["engine"]
    # The video sessions' blocks were decoded by the engine's decode steps, between its model calls.
    assert engine["decode_step_count"] > 0 and engine["model_call_count"] > engine["decode_step_count"] / 2
    assert report["vae"]["class"] == "AutoencoderKLLTX2Video"
    text = format_decode(report)
    assert "refine + decode / refine alone" in text and "never reads" in text
