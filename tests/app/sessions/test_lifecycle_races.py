"""Interleavings of a session's lifecycle (app.sessions.parking, app.sessions.checkpoints, app.sessions.store): each
test holds one step on a gate (a worker thread, the engine, an await) while another request runs, the order a busy
server can meet. What must hold: an ended session never comes back, a session asked for is never dropped, the
device bytes held never pass device_memory_budget, room is made while a session could still be parked, and a
cancelled park still records where the session's tensors are."""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading
import time

import pytest
from safetensors import safe_open

import app.outputs.delivery as delivery_module
import app.persistence.leases as leases_module
import app.sessions.checkpoints as checkpoints_module
import app.sessions.parking as parking_module
import app.sessions.store as store_module
from app.persistence.records import LAST_RESPONSE_TENSOR, SUFFIX, has_snapshot
from app.sessions.footprint import handle_bytes
from models import SessionConfig
from models.session import Geometry
from models.session_bytes import session_bytes_estimate

from tests.app.conftest import DEADLINE_S, OCTET, EngineHold, make_clip, payload, running_app, wait_until

LATENTS, EMBEDS, MASK = make_clip(frames=15, seed=31)
FIRST, SECOND = LATENTS[:, :, :5], LATENTS[:, :, 5:10]


def _start(client, sid: str) -> None:
    reply = client.post(f"/v1/sessions/{sid}/chunks?seq=0", content=payload(FIRST, EMBEDS, MASK), headers=OCTET)
    assert reply.status_code == 200, reply.text


def _on_loop(client, predicate):
    """``predicate()`` evaluated on the app's event loop. The loop ends a session (it leaves the registry) and starts
    its file's cleanup (``checkpoints.removals``) in one step; read from the test's thread, between the two, the
    session is gone and no cleanup is under way yet, and a wait for both passed before the cleanup had begun."""
    return client.portal.call(predicate)


def _parked(client):
    """A session that had its first chunk, parked: the services, its id and its handle."""
    services = client.app.state.services
    sid = client.post("/v1/sessions").json()["session_id"]
    _start(client, sid)
    handle = services.registry.existing(sid)
    assert client.portal.call(services.store.parking.park, handle)
    return services, sid, handle


def _gate_threads(monkeypatch, module, name: str, when=lambda *a, **k: True, after: bool = False):
    """Hold the first worker-thread call of ``module.name`` (that ``when`` accepts) until the gate opens: before
    the call, or once it is done (``after``)."""
    gate, entered = threading.Event(), threading.Event()
    real = getattr(module, name)

    def held(*args, **kwargs):
        if (threading.current_thread() is threading.main_thread() or entered.is_set()
                or not when(*args, **kwargs)):
            return real(*args, **kwargs)
        result = real(*args, **kwargs) if after else None
        entered.set()
        gate.wait(DEADLINE_S)
        return result if after else real(*args, **kwargs)

    monkeypatch.setattr(module, name, held)
    return gate, entered


def _used(client, parking) -> int:
    async def read():
        return parking.device_used()
    return client.portal.call(read)


def test_a_session_deleted_before_its_checkpoint_is_written_stays_deleted(make_settings, tmp_path):
    """The DELETE lands after the engine refined the chunk, before its checkpoint: no file, no lease, 404."""
    folder = tmp_path / "snaps"
    with running_app(make_settings(snapshot_dir=folder, checkpoint_every_blocks=1)) as client:
        services = client.app.state.services
        store = services.store
        sid = client.post("/v1/sessions").json()["session_id"]
        real_run = services.encoder.run
        deleted = []

        async def run_then_delete(build, *args, **kwargs):  # the response is encoded: the checkpoint comes next
            if not deleted:
                deleted.append(sid)
                await store.delete(sid)
                await asyncio.wait(set(store.checkpoints.removals))  # its file, floor and lease handled
            return await real_run(build, *args, **kwargs)

        services.encoder.run = run_then_delete
        try:
            _start(client, sid)
        finally:
            services.encoder.run = real_run
        assert deleted
        client.portal.call(asyncio.sleep, 0.3)  # a checkpoint write, had one been started, is done by now
        assert not has_snapshot(folder, sid), "a deleted session's checkpoint was written after its deletion"
        assert sid not in store.leases, "a deleted session's lease is held (and renewed) again"
        assert client.get(f"/v1/sessions/{sid}").status_code == 404


def test_a_session_deleted_while_it_is_spilled_leaves_no_lease_behind(make_settings, tmp_path, monkeypatch):
    """The DELETE lands once the spill's file is in place, before the spill goes on: no file, no lease, 404."""
    gate, entered = _gate_threads(monkeypatch, parking_module, "write_fenced", after=True)
    with running_app(make_settings(snapshot_dir=tmp_path / "snaps")) as client:
        services, sid, handle = _parked(client)
        store, parking = services.store, services.store.parking
        spill = client.portal.start_task_soon(parking.spill, handle)
        assert entered.wait(DEADLINE_S)
        assert client.delete(f"/v1/sessions/{sid}").status_code == 204
        gate.set()
        assert spill.result(DEADLINE_S) is False
        wait_until(lambda: not store.checkpoints.removals, "the deleted session's removal")
        assert sid not in store.leases, "a deleted session's lease was put back in the table"
        assert not has_snapshot(tmp_path / "snaps", sid), "the spill's file of a deleted session stayed"
        assert client.get(f"/v1/sessions/{sid}").status_code == 404


