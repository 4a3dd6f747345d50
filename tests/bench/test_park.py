"""Smoke test of ``python -m bench park``: a tiny server, every state timed, every size reported."""

from __future__ import annotations

import re

from bench.park import main


def test_park_benchmark_times_every_state_and_reports_the_sizes(capsys):
    # No --threads: the server runs in this process, and torch's thread count is process-wide.
    assert main(["--preset", "tiny", "--sessions", "2", "--rounds", "1", "--height", "2", "--width", "2"]) == 0
    out = capsys.readouterr().out
    for row in ("page-in parked", "page-in spilled", "chunk active", "chunk parked", "chunk spilled"):
        assert re.search(rf"^{row}\s+[\d.]+\s+[\d.]+\s+2$", out, re.M), row
    sizes = {name: int(value.replace(",", "")) for name, value in
             re.findall(r"^(active device bytes|parked host bytes|spilled file bytes)\s+([\d,]+)$", out, re.M)}
    assert len(sizes) == 3 and all(value > 0 for value in sizes.values())
