"""Smoke test of ``python -m bench checkpoint``: two real servers (with and without checkpoints) on the tiny
refiner; the one with them wrote one per block, and the report holds every figure. Timings are not judged."""

from __future__ import annotations

from bench.checkpoint import format_checkpoint, run_checkpoint


def test_checkpoint_benchmark_runs_both_servers_and_counts_what_was_written():
    report = run_checkpoint(preset="tiny", every=1, height=2, width=2, sessions=1, rounds=2, blocks=2, threads=1)
    assert all(run["blocks"] == 2 * 2 and run["latency_p50_s"] > 0 for run in report["figures"].values())
    written = report["written"]
    # The fill (sink + 4 blocks) and every timed block: one checkpoint each, about the session's size.
    assert written["checkpoints"] >= 4 and written["bytes_per_checkpoint"] > 10_000
    assert "with / without checkpoints" in format_checkpoint(report)