def test_a_request_while_a_spill_lets_go_of_its_lease_adopts_the_session(make_settings, tmp_path, monkeypatch):
    """The spill committed (the session is off the registry) and releases its lease: a chunk sent now waits for
    the release and adopts the file, and goes on from where the session was."""
    gate, entered = _gate_threads(monkeypatch, leases_module, "release")
    with running_app(make_settings(snapshot_dir=tmp_path / "snaps")) as client:
        services, sid, handle = _parked(client)
        parking = services.store.parking
        spill = client.portal.start_task_soon(parking.spill, handle)
        assert entered.wait(DEADLINE_S)
        result = {}
        sender = threading.Thread(target=lambda: result.update(reply=client.post(
            f"/v1/sessions/{sid}/chunks?seq=1", content=payload(SECOND), headers=OCTET)))
        sender.start()
        sender.join(0.5)
        assert sender.is_alive(), "the chunk did not wait for the spill's lease release"
        gate.set()
        assert spill.result(DEADLINE_S) is True
        sender.join(DEADLINE_S)
        assert result["reply"].status_code == 200, result["reply"].text
        adopted = services.registry.existing(sid)
        assert adopted is not handle and adopted.session.state.frames_received == 10
        assert sid in services.store.leases


def test_a_watcher_joining_while_a_spill_lets_go_of_its_lease_gets_the_adopted_session(make_settings, tmp_path,
                                                                                       monkeypatch):
    gate, entered = _gate_threads(monkeypatch, leases_module, "release")
    with running_app(make_settings(snapshot_dir=tmp_path / "snaps")) as client:
        services, sid, handle = _parked(client)
        parking = services.store.parking
        spill = client.portal.start_task_soon(parking.spill, handle)
        assert entered.wait(DEADLINE_S)
        watching = client.portal.start_task_soon(services.sessions.watch, sid, {}, _Watcher)
        gate.set()
        assert spill.result(DEADLINE_S) is True
        watcher = watching.result(DEADLINE_S)
        reply = client.post(f"/v1/sessions/{sid}/chunks?seq=1", content=payload(SECOND), headers=OCTET)
        assert reply.status_code == 200, reply.text
        live = services.registry.existing(sid)
        assert live is not handle and watcher in live.watchers
        assert watcher.offered > 0, "the watcher was left on the spilled handle"


def test_a_listing_while_a_spill_lets_go_of_its_lease_keeps_the_session(make_settings, tmp_path, monkeypatch):
    """The spill committed and its own lease file is still there: a listing must not take that lease for another
    replica's adoption and forget the session (gone from every listing and /v1/info, and a later DELETE adopting it
    back, at max_sessions a 503)."""
    gate, entered = _gate_threads(monkeypatch, leases_module, "release")
    with running_app(make_settings(snapshot_dir=tmp_path / "snaps", max_sessions=1)) as client:
        services, sid, handle = _parked(client)
        parking = services.store.parking
        spill = client.portal.start_task_soon(parking.spill, handle)
        assert entered.wait(DEADLINE_S)
        listed = [s["session_id"] for s in client.get("/v1/sessions").json()["sessions"]]
        assert client.get(f"/v1/sessions/{sid}").json()["state"] == "spilled"
        gate.set()
        assert spill.result(DEADLINE_S) is True
        assert listed == [sid]
        assert [s["session_id"] for s in client.get("/v1/sessions").json()["sessions"]] == [sid]
        assert client.get("/v1/info").json()["memory"]["sessions"]["spilled"] == 1
        assert client.post("/v1/sessions").status_code == 201  # the one live place is taken now
        assert client.delete(f"/v1/sessions/{sid}").status_code == 204  # ended from its file, not adopted first
        assert not has_snapshot(tmp_path / "snaps", sid)


def test_an_adopted_session_is_counted_once_while_its_file_is_removed(make_settings, tmp_path, monkeypatch):
    """Without checkpoints an adoption removes the file once the session is live: meanwhile the room it reserved
    and the session itself are one session's bytes, not two (a memory check then would park or refuse for
    nothing)."""
    gate, entered = _gate_threads(monkeypatch, pathlib.Path, "unlink",
                                  when=lambda path, *a, **k: path.name.endswith(SUFFIX))
    with running_app(make_settings(snapshot_dir=tmp_path / "snaps", device_memory_budget=1 << 40)) as client:
        services, sid, handle = _parked(client)
        parking = services.store.parking
        assert client.portal.call(parking.spill, handle)
        assert _used(client, parking) == 0
        adopting = client.portal.start_task_soon(services.store.lookup, sid)
        assert entered.wait(DEADLINE_S)  # live again, its file being removed
        adopted = services.registry.existing(sid)
        during = _used(client, parking)
        gate.set()
        assert adopting.result(DEADLINE_S) is adopted
        assert during == _used(client, parking) == handle_bytes(adopted)["device"] > 0


