"""The client's protocol core (``wm_refiner_client.protocol``) without a socket: a stream's messages across a
reconnect, the dedup of a replay, the flush's timing, which failures end a stream, and the retry decisions of HTTP
requests (503, a router's 502/504, a session moving between replicas) against a fake clock."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load, save

import wm_refiner_client as wm
from wm_refiner_client.errors import error_from
from wm_refiner_client.protocol import (
    DONE_SENDING,
    NEED_CHUNK,
    WAIT,
    ChunkSeq,
    RequestAttempts,
    StreamProtocol,
    is_gateway_error,
)

from .conftest import clip

LATENTS, PROMPT, MASK = clip(7)
CONFIG = {"sink_frames": 1, "block_size": 3}
POLICY = wm.RetryPolicy(attempts=4, backoff_s=0.1, max_backoff_s=1.0, move_timeout_s=5.0)
HAPROXY_502 = b"<html><body><h1>502 Bad Gateway</h1>\nThe server returned an invalid or incomplete response.</body></html>"


def session_event(frames_received: int, flushed: bool = False) -> str:
    return json.dumps({"type": "session", "frames_received": frames_received, "frames_returned": 0,
                       "flushed": flushed, "next_seq": 0})


def unit_message(start: int, end: int) -> bytes:
    latents = LATENTS[:, :, start:end]  # (B, C, n, H, W): the "refined" frames are the inputs, for checking
    return save({"latents": np.ascontiguousarray(latents)},
                metadata={"frame_start": str(start), "frame_end": str(end), "latency_ms": "5.0"})


def frames_of(payload: bytes) -> tuple[int, bool]:
    tensors = load(payload)
    return int(tensors["latents"].shape[2]), "prompt_embeds" in tensors


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def new_stream(**kwargs) -> StreamProtocol:
    return StreamProtocol("s-000001", CONFIG, POLICY, prompt=PROMPT, prompt_mask=MASK, **kwargs)


def test_a_stream_across_a_reconnect_resends_what_the_server_lacks_and_yields_each_frame_once():
    noted = []
    stream = new_stream(on_unit=noted.append)
    assert stream.wait_before_connect() == 0 and stream.query() == {"resume_from": 0}
    assert stream.opened(session_event(0), replica="replica-a") is True
    assert stream.next_message() == NEED_CHUNK
    assert frames_of(stream.add(LATENTS[:, :, :4])) == (4, True)  # the first chunk carries the prompt
    assert stream.next_message() == NEED_CHUNK
    assert frames_of(stream.add(LATENTS[:, :, 4:7])) == (3, False)
    assert stream.next_message() == NEED_CHUNK
    stream.finish()
    assert stream.next_message() == WAIT  # the flush waits for the full blocks (7 frames) to come back
    units = [stream.received(unit_message(0, 1)), stream.received(unit_message(1, 4))]
    assert [(u.frame_start, u.frame_end) for u in units] == [(0, 1), (1, 4)]
    assert noted == units and stream.stats.frames_refined == 4 and stream.stats.units == 2

    stream.lost(None, "", ConnectionResetError("cut"))  # no close frame: a network drop
    assert 0 < stream.wait_before_connect() <= POLICY.backoff_s
    assert stream.query() == {"resume_from": 4}  # the replay starts at the first frame the caller lacks
    assert stream.opened(session_event(4), replica="replica-a") is True  # the server got the first chunk only
    assert stream.stats.reconnects == 1
    resent = stream.next_message()
    assert frames_of(resent) == (3, False) and np.array_equal(load(resent)["latents"], LATENTS[:, :, 4:7])
    assert stream.next_message() == WAIT
    assert stream.received(unit_message(1, 4)) is None  # replayed whole: already had every frame of it
    assert stream.received(unit_message(4, 7)).frame_start == 4
    assert stream.failures == 0  # a unit is progress: the attempts count again from zero
    assert stream.next_message() == '{"type": "flush"}'
    assert stream.next_message() == DONE_SENDING  # one flush per connection
    assert stream.received(json.dumps({"type": "done", "frames": 7})) is True
    assert stream.stats.frames_sent == 7 and stream.stats.frames_refined == 7


def test_a_stream_from_the_session_start_skips_the_frames_the_server_has_across_reconnects():
    """A rerun of a clip (``from_session_start``): the chunks are the session's input from frame 0; what the server
    has is not sent again, a chunk straddling it is sent from there without the prompt (already in force), and a
    reconnect before the skipped frames were even taken from the caller is no error."""
    stream = new_stream(from_session_start=True, frames_returned=2)
    assert stream.query() == {"resume_from": 2}
    assert stream.opened(session_event(5)) is True
    assert stream.stats.reconnects == 0
    assert stream.next_message() == NEED_CHUNK
    assert stream.add(LATENTS[:, :, :3]) is None  # all of it is on the server
    stream.lost(None, "", ConnectionResetError("cut"))
    assert stream.opened(session_event(5)) is True and stream.stats.reconnects == 1
    assert stream.next_message() == NEED_CHUNK
    straddling = stream.add(LATENTS[:, :, 3:6])
    assert frames_of(straddling) == (1, False)
    assert np.array_equal(load(straddling)["latents"], LATENTS[:, :, 5:6])
    assert frames_of(stream.add(LATENTS[:, :, 6:7])) == (1, False)
    stream.finish()
    assert stream.next_message() == WAIT  # sink 1 + two blocks of 3 = 7 frames come back before the flush
    assert stream.received(unit_message(1, 4)).frame_start == 2  # trimmed to what the caller lacks
    assert stream.received(unit_message(4, 7)).frame_end == 7
    assert stream.next_message() == '{"type": "flush"}'
    # Without the flag the server being ahead of what the source sent is another client's doing: refused.
    plain = new_stream()
    assert plain.opened(session_event(0)) is True
    plain.add(LATENTS[:, :, :3])
    plain.lost(None, "", ConnectionResetError("cut"))
    with pytest.raises(wm.ProtocolError, match="another client"):
        plain.opened(session_event(5))


def test_a_replayed_unit_that_straddles_what_the_caller_has_is_trimmed():
    stream = new_stream(frames_returned=2)  # a handle that already got frames 0 and 1 over HTTP
    assert stream.query() == {"resume_from": 2}
    stream.opened(session_event(4))
    fresh = stream.received(unit_message(1, 4))
    assert (fresh.frame_start, fresh.frame_end) == (2, 4)
    assert np.array_equal(fresh.latents, LATENTS[:, :, 2:4])


def test_failures_that_end_a_stream_and_those_that_reconnect():
    stream = new_stream()
    with pytest.raises(wm.StreamInUseError):
        stream.lost(1008, "another connection took the session")
    with pytest.raises(wm.PayloadTooLargeCodeError, match="max_ws_message_bytes.*fewer frames per chunk"):
        stream.lost(1009, "frame with 300 bytes exceeds limit of 200 bytes")
    draining = json.dumps({"type": "error", "error": {"code": "draining", "message": "m"}})
    assert stream.opened(draining) is False and stream.failures == 1  # resumable: the server closes, reconnect
    with pytest.raises(wm.InvalidInputError):
        stream.opened(json.dumps({"type": "error", "error": {"code": "invalid_input", "message": "m"}}))
    with pytest.raises(wm.ProtocolError):
        stream.opened(unit_message(0, 1))  # a unit before the session event
    stream.opened(session_event(0))
    stream.add(LATENTS[:, :, :4])
    assert stream.received(draining) is None and isinstance(stream.last_error, wm.DrainingError)
    with pytest.raises(wm.InvalidInputError):
        stream.received(json.dumps({"type": "error", "error": {"code": "invalid_input", "message": "bad"}}))
    with pytest.raises(wm.ProtocolError):
        stream.received(json.dumps({"type": "done", "frames": 3}))  # the server counts frames this stream never got
    flushed = new_stream()
    with pytest.raises(wm.StreamClosedError):
        flushed.opened(session_event(0, flushed=True))  # chunks still to send to a flushed session


def test_a_stream_gives_up_after_its_attempts_without_progress():
    stream = new_stream()
    for _ in range(POLICY.attempts - 1):
        stream.failed(wm.TransportError("refused"))
        stream.wait_before_connect()
    stream.failed(wm.TransportError("refused"))
    with pytest.raises(wm.TransportError, match="gave up after 4 failed attempts"):
        stream.wait_before_connect()


def test_a_server_restart_is_waited_for_by_time_not_attempts():
    """A restart of the released model (weights, warm-up, compile) takes minutes: a stream the server closed with
    1012, then refused and answered 503 not_ready while it came back, keeps reconnecting for restart_timeout_s, its
    tries not counted against attempts (4 here, ~2 s of backoff: a new user's stream survived a 27 s restart only on
    its last of 10 tries); once back, the attempts count anew. The same failures with no restart before them (a
    wrong address, a server never reached) still end after the attempts."""
    clock = Clock()
    policy = wm.RetryPolicy(attempts=4, backoff_s=0.1, max_backoff_s=1.0, restart_timeout_s=60.0)
    stream = StreamProtocol("s-000001", CONFIG, policy, prompt=PROMPT, clock=clock)
    stream.opened(session_event(0))
    stream.lost(1012, "service restart")
    not_ready = error_from(503, {"error": {"code": "not_ready", "message": "loading the model"}}, retry_after=1.0)
    for index in range(40):  # 40 tries over ~40 s: ten times the attempts
        clock.now += stream.wait_before_connect()
        stream.refused(wm.TransportError("connection refused") if index < 20 else not_ready)
    assert "the server is restarting: connection 42 in" in stream.reconnect_note(1.0)
    clock.now += stream.wait_before_connect()
    assert stream.opened(session_event(0)) is True  # back: the restart's tries never counted
    stream.failed(wm.TransportError("cut"))
    assert 0 < stream.wait_before_connect() <= policy.backoff_s  # counting (and backing off) anew
    stream.lost(1012, "service restart")
    for _ in range(61):  # past the 60 s from the close
        clock.now += 1.0
        stream.refused(wm.TransportError("connection refused"))
    with pytest.raises(wm.TransportError, match="not back 60 s after it went away to restart"):
        stream.wait_before_connect()
    never_served = StreamProtocol("s-000001", CONFIG, policy, prompt=PROMPT, clock=clock)
    for _ in range(policy.attempts):
        never_served.refused(not_ready)
    with pytest.raises(wm.TransportError, match="gave up after 4 failed attempts"):
        never_served.wait_before_connect()
    # An HTTP request to a server that answered this client before: the same, by restart_timeout_s.
    request = RequestAttempts(policy, "POST /v1/sessions/s-000001/chunks", clock=clock)
    for _ in range(20):
        clock.now += request.after_error(not_ready)
    clock.now += 60
    with pytest.raises(wm.NotReadyError):
        request.after_error(not_ready)
    # A request's failure at exactly restart_timeout_s from the first is its last (as before RestartWindow).
    edge = RequestAttempts(policy, "GET /v1/sessions/s-000001", clock=clock)
    edge.after_error(not_ready)
    clock.now += policy.restart_timeout_s
    with pytest.raises(wm.NotReadyError):
        edge.after_error(not_ready)
    first = RequestAttempts(policy, "GET /v1/info", clock=clock, first_contact=True)
    for _ in range(policy.attempts - 1):
        first.after_error(not_ready)
    with pytest.raises(wm.NotReadyError):
        first.after_error(not_ready)


def test_a_server_that_opens_then_closes_every_connection_does_not_hold_a_stream_for_ever():
    """Every connection gets the session event, then a close 1012 (a proxy's idle timeout says 1001) and no unit:
    the restart's time runs from the first of them, not from each session event, so the stream ends after
    restart_timeout_s (a review saw 5,000 reconnections over 1.6 h, 0.2 s apart). With attempts=1 nothing is
    retried, restarts included, as docs/client.md says."""
    for code in (1012, 1001):
        clock = Clock()
        stream = StreamProtocol("s-000001", CONFIG, wm.RetryPolicy(attempts=10, restart_timeout_s=60.0),
                                prompt=PROMPT, clock=clock)
        connections = 0
        with pytest.raises(wm.TransportError, match="not back 60 s"):
            while connections < 1000:
                clock.now += stream.wait_before_connect()
                connections += 1
                stream.opened(session_event(0))
                clock.now += 1.0
                stream.lost(code, "service restart")
        assert 10 < connections < 70, connections
    once = StreamProtocol("s-000001", CONFIG, wm.RetryPolicy(attempts=1), prompt=PROMPT)
    once.opened(session_event(0))
    once.lost(1012, "service restart")
    with pytest.raises(wm.TransportError, match="gave up after 1 failed attempts"):
        once.wait_before_connect()
    request = RequestAttempts(wm.RetryPolicy(attempts=1), "GET /v1/info")
    with pytest.raises(wm.NotReadyError):
        request.after_error(error_from(503, {"error": {"code": "not_ready", "message": "loading"}}))


def test_a_reconnection_s_note_says_what_ended_the_last_connection_and_which_comes_next():
    stream = new_stream()
    stream.refused(error_from(503, {"error": {"code": "draining", "message": "the server is draining"}},
                              retry_after=3.0))
    wait = stream.wait_before_connect()
    assert stream.reconnect_note(wait) == ("stream of session s-000001: 503 draining (the server is draining); "
                                           "connection 2 of 4 in 3.0 s")
    stream.failed(wm.TransportError("the stream closed before the session event"))
    assert stream.reconnect_note(0.25).endswith("TransportError (the stream closed before the session event); "
                                                "connection 3 of 4 in 0.2 s")


def test_a_refused_handshake_is_retried_only_when_another_try_may_succeed():
    clock = Clock()
    stream = new_stream(known_replica="replica-a", clock=clock)
    stream.refused(error_from(503, {"error": {"code": "draining", "message": "m"}}, retry_after=3.0))
    assert stream.wait_before_connect() == 3.0  # Retry-After is honoured
    stream.refused(error_from(502, HAPROXY_502.decode()))  # the router: the replica died mid-handshake
    stream.refused(wm.TransportError("connection refused"))
    moved = error_from(404, {"error": {"code": "session_not_found", "message": "m"}})
    stream.refused(moved, replica="replica-b")  # another replica, not holding it yet: a move
    clock.now += POLICY.move_timeout_s + 1
    with pytest.raises(wm.SessionNotFoundError):
        stream.refused(moved, replica="replica-b")  # still missing after the move's time: gone
    with pytest.raises(wm.SessionNotFoundError):
        new_stream(known_replica="replica-a").refused(moved, replica="replica-a")  # its own replica: gone at once
    with pytest.raises(wm.SessionNotFoundError):
        new_stream().refused(moved, replica="replica-b")  # never served to this client: unknown, not moving
    with pytest.raises(wm.UnauthorizedError):
        stream.refused(error_from(401, {"error": {"code": "unauthorized", "message": "m"}}))


def test_http_retry_decisions():
    clock = Clock()
    gateway = error_from(502, HAPROXY_502.decode())
    assert isinstance(gateway, wm.errors.BadGatewayError) and is_gateway_error(gateway)
    assert is_gateway_error(error_from(504, "<html>504 Gateway Time-out</html>"))
    assert not is_gateway_error(error_from(500, {"error": {"code": "internal_error", "message": "m"}}))

    chunk = RequestAttempts(POLICY, "POST chunk", idempotent=True, known_replica="replica-a", clock=clock)
    assert 0 < chunk.after_error(gateway, "router") <= POLICY.backoff_s  # a chunk with its seq: safe to repeat
    create = RequestAttempts(POLICY, "POST /v1/sessions", idempotent=False, clock=clock)
    with pytest.raises(wm.errors.BadGatewayError):
        create.after_error(gateway)  # may have created a session: not repeated
    with pytest.raises(wm.TransportError):
        create.after_transport_error(ConnectionResetError("reset"), never_sent=False)
    assert create.after_transport_error(ConnectionRefusedError("refused"), never_sent=True) > 0
    refused = RequestAttempts(POLICY, "POST /v1/sessions", idempotent=False, clock=clock)
    assert refused.after_error(error_from(503, {"error": {"code": "draining", "message": "m"}}, 2.0)) == 2.0

    moved = error_from(404, {"error": {"code": "session_not_found", "message": "m"}})
    state = RequestAttempts(POLICY, "GET state", known_replica="replica-a", clock=clock)
    state.after_error(moved, "replica-b")
    clock.now += POLICY.move_timeout_s - 0.5
    state.after_error(moved, "replica-c")  # within the bound, counted from the first 404
    clock.now += 1.0
    with pytest.raises(wm.SessionNotFoundError):
        state.after_error(moved, "replica-b")
    with pytest.raises(wm.SessionNotFoundError):
        RequestAttempts(POLICY, "GET state", known_replica="replica-a", clock=clock).after_error(moved, "replica-a")
    with pytest.raises(wm.SeqConflictError):
        RequestAttempts(POLICY, "POST chunk", known_replica="replica-a").after_error(
            error_from(409, {"error": {"code": "seq_conflict", "message": "m"}}), "replica-b")
    spent = RequestAttempts(wm.RetryPolicy(attempts=2), "GET", clock=clock)
    spent.after_error(gateway)
    with pytest.raises(wm.errors.BadGatewayError):
        spent.after_error(gateway)  # the attempts bound every retry


def test_chunk_seq():
    seq = ChunkSeq()
    assert not seq.known
    with pytest.raises(RuntimeError):
        seq.take()
    seq.learn(3)
    assert seq.take() == 3 and seq.take() == 3  # taken twice until accepted: a retry repeats its seq
    seq.accepted(3)
    assert seq.take() == 4
    seq.forget()
    assert not seq.known


def test_a_watch_or_error_event_that_is_not_the_service_s_is_a_protocol_error():
    """A broken or hostile server's events end a watch with ProtocolError naming them (they were KeyError /
    AttributeError); the service's own events are handed on as they were."""
    from wm_refiner_client._common import WATCH_SKIP, watch_item

    for bad in ({"type": "block"}, {"type": "block", "frame_start": "x", "frame_end": 3},
                {"type": "dropped", "units": None}, {"type": "error", "error": "boom"},
                {"type": "error", "error": {"code": 5}}):
        with pytest.raises(wm.ProtocolError, match="not the service's"):
            watch_item(json.dumps(bad), "np")
    assert watch_item(json.dumps({"type": "block", "frame_start": 1, "frame_end": 4, "latency_ms": 3.5}), "np") \
        == wm.BlockEvent(1, 4, 3.5)
    assert watch_item(json.dumps({"type": "dropped", "units": 2}), "np") == wm.DroppedEvent(2)
    assert watch_item(json.dumps({"type": "done", "frames": 4}), "np") is None
    assert watch_item(json.dumps({"type": "something-new"}), "np") is WATCH_SKIP
    with pytest.raises(wm.APIError):
        watch_item(json.dumps({"type": "error", "error": {"code": "session_not_found", "message": "m"}}), "np")
