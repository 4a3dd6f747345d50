"""Smoke test of ``python -m bench realtime``: one real server on the tiny refiner; every phase's blocks are
counted by the server and by the clients, and the report holds every figure. Timings are not judged."""

from __future__ import annotations

from bench.realtime import format_realtime, run_realtime


def test_realtime_benchmark_counts_each_phases_blocks_and_the_cost_model():
    report = run_realtime(preset="tiny", height=2, width=2, fps=4.0, blocks=2, max_sessions=2, modes=["batching"],
                          threads=1)
    result = report["modes"]["batching"]
    phases = result["phases"]
    assert phases[0]["sessions"] == 1 and len(phases) <= 2
    for phase in phases:
        assert phase["blocks"] == 2 * phase["sessions"]
        assert 0 <= phase["late_blocks"] <= phase["blocks"] and 0 <= phase["client_late_blocks"] <= phase["blocks"]
    assert result["holds"] in (0, 1, 2) and result["seconds_per_row"] > 0 and result["load_per_session"] > 0
    assert report["block_seconds"] == 6.0
    text = format_realtime(report)
    assert f"holds **{result['holds']}** session(s)" in text and "| batching | 1 | 2 |" in text