def test_a_page_in_keeps_the_room_it_made_while_it_waits(make_settings, refiner, monkeypatch):
    """Session a's page-in made room and waits for its host buffers: b's first chunk must not take that room."""
    one = sum(session_bytes_estimate(refiner.num_layers, refiner.info.inner_dim, SessionConfig(),
                                     Geometry(1, FIRST.shape[1], FIRST.shape[3], FIRST.shape[4]), refiner.dtype,
                                     prompt_tokens=EMBEDS.shape[1], caption_channels=refiner.info.caption_channels,
                                     chunk_frames=FIRST.shape[2]).values())
    budget = int(one * 1.5)
    staged = []
    gate, entered = _gate_threads(monkeypatch, parking_module, "stage_host",
                                  when=lambda session, device: staged.append(device) or len(staged) == 2)
    with running_app(make_settings(device_memory_budget=budget)) as client:
        services = client.app.state.services
        parking = services.store.parking
        a, b = (client.post("/v1/sessions").json()["session_id"] for _ in range(2))
        _start(client, a)
        handle = services.registry.existing(a)
        assert client.portal.call(parking.park, handle)  # the first stage_host call
        result = {}
        sender = threading.Thread(target=lambda: result.update(reply=client.post(
            f"/v1/sessions/{a}/chunks?seq=1", content=payload(SECOND), headers=OCTET)))
        sender.start()
        assert entered.wait(DEADLINE_S)  # a's page-in made room and is staging
        other = client.post(f"/v1/sessions/{b}/chunks?seq=0", content=payload(FIRST, EMBEDS, MASK), headers=OCTET)
        assert other.status_code == 503 and other.json()["error"]["code"] == "insufficient_memory", other.text
        gate.set()
        sender.join(DEADLINE_S)
        assert result["reply"].status_code == 200, result["reply"].text
        assert _used(client, parking) <= budget


def test_two_adoptions_never_share_one_room(make_settings, tmp_path, monkeypatch):
    with running_app(make_settings(snapshot_dir=tmp_path / "snaps")) as client:
        services = client.app.state.services
        store, parking = services.store, services.store.parking
        ids = [client.post("/v1/sessions").json()["session_id"] for _ in range(2)]
        for sid in ids:
            _start(client, sid)
        one = handle_bytes(services.registry.existing(ids[0]))["device"]
        for sid in ids:
            handle = services.registry.existing(sid)
            assert client.portal.call(parking.park, handle) and client.portal.call(parking.spill, handle)
        parking.budget = int(one * 1.5)  # room for one of them
        reads = []
        real_read = store_module.read_record

        def read(*args, **kwargs):  # the first adoption reads its file only once the other got as far as it can
            reads.append(1)
            deadline = time.monotonic() + 2.0
            while len(reads) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            return real_read(*args, **kwargs)

        monkeypatch.setattr(store_module, "read_record", read)

        async def both():
            return await asyncio.gather(*(store.lookup(sid) for sid in ids), return_exceptions=True)

        outcomes = client.portal.call(both)
        codes = sorted(getattr(o, "kind", "adopted") for o in outcomes)
        assert codes == ["adopted", "insufficient_memory"], outcomes
        assert _used(client, parking) <= parking.budget


def test_room_is_made_from_another_idle_session_while_one_is_being_parked(make_settings, monkeypatch):
    armed = []
    gate, entered = _gate_threads(monkeypatch, parking_module, "stage_host", when=lambda *a, **k: bool(armed))
    with running_app(make_settings()) as client:
        services = client.app.state.services
        parking = services.store.parking
        a, b, c = (client.post("/v1/sessions").json()["session_id"] for _ in range(3))
        for sid in (a, b):
            _start(client, sid)
        parking.budget = _used(client, parking) + 1000  # a and b fit; c's first chunk needs one of them parked
        armed.append(1)
        parking_a = client.portal.start_task_soon(parking.park, services.registry.existing(a))  # the upkeep's
        assert entered.wait(DEADLINE_S)
        reply = client.post(f"/v1/sessions/{c}/chunks?seq=0", content=payload(FIRST, EMBEDS, MASK), headers=OCTET)
        assert reply.status_code == 200, reply.text
        assert services.registry.existing(b).memory_state == "parked"
        gate.set()
        assert parking_a.result(DEADLINE_S) is True


@pytest.mark.parametrize("cancels", [1, 2], ids=["cancelled", "cancelled-twice"])
def test_a_park_cancelled_while_its_move_is_queued_still_records_it(make_settings, monkeypatch, cancels):
    # Twice: the request that made room went away, then the server shut down while the move was still queued.
    moved = []
    real_move = parking_module.move_session
    monkeypatch.setattr(parking_module, "move_session",
                        lambda session, device, **kw: moved.append(str(device)) or real_move(session, device, **kw))
    with running_app(make_settings()) as client:
        services = client.app.state.services
        parking = services.store.parking
        sid = client.post("/v1/sessions").json()["session_id"]
        _start(client, sid)
        handle = services.registry.existing(sid)
        hold = EngineHold()
        held = client.portal.start_task_soon(services.engine.call, hold)
        hold.wait_started()

        async def park_then_cancel():
            task = asyncio.ensure_future(parking.park(handle))
            while not services.engine._inbox:  # its move is queued behind the hold
                await asyncio.sleep(0.01)
            for _ in range(cancels):
                task.cancel()
                for _ in range(5):  # the cancellation delivered: the park waits on its queued move again
                    await asyncio.sleep(0)
                assert not task.done()
            hold.release.set()
            return (await asyncio.gather(task, return_exceptions=True))[0]

        outcome = client.portal.call(park_then_cancel)
        held.result(DEADLINE_S)
        assert isinstance(outcome, asyncio.CancelledError)
        assert moved == ["cpu"] and handle.memory_state == "parked"
        reply = client.post(f"/v1/sessions/{sid}/chunks?seq=1", content=payload(SECOND), headers=OCTET)
        assert reply.status_code == 200 and handle.memory_state == "active"


