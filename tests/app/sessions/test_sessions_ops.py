"""The session operations (app.sessions.operations) driven directly, without HTTP or WebSocket framing: what a route calls."""

from __future__ import annotations

import asyncio
import inspect
import threading

import pytest
import torch

from app.api.routes.stream import StreamConnection
from app.api.routes.watch import Watcher
from app.core.error_kinds import ApiError
from app.outputs.kinds import Outputs
from app.sessions import subscriptions
from app.sessions.operations import RefuseInBand
from app.sessions.subscriptions import StreamSubscriber, WatchSubscriber

from tests.app.conftest import DEADLINE_S, expected_clip, make_clip, payload, read_latents, running_app, wait_until


class FakeConnection:
    """What an operation needs of a stream or watcher connection: where its units go, and how it is closed."""

    def __init__(self, session_id: str = "", outputs: Outputs | None = None):
        self.session_id = session_id
        self.outputs = outputs
        self.sent = []
        self.offered = []
        self.finished = None
        self.closed_with = None
        self.ended = None

    def send_unit(self, unit, force=False):
        self.sent.append(unit)

    def offer(self, unit, received, sent=None, metadata=None):
        self.offered.append(unit)

    def replay(self, units, outputs, resume_from):
        self.replayed = list(units)

    def finish(self, frames):
        self.finished = frames

    def end(self, error):
        self.ended = error

    def close(self, code, reason):
        self.closed_with = (code, reason)

    # What a drain asks of the connections it closes (one of these may still be open at the app's shutdown).
    is_closed = True

    async def closed(self):
        return None

    def abort(self):
        pass


def _body(data: bytes):
    async def read() -> bytes:
        return data

    return read


def _fields(fields: dict):
    async def read() -> dict:
        return dict(fields)

    return read


def test_chunks_through_the_operation_refine_replay_and_reach_watchers(make_settings, refiner):
    latents, embeds, mask = make_clip(frames=10)
    with running_app(make_settings()) as client:
        ops = client.app.state.services.sessions
        created = client.portal.call(ops.create, _fields({"seed": 42}))
        session_id = created["session_id"]
        assert created["config"]["seed"] == 42
        watcher = client.portal.call(ops.watch, session_id, {},
                                     lambda sid, outputs: FakeConnection(sid, outputs))
        chunk = payload(latents[:, :, :7], embeds, mask)
        first, replayed = client.portal.call(ops.submit_chunk, session_id, 0, False, _body(chunk))
        assert not replayed
        again, replayed = client.portal.call(ops.submit_chunk, session_id, 0, False, _body(chunk))
        assert replayed and again == first, "a repeated seq must answer the stored response, not run again"
        last, _ = client.portal.call(ops.submit_chunk, session_id, 1, True, _body(payload(latents[:, :, 7:])))
        refined = torch.cat([read_latents(first)[0], read_latents(last)[0]], dim=2)
        assert torch.equal(refined, expected_clip(refiner, latents, embeds, mask))
        assert len(watcher.offered) >= 2 and watcher.finished == 10
        described = client.portal.call(ops.describe, session_id)
        assert described["frames_returned"] == 10 and described["next_seq"] == 2 and described["watchers"] == 1
        ops.unwatch(watcher)
        assert client.portal.call(ops.describe, session_id)["watchers"] == 0


def test_a_watcher_resuming_while_a_responses_units_are_encoded_waits_for_them(make_settings):
    """An HTTP response's units are offered to watchers at once and kept once encoded. A watcher resuming in
    between (the only encoder thread held here) waits for them, then is sent them again: it is not refused
    resume_unavailable for units the session is about to keep, nor left without units it was never offered."""
    latents, embeds, mask = make_clip(frames=4)
    with running_app(make_settings(encode_workers=1)) as client:
        services = client.app.state.services
        ops = services.sessions
        session_id = client.portal.call(ops.create, _fields({}))["session_id"]
        handle = services.registry.handles()[0]
        gate = threading.Event()
        held = client.portal.start_task_soon(services.encoder.run, gate.wait)
        try:
            chunk = client.portal.start_task_soon(ops.submit_chunk, session_id, None, False,
                                                  _body(payload(latents, embeds, mask)))
            wait_until(lambda: handle.offered_until == 4, "the response's units to be offered")

            async def watch_while_held():
                task = asyncio.ensure_future(ops.watch(session_id, {"resume_from": "0"},
                                                       lambda sid, outputs: FakeConnection(sid, outputs)))
                for _ in range(100):  # loop turns, no clock: enough for a watch that does not wait to be done
                    await asyncio.sleep(0)
                return task, task.done()

            watch, done_while_held = client.portal.call(watch_while_held)
        finally:
            gate.set()
        held.result(DEADLINE_S)
        assert not done_while_held
        watcher = client.portal.call(asyncio.wait_for, watch, DEADLINE_S)
        chunk.result(DEADLINE_S)
        assert [(unit.frame_start, unit.frame_end) for unit in watcher.replayed] == [(0, 1), (1, 4)]
        assert all(unit.in_response for unit in watcher.replayed) and watcher.offered == []
        ops.unwatch(watcher)


