"""``python -m bench loadmodel`` runs and reports every loader (on the tiny preset's widths: seconds, not minutes)."""

from __future__ import annotations

from bench.loadmodel import main


def test_every_loader_is_timed_against_the_baselines(capsys):
    assert main(["--preset", "tiny", "--layers", "2", "--rounds", "2", "--old"]) == 0
    out = capsys.readouterr().out
    assert "at the tiny widths" in out and out.count("round ") == 2
    for name in ("load_file ", "load_file + copy", "load_refiner", "old loader"):
        assert any(line.startswith(name) and "of load_file + copy" in line for line in out.splitlines()), name
    assert "(the video path)" in out