class _Watcher:
    """A watcher's subscriber as ``SessionOps.watch`` builds it, counting what it is offered."""

    is_closed = True

    def __init__(self, session_id, outputs):
        self.session_id, self.outputs = session_id, outputs
        self.offered, self.ended = 0, None

    def offer(self, *args, **kwargs):
        self.offered += 1

    def end(self, error):
        self.ended = error

    def finish(self, frames):
        pass

    def close(self, code, reason):
        self.ended = (code, reason)

    async def closed(self):
        return None

    def abort(self):
        pass


async def _cancel_while_held(task: asyncio.Future, entered: threading.Event, gate: threading.Event, cancels: int):
    """Cancel ``task`` ``cancels`` times while its worker thread is held (a client gone, then a shutdown), then let
    the thread go on; what the task ended with."""
    while not entered.is_set():
        await asyncio.sleep(0.01)
    for _ in range(cancels):
        task.cancel()
        for _ in range(5):  # the cancellation delivered: the task waits on its thread again
            await asyncio.sleep(0)
        assert not task.done(), "the task ended while its worker thread still ran"
    gate.set()
    return (await asyncio.gather(task, return_exceptions=True))[0]


def _held_by_anyone(folder, sid) -> bool:
    return leases_module.held_elsewhere(folder, sid, "another-replica", 60.0) is not None


@pytest.mark.parametrize("cancels", [1, 2], ids=["cancelled", "cancelled-twice"])
def test_a_creation_cancelled_while_it_takes_the_lease_lets_go_of_it(make_settings, tmp_path, monkeypatch, cancels):
    """A PUT whose request was cancelled while the worker thread took the session's lease: the thread takes it
    all the same, and the creation lets go of it before it ends, so the id is free for any replica at once rather
    than nobody's until the lease expires."""
    folder, sid = tmp_path / "snaps", "cancelled-create-1"
    gate, entered = _gate_threads(monkeypatch, leases_module, "acquire", after=True,
                                  when=lambda folder, session_id, *a, **k: session_id == sid)
    with running_app(make_settings(snapshot_dir=folder, session_lease_s=60.0)) as client:
        services = client.app.state.services

        async def no_fields():
            return {}

        async def create_then_cancel():
            return await _cancel_while_held(asyncio.ensure_future(services.sessions.put(sid, no_fields)), entered,
                                            gate, cancels)

        assert isinstance(client.portal.call(create_then_cancel), asyncio.CancelledError)
        assert not _held_by_anyone(folder, sid), "a cancelled creation left the session's lease behind"
        assert sid not in services.store.leases
        assert client.get(f"/v1/sessions/{sid}").status_code == 404
        assert client.put(f"/v1/sessions/{sid}", json={}).status_code == 201


@pytest.mark.parametrize("cancels", [1, 2], ids=["cancelled", "cancelled-twice"])
def test_an_adoption_cancelled_while_it_reads_the_file_lets_go_of_the_lease(make_settings, tmp_path, monkeypatch,
                                                                           cancels):
    """A request for a spilled session was cancelled while its file was read: the lease it took is let go and the
    file stays, so another replica (or this one, next time) adopts the session from where it was."""
    folder = tmp_path / "snaps"
    reading, read = _gate_threads(monkeypatch, store_module, "read_record")
    armed = []  # the spill's own release goes by
    releasing, released = _gate_threads(monkeypatch, leases_module, "release", when=lambda *a, **k: bool(armed))
    with running_app(make_settings(snapshot_dir=folder, session_lease_s=60.0)) as client:
        services, sid, handle = _parked(client)
        assert client.portal.call(services.store.parking.spill, handle) is True
        assert not _held_by_anyone(folder, sid)
        armed.append(1)

        async def adopt_then_cancel():
            # The first cancellation while the file is read, the second while the lease is let go: that release is
            # seen to its end all the same.
            task = asyncio.ensure_future(services.store.lookup(sid))
            while not read.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            reading.set()
            while not released.is_set():
                await asyncio.sleep(0.01)
            for _ in range(cancels - 1):
                task.cancel()
                for _ in range(5):
                    await asyncio.sleep(0)
            assert not task.done(), "the adoption ended while its lease was still being let go"
            releasing.set()
            return (await asyncio.gather(task, return_exceptions=True))[0]

        assert isinstance(client.portal.call(adopt_then_cancel), asyncio.CancelledError)
        assert not _held_by_anyone(folder, sid), "a cancelled adoption left the session's lease behind"
        assert has_snapshot(folder, sid) and services.registry.existing(sid) is None
        reply = client.post(f"/v1/sessions/{sid}/chunks?seq=1", content=payload(SECOND), headers=OCTET)
        assert reply.status_code == 200, reply.text
        assert services.registry.existing(sid).session.state.frames_received == 10