def test_a_watcher_resuming_while_its_session_is_deleted_is_refused_not_left_waiting(make_settings):
    """A watcher resuming while an HTTP response's units are being kept waits for them; a DELETE meanwhile ends the
    session and closes its watchers, but not this one, not registered yet. It is refused as a watch of a deleted
    session is (session_not_found), never registered on the ended session, where nothing would ever end it."""
    latents, embeds, mask = make_clip(frames=4)
    with running_app(make_settings(encode_workers=1)) as client:
        services = client.app.state.services
        ops = services.sessions
        session_id = client.portal.call(ops.create, _fields({}))["session_id"]
        handle = services.registry.handles()[0]
        gate = threading.Event()
        held = client.portal.start_task_soon(services.encoder.run, gate.wait)
        try:
            chunk = client.portal.start_task_soon(ops.submit_chunk, session_id, None, False,
                                                  _body(payload(latents, embeds, mask)))
            wait_until(lambda: handle.offered_until == 4, "the response's units to be offered")
            watchers = []

            def subscribe(sid, outputs):
                watchers.append(FakeConnection(sid, outputs))
                return watchers[-1]

            async def watch_then_delete():
                task = asyncio.ensure_future(ops.watch(session_id, {"resume_from": "0"}, subscribe))
                for _ in range(100):  # loop turns, no clock: the watch is waiting for the response's units
                    await asyncio.sleep(0)
                await ops.delete(session_id)
                return task, task.done()

            watch, done_before_delete = client.portal.call(watch_then_delete)
        finally:
            gate.set()
        held.result(DEADLINE_S)
        assert not done_before_delete
        with pytest.raises(ApiError) as refused:
            client.portal.call(asyncio.wait_for, watch, DEADLINE_S)
        assert refused.value.kind == "session_not_found"
        assert watchers == [] and handle.watchers == set()
        chunk.result(DEADLINE_S)  # run before the DELETE: its response is answered


def test_put_is_idempotent_for_one_config_and_refuses_another(make_settings):
    with running_app(make_settings()) as client:
        ops = client.app.state.services.sessions
        body, created = client.portal.call(ops.put, "client-id-0001", _fields({"seed": 3}))
        assert created and body["session_id"] == "client-id-0001"
        again, created = client.portal.call(ops.put, "client-id-0001", _fields({"seed": 3}))
        assert not created and again == body
        with pytest.raises(ApiError) as refused:
            client.portal.call(ops.put, "client-id-0001", _fields({"seed": 4}))
        assert refused.value.kind == "session_exists" and "seed: 3 there, 4 asked" in refused.value.message
        with pytest.raises(ApiError) as bad:
            client.portal.call(ops.put, "short", _fields({}))
        assert bad.value.kind == "invalid_request"


def _claimed_stream(client):
    """A new session with a stream opened and claimed by a stand-in connection."""
    services = client.app.state.services
    ops = services.sessions
    session_id = client.portal.call(ops.create, _fields({}))["session_id"]
    stream = client.portal.call(ops.open_stream, session_id, None)
    connection = FakeConnection(session_id)
    stream.claim(connection)
    return services, ops, session_id, stream, connection


def test_a_stream_claims_its_session_and_a_dropped_one_detaches_it(make_settings):
    with running_app(make_settings()) as client:
        services, ops, session_id, stream, connection = _claimed_stream(client)
        assert connection in services.store.connections
        assert client.portal.call(ops.describe, session_id)["streaming"] is True
        with pytest.raises(ApiError) as in_use:
            client.portal.call(ops.open_stream, session_id, None)
        assert in_use.value.kind == "stream_in_use"
        with pytest.raises(RefuseInBand) as bad_resume:
            client.portal.call(ops.open_stream, session_id, "-1")
        assert bad_resume.value.error.kind == "invalid_request"
        stream.release(connection, dropped=True)
        described = client.portal.call(ops.describe, session_id)
        assert described["streaming"] is False and described["detached"] is True
        assert connection not in services.store.connections


