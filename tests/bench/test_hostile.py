"""The hostile client (``python -m bench.hostile``) against a server it starts: every case of issue 16 items 1-6
it knows is refused in bounded time, so the hardening keeps being tried. See bench/hostile.py."""

from __future__ import annotations

from bench.hostile import main


def test_every_hostile_case_is_refused_in_bounded_time(capsys):
    code = main(["--deadline", "20"])
    lines = capsys.readouterr().out.splitlines()
    names = {line[5:].split(":")[0] for line in lines if line[:4] in ("ok  ", "FAIL")}
    assert {"unfinished head", "huge header", "trickled body", "bodies in flight", "huge finite latents",
            "lying snapshot metadata", "genuine snapshot beside them", "misbehaving peers",
            "stream flood of text frames", "stream flood of invalid binary frames", "watch flood of text frames",
            "ping flood that never reads", "listing of many spilled sessions",
            "untrusted snapshot files (signing key set)", "lease dated 2039", "lease dated a little ahead",
            "lease generation 9999999999"} <= names, lines
    assert code == 0, "\n".join(line for line in lines if line.startswith("FAIL"))
