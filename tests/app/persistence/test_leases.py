"""Who owns a session in a shared snapshot folder (issue 16 item 9): a replica adopts a session's file only once
its owner released it or the owner's lease expired; a replica that lost its lease has its writes refused and drops
its copy; a starting replica leaves other replicas' writes in progress alone."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import httpx
import pytest

from app.persistence.leases import (
    LeaseHeld,
    LeaseLost,
    abandoned_leases,
    acquire,
    check,
    generations,
    lease_path,
    leased,
    raise_floor,
    read_floor,
    release,
    renew,
)
from app.persistence.records import folder_view
from app.persistence.sweeps import leftover_temporaries
from bench.live import ServerProcess, free_port

from tests.app.conftest import DEADLINE_S, OCTET, LiveServer, make_clip, payload, running_app, wait_until


def test_a_lease_has_one_owner_and_a_successor_fences_the_predecessor(tmp_path):
    first = acquire(tmp_path, "leased-session", "replica-a", lease_s=30.0)
    with pytest.raises(LeaseHeld, match="replica-a"):
        acquire(tmp_path, "leased-session", "replica-b", lease_s=30.0)
    # Expired (its owner stopped renewing 31 s ago): of the replicas racing for it, exactly one wins.
    os.utime(first.path, (time.time() - 31, time.time() - 31))
    results: dict[str, object] = {}
    start = threading.Barrier(4)

    def take(name: str) -> None:
        start.wait()
        try:
            results[name] = acquire(tmp_path, "leased-session", name, lease_s=30.0)
        except LeaseHeld as held:
            results[name] = held

    threads = [threading.Thread(target=take, args=(f"replica-{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
    winners = [lease for lease in results.values() if not isinstance(lease, LeaseHeld)]
    assert len(winners) == 1 and winners[0].generation == 2 and winners[0].previous == "expired"
    with pytest.raises(LeaseLost):
        check(first)
    with pytest.raises(LeaseLost):
        renew(first)
    release(tmp_path, "leased-session", first)  # the loser's release leaves the winner's lease alone
    assert generations(tmp_path, "leased-session") == [2]
    release(tmp_path, "leased-session", winners[0])
    assert generations(tmp_path, "leased-session") == []
    assert acquire(tmp_path, "leased-session", "replica-b", lease_s=30.0).previous == "none"


def test_a_starting_replica_removes_only_its_own_or_abandoned_temporaries(make_settings, tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    ours = folder / ".some-session-1.session.safetensors.replica-b.k2j4h1.tmp"
    theirs = folder / ".some-session-2.session.safetensors.replica-a.x9q8w7.tmp"  # replica-a writing it right now
    abandoned = folder / ".some-session-3.session.safetensors.replica-c.p0o9i8.tmp"
    lease_ours = folder / ".some-session-4.session.lease.0000000002.replica-b.ab12cd34.tmp"
    lease_theirs = folder / ".some-session-5.session.lease.0000000001.replica-a.ef56ab78.tmp"
    similar = folder / ".some-session-6.session.safetensors.replica-b.x.aaaaaa.tmp"  # replica "replica-b.x"'s
    for path in (ours, theirs, abandoned, lease_ours, lease_theirs, similar):
        path.write_bytes(b"partial")
    os.utime(abandoned, (time.time() - 7200, time.time() - 7200))
    assert sorted(leftover_temporaries(folder, "replica-b", time.time())) == sorted([ours, abandoned, lease_ours])
    with running_app(make_settings(snapshot_dir=folder, replica_id="replica-b")):
        assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in (theirs, lease_theirs, similar))


def checkpointed_session(base_url: str, session_id: str, latents, embeds, mask) -> httpx.Response:
    with httpx.Client(base_url=base_url, timeout=DEADLINE_S) as http:
        assert http.put(f"/v1/sessions/{session_id}", json={"block_size": 2}).status_code == 201
        reply = http.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(latents[:, :, :5], embeds, mask),
                          headers=OCTET)
        assert reply.status_code == 200, reply.text
        wait_until(lambda: http.get(f"/v1/sessions/{session_id}").json().get("durable_frames") == 5,
                   "the checkpoint to be written")
        return reply


def test_a_live_replicas_session_is_not_adopted_until_its_lease_expires(make_settings, tmp_path):
    """Replica A (a process) holds a session with a checkpoint; replica B on the same folder is asked for it: 503
    session_moved, nothing adopted, while A lives. A is killed (kill -9): once its lease expires B adopts the
    checkpoint."""
    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=9)
    a = ServerProcess(free_port(), tmp_path / "cache", folder, tmp_path / "a.log", replica_id="replica-a",
                      checkpoint_every_blocks=1, session_lease_s=2.0, model=make_settings().model)
    a.start()
    try:
        checkpointed_session(a.base_url, "leased-session-1", latents, embeds, mask)
        with LiveServer(make_settings(snapshot_dir=folder, replica_id="replica-b", checkpoint_every_blocks=1,
                                      session_lease_s=2.0)) as b:
            http = httpx.Client(base_url=b.base_url, timeout=DEADLINE_S)
            for _ in range(4):  # across more than a lease period: A keeps renewing it
                refused = http.get("/v1/sessions/leased-session-1")
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "session_moved"
                assert "replica-a" in refused.json()["error"]["message"]
                assert 1 <= int(refused.headers["retry-after"]) <= 2
                time.sleep(0.7)
            assert len(b.services.registry) == 0
            assert httpx.get(f"{a.base_url}/v1/sessions/leased-session-1").status_code == 200
            a.kill()
            killed = time.monotonic()
            adopted = wait_until(lambda: (r := http.get("/v1/sessions/leased-session-1")).status_code == 200 and r,
                                 "B to adopt the session once A's lease expired")
            assert time.monotonic() - killed < 10.0, "adopted within about a lease period (2 s) of the kill"
            assert adopted.json()["frames_received"] == 5 and adopted.json()["durable_frames"] == 5
            assert adopted.headers["x-replica"] == "replica-b"
    finally:
        a.kill()


def test_a_replica_that_lost_its_lease_has_its_writes_refused_and_drops_its_copy(make_settings, tmp_path):
    """Replica A stalls (its renewals stop) past session_lease_s; B adopts the session. A's next checkpoint is
    refused (the file stays B's), A drops its copy, and A answers 503 session_moved for it from then on."""
    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=9)
    settings = dict(snapshot_dir=folder, checkpoint_every_blocks=1, session_lease_s=1.0)
    with LiveServer(make_settings(replica_id="replica-a", **settings)) as a, \
            LiveServer(make_settings(replica_id="replica-b", **settings)) as b:
        checkpointed_session(a.base_url, "leased-session-2", latents, embeds, mask)
        renewals = next(t for t in a.services._tasks if t.get_name() == "renew-leases")
        a.loop.call_soon_threadsafe(renewals.cancel)  # A stalls: alive, but it no longer renews
        adopted = wait_until(lambda: (r := httpx.get(f"{b.base_url}/v1/sessions/leased-session-2")).status_code
                             == 200 and r, "B to adopt the session once A's lease expired")
        assert adopted.json()["frames_received"] == 5
        path = folder / "leased-session-2.session.safetensors"
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        late = httpx.post(f"{a.base_url}/v1/sessions/leased-session-2/chunks?seq=1", headers=OCTET,
                          content=payload(latents[:, :, 5:]), timeout=DEADLINE_S)
        assert late.status_code == 200  # refined by A's stale copy: the same bytes B would give
        wait_until(lambda: len(a.services.registry) == 0, "A to drop its copy")
        assert hashlib.sha256(path.read_bytes()).hexdigest() == before, "A's checkpoint was written over B's file"
        moved = httpx.get(f"{a.base_url}/v1/sessions/leased-session-2")
        assert moved.status_code == 503 and moved.json()["error"]["code"] == "session_moved"
        assert "replica-b" in moved.json()["error"]["message"]
        assert httpx.get(f"{b.base_url}/v1/sessions/leased-session-2").status_code == 200


