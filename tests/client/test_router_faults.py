"""The client through faults a router in front of replicas produces (issue 16, item 9), against a real server on
loopback and the test proxy: a reconnect while the caller's source is waiting for its next frames (asyncio and
sync), a 404 while the session moves between replicas, HAProxy's 502 when a replica dies mid-request, and which
replica serves a session."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

import wm_refiner_client as wm
from wm_refiner_client import AsyncClient, Client, RetryPolicy, concat

from .conftest import chunks_of, clip
from .proxy import Proxy, http_response

FAST_RETRY = RetryPolicy(attempts=40, backoff_s=0.05, max_backoff_s=0.5)
LATENTS, PROMPT, MASK = clip(14)
SIZES = [4, 3, 3, 2]
HAPROXY_502 = http_response(502, "Bad Gateway", b"<html><body><h1>502 Bad Gateway</h1>\nThe server returned an "
                            b"invalid or incomplete response.\n</body></html>\n", "text/html")


def not_found(replica: str) -> bytes:
    """What a replica that does not hold the session (yet) answers."""
    body = json.dumps({"error": {"code": "session_not_found", "message": "no session"}}).encode()
    return http_response(404, "Not Found", body, "application/json", x_replica=replica)


@pytest.fixture(scope="module")
def reference(server):
    with Client(server.base_url) as client:
        return client.refine(LATENTS, PROMPT, MASK).latents


def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_async_stream_continues_the_callers_source_after_a_reconnect(server, reference):
    """The caller's async generator is waiting for its next frames when the connection drops: the reconnect must not
    cancel into it (that ended the generator, and the stream flushed what it had as if the clip were complete)."""

    async def run():
        holder = []

        async def live_source():
            parts = chunks_of(LATENTS, SIZES)
            yield parts[0]
            yield parts[1]
            deadline = time.monotonic() + 20
            while holder[0].stats.reconnects == 0:  # the next frames come once the stream is back
                assert time.monotonic() < deadline, "the stream never reconnected"
                await asyncio.sleep(0.01)
            for part in parts[2:]:
                yield part

        with Proxy(server.port) as proxy:
            async with AsyncClient(proxy.base_url, retry=FAST_RETRY) as client:
                session = await client.create_session()
                stream = session.stream(live_source(), prompt=PROMPT, prompt_mask=MASK)
                holder.append(stream)
                units = []
                async for unit in stream:
                    units.append(unit)
                    if len(units) == 2:
                        assert proxy.cut() >= 1
                return units, stream.stats, await session.state()

    units, stats, state = asyncio.run(run())
    assert stats.reconnects == 1
    assert units[-1].frame_end == 14 and state.frames_received == 14 and state.flushed
    assert np.array_equal(concat(units), reference)


def test_sync_reconnect_does_not_wait_for_a_source_that_blocks(server, reference):
    """The caller's generator blocks until the stream is back: the reconnect must not wait for it."""
    holder = []

    def live_source():
        parts = chunks_of(LATENTS, SIZES)
        yield parts[0]
        yield parts[1]
        wait_for(lambda: holder[0].stats.reconnects >= 1, "the stream to reconnect")
        yield from parts[2:]

    with Proxy(server.port) as proxy, Client(proxy.base_url, retry=FAST_RETRY) as client:
        session = client.create_session()
        stream = session.stream(live_source(), prompt=PROMPT, prompt_mask=MASK)
        holder.append(stream)
        units = []
        for unit in stream:
            units.append(unit)
            if len(units) == 2:
                assert proxy.cut() >= 1
        state = session.state()
    assert stream.stats.reconnects == 1 and state.frames_received == 14
    assert np.array_equal(concat(units), reference)


def test_a_404_while_the_session_moves_is_retried_for_a_bounded_time(server, reference):
    replica = server.settings.replica_id
    with Proxy(server.port) as proxy, Client(proxy.base_url, retry=FAST_RETRY) as client:
        session = client.create_session()
        first = session.send(LATENTS[:, :, :6], PROMPT, MASK)
        proxy.cut()  # httpx's pooled connection: the next request opens a new one, which the "router" answers
        proxy.answer_next(3, not_found("replica-next"))  # the next replica has not adopted it yet
        second = session.send(LATENTS[:, :, 6:10])
        assert proxy.answered == 3 and second.seq == 1 and not second.replayed
        assert session.replica == replica  # the X-Replica of the answer that finally came (the 404s named another)

        # A stream's reconnect meets the same: its handshakes answered 404 by the other replica, then it is back.
        def chunks():
            yield LATENTS[:, :, 10:13]  # completes the block [10, 13): one unit
            wait_for(lambda: proxy.answered == 5, "the reconnect's handshakes")
            yield LATENTS[:, :, 13:]

        stream = session.stream(chunks())
        units = []
        for unit in stream:
            units.append(unit)
            if len(units) == 1:
                proxy.answer_next(2, not_found("replica-next"))
                proxy.cut()
        assert stream.stats.reconnects == 1 and stream.replica == replica
    assert np.array_equal(concat([first, second, *units]), reference)

    # The bound: a session that stays missing is reported after move_timeout_s; its own replica's 404 at once.
    patient = RetryPolicy(attempts=1000, backoff_s=0.05, max_backoff_s=0.1, move_timeout_s=1.0)
    with Proxy(server.port) as proxy, Client(proxy.base_url, retry=patient) as client:
        session = client.create_session()
        proxy.cut()
        proxy.answer_next(1000, not_found("replica-next"))
        began = time.monotonic()
        with pytest.raises(wm.SessionNotFoundError) as gone:
            session.state()
        assert 1.0 <= time.monotonic() - began < 5.0 and gone.value.replica == "replica-next"
        assert proxy.answered > 3
    # Final 404s come at once, not after move_timeout_s: a long one, so a machine's load cannot blur the two.
    final = RetryPolicy(attempts=1000, backoff_s=0.05, max_backoff_s=0.1, move_timeout_s=30.0)
    with Client(server.base_url, retry=final) as client:
        session = client.create_session()
        session.delete()
        began = time.monotonic()
        with pytest.raises(wm.SessionNotFoundError):
            session.state()  # deleted by this client: the 404 is final
        with pytest.raises(wm.SessionNotFoundError):
            client.get_session("never-created-1")  # never served to this client: not a move
        assert time.monotonic() - began < 10.0


def test_a_routers_502_is_retried_for_idempotent_requests(server, reference):
    with Proxy(server.port) as proxy, Client(proxy.base_url, retry=FAST_RETRY) as client:
        session = client.create_session()
        first = session.send(LATENTS[:, :, :6], PROMPT, MASK)
        proxy.swallow_responses(1, reply=HAPROXY_502)  # the replica refined it, then died before answering
        second = session.send(LATENTS[:, :, 6:])
        assert proxy.swallowed == 1 and second.replayed and second.seq == 1
        proxy.cut()
        proxy.answer_next(2, HAPROXY_502)  # no replica answered at all
        last = session.flush()
        state = session.state()
        assert state.frames_received == 14 and state.next_seq == 3
        proxy.cut()
        proxy.answer_next(1, HAPROXY_502)
        with pytest.raises(wm.errors.BadGatewayError):
            client.create_session()  # not idempotent: it may have created a session, so it is not repeated
    assert np.array_equal(concat([first, second, last]), reference)