def test_units_reach_a_stream_only_through_the_subscription_it_registered(make_settings):
    latents, embeds, mask = make_clip(frames=10)
    with running_app(make_settings()) as client:
        services, ops, session_id, stream, connection = _claimed_stream(client)
        client.portal.call(stream.message, payload(latents[:, :, :7], embeds, mask))
        client.portal.call(stream.settle)
        handle = services.store.registry.existing(session_id)
        returned = handle.session.state.frames_returned
        sent = [(unit.frame_start, unit.frame_end) for unit in connection.sent]
        assert returned > 0 and sent[0][0] == 0 and sent[-1][1] == returned
        assert sent == [(unit.frame_start, unit.frame_end) for unit in handle.retained]
        # Unsubscribed (the client dropped): later units are only retained, for a reattach.
        stream.release(connection, dropped=True)
        client.portal.call(stream.message, payload(latents[:, :, 7:]))
        client.portal.call(stream.settle)
        assert [(unit.frame_start, unit.frame_end) for unit in connection.sent] == sent
        assert [unit.frame_end for unit in handle.retained][-1] == handle.session.state.frames_returned > returned


def _protocol_members(protocol) -> dict[str, object]:
    members: dict[str, object] = {}
    for cls in reversed(protocol.__mro__):
        if cls.__module__ == subscriptions.__name__:
            members.update({name: value for name, value in vars(cls).items() if not name.startswith("_")})
    return members


@pytest.mark.parametrize("route, protocol", [(StreamConnection, StreamSubscriber), (Watcher, WatchSubscriber)],
                         ids=["stream", "watch"])
def test_the_routes_connections_implement_the_subscriptions_the_sessions_layer_defines(route, protocol):
    members = _protocol_members(protocol)
    assert {"session_id", "close", "closed"} <= members.keys()
    init = inspect.getsource(route.__init__)
    for name, member in members.items():
        if isinstance(member, property):  # an attribute or a property of the connection
            assert hasattr(route, name) or f"self.{name} =" in init, f"{route.__name__} has no {name}"
            continue
        implemented = getattr(route, name, None)
        assert callable(implemented), f"{route.__name__} has no {name}()"
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(member), name
        wanted = list(inspect.signature(member).parameters)
        offered = list(inspect.signature(implemented).parameters)
        assert offered[: len(wanted)] == wanted, f"{route.__name__}.{name}{offered} does not take {wanted}"


def test_delete_ends_the_session_and_closes_its_connections(make_settings):
    with running_app(make_settings()) as client:
        ops = client.app.state.services.sessions
        session_id = client.portal.call(ops.create, _fields({}))["session_id"]
        stream = client.portal.call(ops.open_stream, session_id, None)
        connection = FakeConnection(session_id)
        stream.claim(connection)
        client.portal.call(ops.delete, session_id)
        assert connection.closed_with == (1000, "session deleted")
        with pytest.raises(ApiError) as gone:
            client.portal.call(ops.describe, session_id)
        assert gone.value.kind == "session_not_found"


def test_admission_counts_sessions_and_clips_alike(make_settings):
    with running_app(make_settings(max_sessions=2)) as client:
        services = client.app.state.services
        ops = services.sessions
        client.portal.call(ops.create, _fields({}))
        with services.store.clip():
            assert services.registry.clips == 1
            with pytest.raises(ApiError) as full:
                client.portal.call(ops.create, _fields({}))
            assert full.value.kind == "too_many_sessions" and "1 of them one-shot clips" in full.value.message
        assert services.registry.clips == 0
        client.portal.call(ops.create, _fields({}))
        assert len(services.registry) == 2


