"""Smoke test of ``python -m bench load``: two real server processes (batching on and off) and WebSocket clients
run end to end on the tiny refiner, and the report holds every figure. Timings are not judged here."""

from __future__ import annotations

from bench.load import format_load, run_load


def test_load_benchmark_runs_both_servers_and_reports_every_phase():
    report = run_load(preset="tiny", height=2, width=2, counts=(1, 3), rounds=1, blocks=2, threads=1)
    figures = report["figures"]
    assert set(figures) == {"batching", "no batching"}
    for runs in figures.values():
        assert set(runs) == {1, 3}
        for count, run in runs.items():
            assert run["blocks"] == count * 2 and run["blocks_per_s"] > 0
            assert 0 < run["latency_p50_s"] <= run["latency_p99_s"] <= run["latency_max_s"]
    # The batching server shared model calls between sessions; the other never did.
    assert report["engine"]["batching"]["mean_rows"] > 1
    assert report["engine"]["no batching"]["mean_rows"] == 1
    text = format_load(report)
    assert "3 sessions / 1 session" in text and "p99" in text