def test_a_session_that_ends_takes_its_checkpoint_and_lease_with_it(make_settings, tmp_path):
    """Deleted: its checkpoint and its lease go (a tracked background removal), so no replica can adopt it back and
    the id is free at once. What stays is its floor marker, one past the generation it ended under: a copy of its
    file put back is refused (test_record_trust), and a new session of the id continues the count."""
    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=9)
    with LiveServer(make_settings(snapshot_dir=folder, replica_id="replica-a", checkpoint_every_blocks=1)) as a:
        checkpointed_session(a.base_url, "ending-session-1", latents, embeds, mask)
        store = a.services.store
        assert "ending-session-1" in store.leases
        assert generations(folder, "ending-session-1") == [1]
        assert httpx.delete(f"{a.base_url}/v1/sessions/ending-session-1").status_code == 204
        wait_until(lambda: [p.name for p in folder.iterdir()] == [".ending-session-1.session.generation"],
                   "the checkpoint and the lease to be removed")
        wait_until(lambda: not store.checkpoints.removals, "the removal to be done and forgotten")
        assert store.leases == {}
        assert read_floor(folder, "ending-session-1") == 2
        assert acquire(folder, "ending-session-1", "replica-b", lease_s=30.0).generation == 3


def test_a_lease_dated_ahead_gives_a_bounded_retry_after_and_is_swept_once_expired(make_settings, tmp_path):
    """Issue 25 item 8: a lease dated in 2039 answered 503 with Retry-After: 2203834436 for ever and no sweep removed
    it. A time read from the folder never runs past session_lease_s from now: ahead by less (clock skew) it holds for
    at most about a lease more; ahead by more it is no renewal any replica wrote, so it is expired at once."""
    folder, lease_s, retention_s = tmp_path / "shared", 30.0, 60.0
    settings = make_settings(snapshot_dir=folder, session_lease_s=lease_s, session_retention_s=retention_s)
    with running_app(settings) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        latents, embeds, mask = make_clip(frames=4)
        assert client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(latents, embeds, mask),
                           headers=OCTET).status_code == 200
    with running_app(settings.model_copy(update={"replica_id": "replica-b"})) as client:
        sweep = client.app.state.services.sweep
        skewed = acquire(folder, session_id, "replica-gone", lease_s)
        ahead = time.time() + lease_s / 2
        os.utime(skewed.path, (ahead, ahead))
        refused = client.get(f"/v1/sessions/{session_id}")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "session_moved"
        assert 1 <= int(refused.headers["retry-after"]) <= lease_s
        sweep.expired_files()
        assert generations(folder, session_id) == [skewed.generation], "a live lease is never swept"

        # The sweep, at the times it would run: the skewed lease once its expiry and a retention passed.
        assert abandoned_leases(folder, time.time(), lease_s, retention_s) == {}
        later = ahead + lease_s + retention_s + 1
        assert abandoned_leases(folder, later, lease_s, retention_s) == {session_id: [skewed.generation]}

        # Dated in 2039: expired at once, swept at the next sweep (no file of it: the lease alone goes).
        far = 2_203_834_436.0 + time.time()
        orphan = acquire(folder, "orphan-session", "replica-gone", lease_s)
        os.utime(orphan.path, (far, far))
        os.utime(skewed.path, (far, far))
        sweep.expired_files()
        assert generations(folder, "orphan-session") == []
        adopted = client.get(f"/v1/sessions/{session_id}")  # the session itself is adopted, not refused till 2039
        assert adopted.status_code == 200, adopted.text