def _floor_read_only(monkeypatch):
    """snapshot_dir is read-only: every ``raise_floor`` fails, and so does every removal of a session's file (an
    ended session's file goes first where only the floor cannot be written: a full folder). Returns the function
    that lets the folder be written again."""
    import errno

    import app.sessions.endings as endings_module

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    patched = [(leases_module, "raise_floor"), (endings_module, "remove_record"), (parking_module, "remove_record")]
    real = [(module, name, getattr(module, name)) for module, name in patched]
    for module, name in patched:
        monkeypatch.setattr(module, name, read_only)

    def writable() -> None:
        for module, name, function in real:
            monkeypatch.setattr(module, name, function)

    return writable


def _refused_while_read_only(client, sid: str, monkeypatch) -> None:
    """DELETE ``sid`` while snapshot_dir is read-only (its floor cannot be raised): 503 server_busy saying the
    session was not deleted; the folder is writable again after it."""
    writable = _floor_read_only(monkeypatch)
    refused = client.delete(f"/v1/sessions/{sid}")
    writable()
    assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
    error = refused.json()["error"]
    assert error["code"] == "server_busy" and "Read-only file system" in error["message"], error
    assert "not deleted" in error["message"], error


def test_a_delete_of_a_spilled_session_the_folder_cannot_take_changes_nothing(make_settings, tmp_path, monkeypatch):
    """snapshot_dir went read-only (or full, or away) after the session was spilled: its DELETE cannot raise the floor
    nor remove the file, so it is a 503 server_busy saying so, and the session stays spilled, listed and counted (it
    was a 500 "the session is unchanged" after it had been dropped from the listing and the count, its file left
    adoptable); the same DELETE works once the folder does."""
    folder = tmp_path / "snaps"
    with running_app(make_settings(snapshot_dir=folder)) as client:
        services, sid, handle = _parked(client)
        assert client.portal.call(services.store.parking.spill, handle)
        _refused_while_read_only(client, sid, monkeypatch)
        assert client.get(f"/v1/sessions/{sid}").json()["state"] == "spilled"
        assert [s["session_id"] for s in client.get("/v1/sessions").json()["sessions"]] == [sid]
        assert client.get("/v1/info").json()["memory"]["sessions"]["spilled"] == 1
        assert has_snapshot(folder, sid)
        assert client.delete(f"/v1/sessions/{sid}").status_code == 204
        assert client.get(f"/v1/sessions/{sid}").status_code == 404
        assert not has_snapshot(folder, sid)


