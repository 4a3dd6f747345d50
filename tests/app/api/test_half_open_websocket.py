"""A WebSocket peer that is gone without a FIN (half-open: it neither reads nor answers pings, its TCP stays open)
is let go at uvicorn's keep-alive deadline, so its stream detaches and its session is released like any dropped
client's, instead of staying ``streaming`` (in use, never evicted, holding a ``max_sessions`` place) for ever."""

from __future__ import annotations

import socket
import time

import httpx
import torch

from tests.app.conftest import DEADLINE_S, LiveServer, payload, raw_websocket, wait_until


async def _write_buffers(server) -> list[int]:
    from app.api.uvicorn_websocket import GuardedWebSocketProtocol

    return [c.transport.get_write_buffer_size() for c in server.server.server_state.connections
            if isinstance(c, GuardedWebSocketProtocol) and c.transport is not None]


def _half_open_stream(port: int, session_id: str, message: bytes) -> socket.socket:
    """Open the stream, send one message, then never read (a tiny receive buffer, so the output backs up)."""
    sock, client = raw_websocket("127.0.0.1", port, f"/v1/sessions/{session_id}/stream",
                                 options=((socket.SO_RCVBUF, 4096),))
    client.send_binary(message)
    sock.sendall(b"".join(client.data_to_send()))
    return sock


def test_a_half_open_stream_that_never_reads_is_dropped_at_the_ping_timeout_and_its_session_detaches(make_settings):
    settings = make_settings(warmup=False, ws_reattach_grace_s=300)
    server = LiveServer(settings)
    # uvicorn's keep-alive (20 s + 20 s by default), short here; the server keeps uvicorn's mechanism.
    # The first ping goes out once the output is stuck (it then waits behind it, as after 20 s in production).
    # 10 s: room for a loaded runner to back the output up before it (the check below), still a short test.
    server.server.config.ws_ping_interval = 10.0
    server.server.config.ws_ping_timeout = 1.0
    with server, httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        # Small kernel buffers on the server's side (accepted sockets inherit the listener's): the output backs up
        # into the transport's write buffer after a few units.
        for listener in server.server.servers[0].sockets:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        session_id = http.post("/v1/sessions").json()["session_id"]
        # 24 frames of 16 x 16: ~3 MB of units back.
        message = payload(torch.randn(1, 128, 24, 16, 16), torch.randn(1, 8, 32))
        started = time.monotonic()
        sock = _half_open_stream(server.port, session_id, message)
        try:
            wait_until(lambda: max(server.on_loop(_write_buffers(server)).result(DEADLINE_S) or [0]) > 0,
                       "output to back up behind the client that does not read")
            # Guards the test's meaning, not a speed: a ping sent before the output backed up would let the old
            # code's transport.close() end the connection too.
            assert time.monotonic() - started < 10.0, "the output backed up only after the first ping: no test"
            # Before the fix: "streaming" stayed true for good (the ping timeout's transport.close() waited for a
            # write buffer that a peer reading nothing never drains).
            state = wait_until(lambda: (lambda s: s if not s["streaming"] else None)(
                http.get(f"/v1/sessions/{session_id}").json()), "the half-open stream to be let go", timeout=30)
            assert state["detached"] is True, state
            assert http.get("/health").status_code == 200
        finally:
            sock.close()


def test_a_half_open_stream_does_not_hold_the_shutdown_past_the_drain(make_settings):
    """The drain gives a stream drain_timeout_s to close; the connection of a peer that reads nothing then held
    uvicorn's shutdown for timeout_graceful_shutdown more (drain_timeout_s + 5 s): 2 x the drain, plus 5 s."""
    drain_s = 2.0
    settings = make_settings(warmup=False, drain_timeout_s=drain_s)
    server = LiveServer(settings)
    server.server.config.ws_ping_interval = None  # no keep-alive: only the shutdown may let the peer go
    server.__enter__()
    try:
        for listener in server.server.servers[0].sockets:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        with httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
            session_id = http.post("/v1/sessions").json()["session_id"]
        sock = _half_open_stream(server.port, session_id, payload(torch.randn(1, 128, 24, 16, 16),
                                                                  torch.randn(1, 8, 32)))
        wait_until(lambda: max(server.on_loop(_write_buffers(server)).result(DEADLINE_S) or [0]) > 0,
                   "output to back up behind the client that does not read")
        started = time.monotonic()
        server.stop()
        took = time.monotonic() - started
        sock.close()
        # Before: the drain, then timeout_graceful_shutdown (drain_s + 5 s) more; now the drain, then one look
        # (STUCK_CHECK_S) that the peer reads nothing.
        assert took < 2 * drain_s + 3.0, f"the shutdown took {took:.1f} s"
    finally:
        if server.thread.is_alive():
            server.stop()


def test_a_peer_still_reading_past_a_deadline_is_let_finish_and_one_reading_nothing_is_cut():
    """The abort past a missed deadline (ping, close, shutdown) is for a peer that reads nothing: one that still
    reads (its write buffer shrinks: a slow link, a 720p unit) is let finish as ``transport.close()`` lets it, instead
    of losing its last units and the close frame (the shutdown aborted every connection with output unsent, a
    stream the drain had just closed cleanly included)."""
    from types import SimpleNamespace

    from app.api.uvicorn_websocket import GuardedWebSocketProtocol

    class Transport:
        def __init__(self, sizes):
            self.sizes, self.aborted = list(sizes), False

        def get_write_buffer_size(self):
            return self.sizes.pop(0) if len(self.sizes) > 1 else self.sizes[0]

        def abort(self):
            self.aborted = True

    class Loop:
        def __init__(self):
            self.later = []

        def call_later(self, delay, callback, *args):
            self.later.append((callback, args))

    def run(sizes):
        loop, transport = Loop(), Transport(sizes)
        peer = SimpleNamespace(transport=transport, disconnected=False, loop=loop, client=("127.0.0.1", 1),
                               logger=SimpleNamespace(info=lambda *a: None), STUCK_CHECK_S=1.0)
        peer._abort_if_stuck = lambda *args: GuardedWebSocketProtocol._abort_if_stuck(peer, *args)
        peer._abort_if_stuck()
        checks = 0
        while loop.later and not transport.aborted and checks < 10:
            callback, args = loop.later.pop(0)
            callback(*args)
            checks += 1
        return transport.aborted, checks

    assert run([0]) == (False, 0)  # nothing unsent: nothing to do
    assert run([5000, 5000]) == (True, 1)  # reads nothing: cut after one look
    assert run([5000, 3000, 1000, 0]) == (False, 3)  # reads slowly to the end: never cut
    assert run([5000, 3000, 3000]) == (True, 2)  # reads, then stops: cut once it stops