def test_a_generation_past_ten_digits_is_seen_by_every_replica(tmp_path):
    """Generation 9999999999 made the next one 11 digits, which the 10-digit filter no longer saw: another replica
    then took generation 1 of a session that was held. Generations are compared as integers, at any length, in the
    names of leases and in the floor marker."""
    lease_s = 30.0
    last = lease_path(tmp_path, "long-session", 9_999_999_999)
    last.write_text('{"owner": "replica-a"}')
    os.utime(last, (time.time() - 2 * lease_s, time.time() - 2 * lease_s))  # its owner crashed
    held = acquire(tmp_path, "long-session", "replica-b", lease_s)
    assert held.generation == 10_000_000_000 and held.path.name.endswith(".10000000000")
    assert leased(tmp_path) == {"long-session": [10_000_000_000]}
    assert folder_view(tmp_path).leased == {"long-session"}
    with pytest.raises(LeaseHeld, match="replica-b"):
        acquire(tmp_path, "long-session", "replica-c", lease_s)
    check(held)
    # Released after a write under it: the floor keeps the count, at any length.
    raise_floor(tmp_path, "long-session", held.generation, "replica-b")
    release(tmp_path, "long-session", held)
    assert read_floor(tmp_path, "long-session") == 10_000_000_000
    assert acquire(tmp_path, "long-session", "replica-c", lease_s).generation == 10_000_000_001


