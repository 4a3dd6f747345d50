"""The cluster soak (``python -m bench.cluster``), bounded: 3 replicas behind HAProxy, 8 sessions over WebSockets
and HTTP, one replica drained at a third of the frames and another killed (kill -9) at two thirds; every frame
of every session checked against the session refined alone."""

from __future__ import annotations

import shutil

import pytest

from bench.cluster import run_cluster_soak

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy (apt-get install haproxy)")


def test_cluster_soak_survives_a_drain_and_a_kill_without_losing_a_frame(tmp_path):
    figures = run_cluster_soak(tmp_path, replicas=3, sessions=8, frames=40, deadline_s=300)
    print(figures)
    assert figures["frames_checked"] == 8 * 40
    assert [name for name, _, _ in figures["moves"]] == ["drain", "kill -9"]
    assert len({victim for _, victim, _ in figures["moves"]}) == 2
    assert figures["reconnects_or_resyncs"] > 0, "the moves were noticed by the clients"