def test_a_delete_of_a_live_session_the_folder_cannot_take_leaves_it_live_and_one_that_ends_never_comes_back(
        make_settings, tmp_path, monkeypatch):
    """A live session with a checkpoint in snapshot_dir, which then goes read-only: its DELETE cannot fence the
    file, so it is a 503 server_busy and the session goes on (it was a 204, and once the folder could be written
    again the next GET adopted the "deleted" session back from its checkpoint). A DELETE whose floor went up but
    whose file could not be removed ends the session for good: another replica refuses the file (410)."""
    import errno

    import app.sessions.endings as endings_module

    folder = tmp_path / "snaps"
    with running_app(make_settings(snapshot_dir=folder, checkpoint_every_blocks=1, replica_id="a")) as client:
        sid = client.post("/v1/sessions").json()["session_id"]
        _start(client, sid)
        wait_until(lambda: has_snapshot(folder, sid), "the session's checkpoint")
        _refused_while_read_only(client, sid, monkeypatch)
        going_on = client.post(f"/v1/sessions/{sid}/chunks?seq=1", content=payload(SECOND), headers=OCTET)
        assert going_on.status_code == 200, going_on.text

        def stuck(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(endings_module, "remove_record", stuck)
        assert client.delete(f"/v1/sessions/{sid}").status_code == 204
        wait_until(lambda: not client.app.state.services.store.checkpoints.removals, "the ended session's removal")
    assert has_snapshot(folder, sid)  # its removal failed: the file stays, fenced off by the floor
    with running_app(make_settings(snapshot_dir=folder, replica_id="b")) as other:
        assert other.get(f"/v1/sessions/{sid}").status_code == 410


def _timed(make_settings, folder, **overrides):
    """The settings of a replica whose sessions' timer runs every half second (ws_reattach_grace_s sets it), whose
    registry's clock the test moves, remembering a single evicted id (the next eviction forgets the one before)."""
    return make_settings(snapshot_dir=folder, replica_id="a", session_retention_s=600.0, ws_reattach_grace_s=1.0,
                         evicted_ids_remembered=1, **overrides)


def test_a_session_evicted_while_the_folder_cannot_fence_it_off_never_comes_back(make_settings, tmp_path,
                                                                                 monkeypatch):
    """A live session with a checkpoint, evicted after session_retention_s while snapshot_dir cannot take its floor:
    no request to refuse, and its file stayed adoptable. Once its id was no longer remembered as evicted, the next
    GET adopted the "evicted" session back from that file. Its id is refused (410) until the timer, once the
    folder can be written, has fenced the file off and removed it; another replica then finds nothing to adopt."""
    folder = tmp_path / "snaps"
    with running_app(_timed(make_settings, folder, checkpoint_every_blocks=1)) as client:
        services, now = client.app.state.services, [time.monotonic()]
        services.registry.clock = lambda: now[0]
        sid, other = (client.post("/v1/sessions").json()["session_id"] for _ in range(2))
        _start(client, sid)
        wait_until(lambda: has_snapshot(folder, sid), "the session's checkpoint")
        writable = _floor_read_only(monkeypatch)
        now[0] += 700.0  # both past their retention: the timer evicts them; the other one is the id remembered
        wait_until(lambda: _on_loop(client, lambda: not services.registry.handles()
                                    and not services.store.checkpoints.removals),
                   "the timer to evict both sessions and try to remove their files")
        assert has_snapshot(folder, sid)
        for reply in (client.get(f"/v1/sessions/{sid}"),
                      client.post(f"/v1/sessions/{sid}/chunks?seq=1", content=payload(SECOND), headers=OCTET)):
            assert reply.status_code == 410, reply.text
            assert "session_retention_s" in reply.json()["error"]["message"], reply.text
        writable()
        wait_until(lambda: not services.store.endings.pending, "the timer to fence off and remove the file")
        assert not has_snapshot(folder, sid) and not _held_by_anyone(folder, sid)
        assert leases_module.read_floor(folder, sid) > 0
    with running_app(make_settings(snapshot_dir=folder, replica_id="b")) as b:
        assert b.get(f"/v1/sessions/{sid}").status_code == 404


def test_a_spilled_session_expired_while_the_folder_cannot_fence_it_off_never_comes_back(make_settings, tmp_path,
                                                                                         monkeypatch):
    """The same for a spilled session past its retention (``Parking.expire_spilled``): its file stayed, and once its
    id was no longer remembered as evicted, a GET adopted it back."""
    folder = tmp_path / "snaps"
    with running_app(_timed(make_settings, folder)) as client:
        services, sid, handle = _parked(client)
        assert client.portal.call(services.store.parking.spill, handle)
        now = [time.monotonic()]
        services.registry.clock = lambda: now[0]
        writable = _floor_read_only(monkeypatch)
        now[0] += 700.0
        wait_until(lambda: not services.store.parking.spilled, "the timer to expire the spilled session")
        assert has_snapshot(folder, sid)
        client.post("/v1/sessions")
        now[0] += 700.0  # evicted after it: the id remembered is this one's
        wait_until(lambda: _on_loop(client, lambda: not services.registry.handles()
                                    and not services.store.checkpoints.removals),
                   "the timer to evict the other session")
        reply = client.get(f"/v1/sessions/{sid}")
        assert reply.status_code == 410 and "session_retention_s" in reply.json()["error"]["message"], reply.text
        writable()
        wait_until(lambda: not services.store.endings.pending, "the timer to fence off and remove the file")
        assert not has_snapshot(folder, sid) and leases_module.read_floor(folder, sid) > 0
    with running_app(make_settings(snapshot_dir=folder, replica_id="b")) as b:
        assert b.get(f"/v1/sessions/{sid}").status_code == 404


def test_a_spilled_session_is_read_deleted_and_expired_without_the_event_loop_touching_the_folder(
        make_settings, tmp_path, monkeypatch):
    """A GET and a DELETE of a spilled session and its expiry look at snapshot_dir (the file, its leases, its floor)
    and write it (the floor, the removal): all on worker threads, so that a stalled network volume stalls them,
    never the event loop (/health, every other session). They ran on the event loop."""
    folder = tmp_path / "snaps"
    with running_app(_timed(make_settings, folder)) as client:
        services = client.app.state.services
        spilled = []
        for _ in range(2):
            _, sid, handle = _parked(client)
            assert client.portal.call(services.store.parking.spill, handle)
            spilled.append(sid)
        loop_thread = client.portal.call(threading.get_ident)
        threads: dict[str, set[int]] = {}
        for module, name in ((leases_module, "generations"), (leases_module, "read_floor"),
                             (leases_module, "raise_floor"), (parking_module, "remove_record")):
            def recorded(*args, _real=getattr(module, name), _name=name, **kwargs):
                threads.setdefault(_name, set()).add(threading.get_ident())
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, name, recorded)
        assert client.get(f"/v1/sessions/{spilled[0]}").json()["state"] == "spilled"
        assert client.delete(f"/v1/sessions/{spilled[0]}").status_code == 204
        assert not has_snapshot(folder, spilled[0])
        now = [time.monotonic() + 700.0]
        services.registry.clock = lambda: now[0]  # past its retention: the timer expires the other one
        wait_until(lambda: not has_snapshot(folder, spilled[1]), "the timer to expire the other spilled session")
        assert set(threads) == {"generations", "read_floor", "raise_floor", "remove_record"}, threads
        on_the_loop = {name for name, idents in threads.items() if loop_thread in idents}
        assert not on_the_loop, f"{sorted(on_the_loop)} ran on the event loop"


def test_a_delete_cancelled_while_its_floor_goes_up_of_a_session_ended_meanwhile_is_still_cancelled(
        make_settings, tmp_path, monkeypatch):
    """A DELETE whose request was cancelled while the worker thread raised the session's floor, and another DELETE
    ended the session meanwhile: the first one ends cancelled (it returned as if it had succeeded, the cancellation
    swallowed), and the session stays ended."""
    folder, sid = tmp_path / "snaps", "cancelled-delete-1"
    ending = []  # (id, floor) of the DELETE's call: past its lease's generation (a checkpoint's write raises it to it)
    gate, entered = _gate_threads(monkeypatch, leases_module, "raise_floor", after=True,
                                  when=lambda folder, *args, **kwargs: tuple(args[:2]) in ending)
    with running_app(make_settings(snapshot_dir=folder, checkpoint_every_blocks=1)) as client:
        services = client.app.state.services
        assert client.put(f"/v1/sessions/{sid}", json={}).status_code == 201
        _start(client, sid)
        wait_until(lambda: has_snapshot(folder, sid), "the session's checkpoint")
        ending.append((sid, services.store.leases[sid].generation + 1))

        async def delete_twice_then_cancel():
            first = asyncio.ensure_future(services.sessions.delete(sid))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            await services.sessions.delete(sid)  # another DELETE (its floor goes up past the gate) ends it meanwhile
            return await _cancel_while_held(first, entered, gate, 1)

        assert isinstance(client.portal.call(delete_twice_then_cancel), asyncio.CancelledError)
        assert client.get(f"/v1/sessions/{sid}").status_code == 404
        wait_until(lambda: not services.store.checkpoints.removals, "the ended session's removal")
        assert not has_snapshot(folder, sid)