def test_a_generation_taken_again_after_a_release_fences_its_stalled_first_holder(tmp_path):
    """A holds generation floor + 1 and stalls; B takes floor + 2 and releases it without writing (an adoption
    cancelled or refused); C then takes floor + 1 again. A's renewal and write fence must see that it lost the
    session, though a file of its generation's name is there and none of the next."""
    from app.persistence import leases as _leases

    folder, session_id = tmp_path, "aba-session-1"
    _leases.raise_floor(folder, session_id, 4, "x")
    a = _leases.acquire(folder, session_id, "replica-a", 0.2)
    time.sleep(0.3)
    b = _leases.acquire(folder, session_id, "replica-b", 0.2)
    _leases.release(folder, session_id, b)
    c = _leases.acquire(folder, session_id, "replica-c", 0.2)
    assert c.generation == a.generation  # the count goes on from the floor
    with pytest.raises(_leases.LeaseLost):
        _leases.check(a)
    with pytest.raises(_leases.LeaseLost):
        _leases.renew(a)
    _leases.check(c)


def test_a_deleted_session_is_let_go_while_no_other_session_holds_a_lease(make_settings, tmp_path):
    """The lease renewal kept the sessions it last renewed in a local between its rounds, and a round with no lease
    to renew did not replace them: once the last session was deleted, its handle (KV cache, pending frames, kept
    units: on CUDA device memory the budget counted as free again) stayed referenced until another session took a
    lease and a round passed. Now nothing of the server holds an ended session."""
    import gc
    import weakref

    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=4)
    settings = make_settings(snapshot_dir=folder, replica_id="replica-a", session_lease_s=0.3, warmup=False)
    with LiveServer(settings) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"]
        reply = httpx.post(f"{server.base_url}/v1/sessions/{session_id}/chunks", content=payload(latents, embeds, mask),
                           headers=OCTET, timeout=DEADLINE_S)
        assert reply.status_code == 200, reply.text
        live = server.services.registry.get(session_id)
        handle, session = weakref.ref(live), weakref.ref(live.session)
        del live
        lease = lease_path(folder, session_id, generations(folder, session_id)[-1])
        renewed = os.stat(lease).st_mtime_ns
        wait_until(lambda: os.stat(lease).st_mtime_ns != renewed, "a renewal round with the session live")
        assert httpx.delete(f"{server.base_url}/v1/sessions/{session_id}").status_code == 204
        wait_until(lambda: not server.services.store.checkpoints.removals, "its lease to be removed")

        def let_go() -> bool:
            gc.collect()
            return handle() is None and session() is None

        wait_until(let_go, "the deleted session and its model state to be let go", timeout=10)


