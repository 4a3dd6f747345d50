"""Smoke test of ``python -m bench park``: a tiny server, every state timed, every size reported, and the snapshot
signing rows (the session's record and a small synthetic one) printed with every figure."""

from __future__ import annotations

import re

from bench.park import main


def test_park_benchmark_times_every_state_and_reports_the_sizes(capsys):
    # No --threads: the server runs in this process, and torch's thread count is process-wide.
    assert main(["--preset", "tiny", "--sessions", "2", "--rounds", "1", "--height", "2", "--width", "2",
                 "--signing-gib", "0.01", "--signing-rounds", "2"]) == 0
    out = capsys.readouterr().out
    for row in ("page-in parked", "page-in spilled", "chunk active", "chunk parked", "chunk spilled"):
        assert re.search(rf"^{row}\s+[\d.]+\s+[\d.]+\s+2$", out, re.M), row
    sizes = {name: int(value.replace(",", "")) for name, value in
             re.findall(r"^(active device bytes|parked host bytes|spilled file bytes)\s+([\d,]+)$", out, re.M)}
    assert len(sizes) == 3 and all(value > 0 for value in sizes.values())
    number = r"[+-]?[\d.]+"
    for record in ("session", "0.01 GiB"):
        for step in ("write", "read\\+verify"):
            row = rf"^signing {step}\s+{record}\s+[\d,]+\s+{number}\s+{number}\s+{number}\s+{number}x\s+2$"
            assert re.search(row, out, re.M), (step, record)
        hashed = re.search(rf"^signing hmac\s+{record}\s+([\d,]+)\s+{number}\s+({number}) GB/s$", out, re.M)
        assert hashed and int(hashed[1].replace(",", "")) > 0 and float(hashed[2]) > 0, record
    synthetic = re.search(r"^signing hmac\s+0.01 GiB\s+([\d,]+)", out, re.M)
    assert abs(int(synthetic[1].replace(",", "")) - 0.01 * 2**30) < 0.001 * 2**30  # the size asked for
    engine = dict(re.findall(r"^signing engine (all|build|move)\s+([\d.]+) ms$", out, re.M))
    assert set(engine) == {"all", "build", "move"} and all(float(value) > 0 for value in engine.values())
