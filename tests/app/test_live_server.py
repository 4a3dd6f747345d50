"""The benchmarks' and tests' server helpers (``bench.live``)."""

from __future__ import annotations

import pytest

from bench.live import ServerFailure, wait_ready
from tests.app.conftest import LiveServer


def test_a_port_another_server_took_is_not_taken_for_the_one_started(make_settings):
    """``free_port`` hands out a port another process can bind first; waiting for the server started on it checks
    that the answer is that server's (its X-Replica), so another one, ready on the port, fails the wait saying so
    instead of passing for it (a test then talked to a stranger: 401s from a server with a key)."""
    with LiveServer(make_settings(replica_id="the-one-there")) as server:
        wait_ready(server.base_url, 10, replica="the-one-there")
        with pytest.raises(ServerFailure, match="answers as replica 'the-one-there', not 'the-one-started'"):
            wait_ready(server.base_url, 10, replica="the-one-started")