def test_a_drain_that_outlasts_a_renewal_round_keeps_the_sessions_it_saved(make_settings, tmp_path, monkeypatch):
    """A drain writes each session and lets go of its lease at once, but the lease table forgot them only once every
    session was written, and renewals go on meanwhile (sessions not written yet keep their leases). A round in
    between found the saved session's lease gone, took it for another replica's and dropped it: a WARNING
    "dropping this replica's copy", its watcher told session_moved instead of the drain's 1012 "session saved".
    Here the second session's write waits until a round has passed after the first was saved."""
    import json

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    import app.sessions.drain as drain
    from app.persistence.records import has_snapshot

    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=4)
    settings = make_settings(snapshot_dir=folder, replica_id="replica-a", session_lease_s=0.3, warmup=False)
    written, go_on = [], threading.Event()
    real_write = drain.write_fenced

    def write_fenced(folder, session_id, *args, **kwargs):
        if written:  # the first session is saved and its lease released: hold the next until a round passed
            assert go_on.wait(DEADLINE_S)
        result = real_write(folder, session_id, *args, **kwargs)
        written.append(session_id)
        return result

    monkeypatch.setattr(drain, "write_fenced", write_fenced)
    with LiveServer(settings) as server:
        sessions = []
        for _ in range(2):
            session_id = httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"]
            reply = httpx.post(f"{server.base_url}/v1/sessions/{session_id}/chunks", headers=OCTET,
                               content=payload(latents, embeds, mask), timeout=DEADLINE_S)
            assert reply.status_code == 200, reply.text
            sessions.append(session_id)
        watchers = [connect(f"{server.ws_url}/v1/sessions/{sid}/watch", open_timeout=DEADLINE_S) for sid in sessions]
        wait_until(lambda: all(httpx.get(f"{server.base_url}/v1/sessions/{sid}").json()["watchers"] == 1
                               for sid in sessions), "both watchers to join")
        drained = server.on_loop(server.services.drain())
        wait_until(lambda: written, "the first session to be saved")
        held = [sid for sid in sessions if sid not in written][0]
        lease = lease_path(folder, held, generations(folder, held)[-1])
        renewed = os.stat(lease).st_mtime_ns
        wait_until(lambda: os.stat(lease).st_mtime_ns != renewed, "a renewal round after the first was saved")
        go_on.set()
        report = drained.result(DEADLINE_S)
        ends = []
        for ws in watchers:
            events = []
            with pytest.raises(ConnectionClosed):
                while True:
                    events.append(json.loads(ws.recv(timeout=DEADLINE_S)))
            ends.append((events, ws.close_code, ws.close_reason))
    assert report["sessions_saved"] == 2 and sorted(written) == sorted(sessions)
    assert all(has_snapshot(folder, sid) for sid in sessions)
    for events, code, reason in ends:
        assert (events, code) == ([], 1012) and reason.startswith("service restart: session saved"), (events, code)


def test_a_session_another_replica_takes_during_a_drain_is_dropped_not_promised_back(make_settings, tmp_path,
                                                                                    monkeypatch):
    """The renewal leaves the sessions a drain writes to the drain, so a session another replica took meanwhile is
    the drain's to drop: its write is refused, and its clients are sent to the new owner (1012 "... moved to
    another replica"), not told 1001 "reconnect after it restarts" to come back to a replica that no longer holds
    it. The other session is saved as before."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    import app.sessions.drain as drain

    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=4)
    settings = make_settings(snapshot_dir=folder, replica_id="replica-a", session_lease_s=30.0, warmup=False)
    real_write = drain.write_fenced
    taken = []

    def write_fenced(folder, session_id, *args, **kwargs):
        if not taken:  # the first session the drain writes: replica B took it over just before
            lease_path(folder, session_id, generations(folder, session_id)[-1]).unlink()
            acquire(folder, session_id, "replica-b", 30.0)
            taken.append(session_id)
        return real_write(folder, session_id, *args, **kwargs)

    monkeypatch.setattr(drain, "write_fenced", write_fenced)
    with LiveServer(settings) as server:
        sessions = []
        for _ in range(2):
            session_id = httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"]
            reply = httpx.post(f"{server.base_url}/v1/sessions/{session_id}/chunks", headers=OCTET,
                               content=payload(latents, embeds, mask), timeout=DEADLINE_S)
            assert reply.status_code == 200, reply.text
            sessions.append(session_id)
        watchers = {sid: connect(f"{server.ws_url}/v1/sessions/{sid}/watch", open_timeout=DEADLINE_S)
                    for sid in sessions}
        wait_until(lambda: all(httpx.get(f"{server.base_url}/v1/sessions/{sid}").json()["watchers"] == 1
                               for sid in sessions), "both watchers to join")
        report = server.on_loop(server.services.drain()).result(DEADLINE_S)
        ends = {}
        for sid, ws in watchers.items():
            with pytest.raises(ConnectionClosed):
                while True:
                    ws.recv(timeout=DEADLINE_S)
            ends[sid] = (ws.close_code, ws.close_reason)
    [lost] = taken
    [saved] = [sid for sid in sessions if sid != lost]
    assert report["sessions_saved"] == 1
    assert ends[lost][0] == 1012 and "moved to another replica" in ends[lost][1], ends[lost]
    assert ends[saved][0] == 1012 and ends[saved][1].startswith("service restart: session saved"), ends[saved]
    with pytest.raises(LeaseHeld, match="replica-b"):  # B's lease is left alone
        acquire(folder, lost, "replica-c", 30.0)
