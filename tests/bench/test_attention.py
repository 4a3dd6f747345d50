"""Smoke test of ``python -m bench attention``: the three strategies run and are timed."""

from __future__ import annotations

from bench.attention import main, measure


def test_every_strategy_is_timed(capsys):
    times = measure([2, 3, 3], tokens_per_frame=4, reps=2)
    assert set(times) == {"per session", "grouped", "padded"} and all(t > 0 for t in times.values())
    assert main(["--sessions", "2"]) == 0
    assert "| equal windows" in capsys.readouterr().out