def test_a_session_that_ends_while_snapshot_dir_is_full_leaves_no_file_to_adopt(make_settings, tmp_path, monkeypatch):
    """A session evicted (past session_retention_s) while snapshot_dir is full: its floor cannot be written, but its
    file goes all the same (which frees the space; the floor is then raised). It was kept when the floor failed
    first, and another replica adopted the evicted session back from it."""
    import errno

    folder = tmp_path / "snaps"
    ending = []  # (id, floor) of the end's call: past its lease's generation (a checkpoint's write raises it to it)
    real = leases_module.raise_floor

    def full(folder, *args, **kwargs):
        if tuple(args[:2]) in ending:
            ending.clear()  # once: the removal frees the space
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(folder, *args, **kwargs)

    monkeypatch.setattr(leases_module, "raise_floor", full)
    with running_app(make_settings(snapshot_dir=folder, checkpoint_every_blocks=1, session_retention_s=1.0,
                                   replica_id="a")) as client:
        services = client.app.state.services
        sid = client.post("/v1/sessions").json()["session_id"]
        floor = services.store.leases[sid].generation + 1
        ending.append((sid, floor))
        handle = services.registry.existing(sid)
        # The gap between the session leaving the registry and its cleanup starting, widened (a switch of threads
        # under load makes one): the wait below must not end inside it (CI failed so, 1 run in ~10 under load).
        ends, held = services.registry._on_close, threading.Event()
        services.registry._on_close = lambda closed: (held.set(), time.sleep(0.3), ends(closed))
        _start(client, sid)  # its checkpoint is written before its end removes it
        wait_until(lambda: _on_loop(client, lambda: not services.registry.holds(handle)
                                    and not services.store.checkpoints.removals),
                   "the session's eviction and its file's removal")
        assert held.is_set()
        assert not ending, "the end did not try to raise the floor"
    assert not has_snapshot(folder, sid) and leases_module.read_floor(folder, sid) == floor
    with running_app(make_settings(snapshot_dir=folder, replica_id="b")) as other:
        assert other.get(f"/v1/sessions/{sid}").status_code == 404


# --- what a saved record pairs (app.sessions.saving.record_of) ----------------------------------------------------
def _saved(tensors, metadata) -> tuple[dict, int, bytes | None]:
    """A record's service fields, its frames_received and its stored response."""
    response = tensors.get(LAST_RESPONSE_TENSOR)
    return (json.loads(metadata["app"]), json.loads(metadata["state"])["frames_received"],
            None if response is None else response.numpy().tobytes())


def test_a_drain_saves_a_chunk_accepted_before_its_response_is_encoded_with_that_response(make_settings, tmp_path,
                                                                                          monkeypatch):
    """The drain pauses the engine right after seq 1's forward and saves the session while seq 1's response is still
    being encoded (held here). The file counts the chunk (accepted on the loop before the pause's answer reaches the
    drain) and pairs seq 1 with seq 1's response (built for the file from the same builder), never seq 0's bytes or
    frames next_seq does not count; the adopting server replays seq 1 with the bytes its client got.
    ws_resume_units: 0, since a session that keeps its units keeps a one-unit response's own bytes, and its drain
    waits for them (the response is then encoded before the session is saved: no race left to hold)."""
    armed = threading.Event()
    gate, entered = _gate_threads(monkeypatch, delivery_module, "encode", when=lambda *a, **k: armed.is_set())
    folder = tmp_path / "snaps"
    with running_app(make_settings(snapshot_dir=folder, ws_resume_units=0)) as client:
        services = client.app.state.services
        sid = client.post("/v1/sessions").json()["session_id"]
        _start(client, sid)
        hold = EngineHold()
        held = client.portal.start_task_soon(services.engine.call, hold)
        hold.wait_started()
        result = {}
        sender = threading.Thread(target=lambda: result.update(reply=client.post(
            f"/v1/sessions/{sid}/chunks?seq=1", content=payload(SECOND), headers=OCTET)))
        sender.start()
        wait_until(lambda: services.engine.outstanding == 1, "seq 1 to reach the engine")
        armed.set()
        drain = client.portal.start_task_soon(services.drain)
        wait_until(lambda: services.draining, "the drain to start")
        hold.release.set()
        held.result(DEADLINE_S)
        assert entered.wait(DEADLINE_S), "seq 1's response was never encoded"
        assert drain.result(DEADLINE_S)["sessions_saved"] == 1  # while seq 1's response is held
        with safe_open(str(folder / f"{sid}{SUFFIX}"), framework="pt") as file:
            fields, frames, response = _saved({LAST_RESPONSE_TENSOR: file.get_tensor(LAST_RESPONSE_TENSOR)},
                                              dict(file.metadata()))
        gate.set()
        sender.join(DEADLINE_S)
    reply = result["reply"]
    assert reply.status_code == 200, reply.text
    assert (fields["next_seq"], fields["last_seq"], frames) == (2, 1, 10), (fields, frames)
    assert response == reply.content, "the file's response for seq 1 is not the one its client got"
    with running_app(make_settings(snapshot_dir=folder)) as client:
        again = client.post(f"/v1/sessions/{sid}/chunks?seq=1", content=payload(SECOND), headers=OCTET)
        assert again.headers.get("x-replayed") == "true" and again.content == reply.content, again.status_code
        state = client.get(f"/v1/sessions/{sid}").json()
        assert (state["next_seq"], state["frames_received"]) == (2, 10), state