@pytest.mark.parametrize("spilled", [False, True], ids=["live", "with-a-spilled-session"])
def test_the_session_list_goes_on_past_a_cursor_that_was_deleted(make_settings, tmp_path, spilled):
    """A page's ``next`` names its last session; deleting (or evicting) that session before the next page is asked
    for must not stop the walk: the list goes on from where it stood. An id never listed is still a 422."""
    with running_app(make_settings(snapshot_dir=tmp_path / "snaps")) as client:
        ids = [client.post("/v1/sessions").json()["session_id"] for _ in range(5)]
        if spilled:  # the listing then includes spilled sessions (SessionStore.listing, not the registry's)
            services = client.app.state.services
            handle = services.registry.existing(ids[4])
            assert client.portal.call(services.store.parking.park, handle)
            assert client.portal.call(services.store.parking.spill, handle)
        first = client.get("/v1/sessions", params={"limit": 2}).json()
        assert first["next"] == ids[1]
        assert client.delete(f"/v1/sessions/{ids[1]}").status_code == 204
        rest = client.get("/v1/sessions", params={"limit": 10, "after": first["next"]})
        assert rest.status_code == 200, rest.text
        assert [s["session_id"] for s in rest.json()["sessions"]] == ids[2:] and rest.json()["next"] is None
        assert client.delete(f"/v1/sessions/{ids[4]}").status_code == 204  # a spilled one's place is kept too
        assert client.get("/v1/sessions", params={"after": ids[4]}).json()["sessions"] == []
        refused = client.get("/v1/sessions", params={"after": "f" * 32})
        assert refused.status_code == 422 and "pass the 'next' of the previous page" in refused.text


@pytest.mark.parametrize("text", ["+4", "4_0", "\u0664", " 4", "4.0", "-1", "x", "", "9" * 30])
def test_resume_from_and_limit_take_decimal_digits_only(text, client):
    """Like every integer in a query (seq, seed): int() would read "4_0" as 40, and the error then name a number
    the client never sent."""
    from app.sessions.operations import parse_resume_from

    with pytest.raises(ApiError, match="is not a frame index"):
        parse_resume_from(text)
    assert parse_resume_from("40") == 40 and parse_resume_from("0") == 0
    assert client.get("/v1/sessions", params={"limit": text}).status_code == 422


def test_a_session_live_on_another_replica_is_503_session_moved_not_404(make_settings, tmp_path):
    """Replica a holds a live session and has written no file of it (no checkpoints): replica b, sharing
    snapshot_dir, knows from the lease where it lives and says so, as its PUT of the same id does."""
    folder = tmp_path / "shared"
    with running_app(make_settings(snapshot_dir=folder, replica_id="replica-a")) as a, \
            running_app(make_settings(snapshot_dir=folder, replica_id="replica-b")) as b:
        sid = a.post("/v1/sessions").json()["session_id"]
        for reply in (b.get(f"/v1/sessions/{sid}"), b.delete(f"/v1/sessions/{sid}"),
                      b.post(f"/v1/sessions/{sid}/chunks?seq=0", content=payload(*make_clip(frames=2)),
                             headers={"Content-Type": "application/octet-stream"})):
            assert reply.status_code == 503, reply.text
            assert reply.json()["error"]["code"] == "session_moved" and "replica-a" in reply.text
            assert int(reply.headers["Retry-After"]) >= 1
        assert a.get(f"/v1/sessions/{sid}").status_code == 200  # nothing of it changed
        assert b.get(f"/v1/sessions/{'e' * 32}").status_code == 404  # an id nobody holds is still unknown


def test_info_memory_and_metrics_carry_the_specified_memory_figures(make_settings):
    """The spec's names (api.md 1.2): /v1/info memory device_budget, device_used, host_used, the same as gauges."""
    from tests.app.conftest import metric_value

    latents, embeds, mask = make_clip(frames=5)
    with running_app(make_settings(device_memory_budget=10**9)) as client:
        sid = client.post("/v1/sessions").json()["session_id"]
        assert client.post(f"/v1/sessions/{sid}/chunks?seq=0", content=payload(latents, embeds, mask),
                           headers={"Content-Type": "application/octet-stream"}).status_code == 200
        memory = client.get("/v1/info").json()["memory"]
        assert (memory["device_budget"], memory["device_used"], memory["host_used"]) == (
            memory["budget"], memory["used"], memory["host"]) and memory["used"] > 0 and memory["host"] > 0
        text = client.get("/metrics").text
        assert metric_value(text, "refiner_device_memory_budget_bytes") == 10**9
        assert metric_value(text, "refiner_device_memory_used_bytes") == memory["device_used"]
        assert metric_value(text, "refiner_host_memory_used_bytes") == memory["host_used"]
    with running_app(make_settings()) as client:  # no budget: the gauge has no sample
        assert client.get("/v1/info").json()["memory"]["device_budget"] is None
        assert "\nrefiner_device_memory_budget_bytes " not in client.get("/metrics").text