def test_a_spill_saves_the_session_as_it_was_while_a_newer_chunk_waits(make_settings, tmp_path, monkeypatch):
    """A spill's record is read, then built on the engine (held here) while seq 1 arrives: seq 1 waits for the
    session's tensors (the spill holds them) and reaches the engine only after the record is built, so the record
    pairs seq 0 with seq 0's response and seq 0's frames; the spill then gives way to it (the session stays here)."""
    written = []
    real = parking_module.write_fenced
    monkeypatch.setattr(parking_module, "write_fenced", lambda folder, sid, tensors, metadata, **kw: written.append(
        _saved(tensors, metadata)) or real(folder, sid, tensors, metadata, **kw))
    with running_app(make_settings(snapshot_dir=tmp_path / "snaps")) as client:
        services, sid, handle = _parked(client)
        first = client.post(f"/v1/sessions/{sid}/chunks?seq=0", content=payload(FIRST, EMBEDS, MASK), headers=OCTET)
        assert first.headers.get("x-replayed") == "true"  # seq 0's response, as the record must hold it
        hold = EngineHold()
        held = client.portal.start_task_soon(services.engine.call, hold)
        hold.wait_started()
        spill = client.portal.start_task_soon(services.store.parking.spill, handle)
        wait_until(lambda: services.engine._inbox, "the spill's record to be queued on the engine")
        result = {}
        sender = threading.Thread(target=lambda: result.update(reply=client.post(
            f"/v1/sessions/{sid}/chunks?seq=1", content=payload(SECOND), headers=OCTET)))
        sender.start()
        wait_until(lambda: handle.chunks.waiting == 1, "seq 1 to take the session's turn")
        hold.release.set()
        held.result(DEADLINE_S)
        assert spill.result(DEADLINE_S) is False, "the spill did not give way to seq 1"
        sender.join(DEADLINE_S)
        assert result["reply"].status_code == 200, result["reply"].text
        assert handle.chunks.next_seq == 2 and handle.session.state.frames_received == 10
    [(fields, frames, response)] = written
    assert (fields["next_seq"], fields["last_seq"], frames) == (1, 0, 5), (fields, frames)
    assert response == first.content


def test_a_checkpoint_saves_the_chunk_it_follows_while_the_next_one_waits(make_settings, tmp_path, monkeypatch):
    """seq 0 and seq 1 come at once (the engine held): seq 1 waits for the session's turn, which seq 0 holds until
    its checkpoint's record is built, so that checkpoint pairs seq 0 with seq 0's response and frames; a later one
    pairs seq 1 with its own."""
    written = []
    real = checkpoints_module.write_fenced
    monkeypatch.setattr(checkpoints_module, "write_fenced", lambda folder, sid, tensors, metadata, **kw: written.append(
        _saved(tensors, metadata)) or real(folder, sid, tensors, metadata, **kw))
    with running_app(make_settings(snapshot_dir=tmp_path / "snaps", checkpoint_every_blocks=1)) as client:
        services = client.app.state.services
        sid = client.post("/v1/sessions").json()["session_id"]
        handle = services.registry.existing(sid)
        hold = EngineHold()
        held = client.portal.start_task_soon(services.engine.call, hold)
        hold.wait_started()
        replies = {}

        def send(seq: int, body: bytes) -> threading.Thread:
            sender = threading.Thread(target=lambda: replies.update({seq: client.post(
                f"/v1/sessions/{sid}/chunks?seq={seq}", content=body, headers=OCTET)}))
            sender.start()
            return sender

        senders = [send(0, payload(FIRST, EMBEDS, MASK))]
        wait_until(lambda: services.engine.outstanding == 1, "seq 0 to reach the engine")
        senders.append(send(1, payload(SECOND)))
        wait_until(lambda: handle.chunks.waiting == 2, "seq 1 to wait for the session's turn")
        hold.release.set()
        held.result(DEADLINE_S)
        for sender in senders:
            sender.join(DEADLINE_S)
        assert [replies[seq].status_code for seq in (0, 1)] == [200, 200]
        wait_until(lambda: handle.checkpoint_write is not None and handle.checkpoint_write.done(), "the checkpoints")
    responses = {(1, 0, 5): replies[0].content, (2, 1, 10): replies[1].content}
    assert written and (written[0][0]["next_seq"], written[0][0]["last_seq"], written[0][1]) == (1, 0, 5), written
    for fields, frames, response in written:
        assert response == responses[(fields["next_seq"], fields["last_seq"], frames)], (fields, frames)
