"""The session store: admission, lookup and adoption, creation and forgetting of sessions.

It holds the live sessions (``app.sessions.registry.Registry``, the in-memory index: lookup, eviction, listing),
admits new ones (``admit``: a count, bytes through ``app.sessions.parking`` at a session's first chunk
(``prepare``), real-time cost through ``app.engine.pacing``), creates them (``create``, under their lease with a
``snapshot_dir``), finds them (``lookup``: live here, else adopted from a file this server or another replica saved
to ``snapshot_dir``) and forgets them (``delete``; ``lose``: another replica took the session). It also keeps
this replica's lease table and the set of open connections (streams and watchers) a deletion, a lost lease or a
drain closes.

What it no longer does, each in a module of its own given its collaborators explicitly: parking, spilling and
page-in (``app.sessions.parking``); crash checkpoints, lease renewal and an ended session's file
(``app.sessions.checkpoints``); the drain's settle and save (``app.sessions.drain``); the idle round of eviction,
parking and sweeps (``app.sessions.upkeep``); the sweeps of ``snapshot_dir`` (``app.persistence.sweeps``, which
need no session object). The registry stays a module of its own too: plain bookkeeping over handles (no files, no
engine, no awaits), which is what its eviction and admission rules need to be read and tested alone.

Lives on the event loop. A live session's tensors are touched only on the engine thread (``engine.call``); an
adopted one is built in host memory on a worker thread before anyone else holds it (``host_session``), then handed
to the engine thread, which moves it to the device.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from models import Prompt, Refiner, RefinerSession, SessionConfig
from models.snapshot import SnapshotUnreadable
from wm_refiner_client import spec

from app.core.error_kinds import WS_SERVICE_RESTART, ApiError
from app.core.metrics import Metrics
from app.core.settings import Settings
from app.core.tasks import in_thread, outlast, retrieve, to_thread_to_the_end
from app.engine.engine_errors import Draining
from app.engine.pacing import Admission
from app.engine.worker import Engine
from app.outputs.delivery import Deliveries, Encoder
from app.outputs.kinds import Outputs
from app.outputs.stage import OutputStages
from app.persistence import leases
from app.persistence.leases import Lease, LeaseHeld, LeaseLost
from app.persistence.records import (
    NewerRecord, SessionRecord, StaleRecord, has_snapshot, host_session, read_record, record_from_tensors,
    snapshot_limits, snapshot_path,
)
from app.sessions.checkpoints import Checkpoints
from app.sessions.endings import Endings
from app.sessions.parking import Parking
from app.sessions.registry import Registry, SessionHandle, page_after
from app.sessions.subscriptions import Connection

log = logging.getLogger("app")


class SessionStore:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        engine: Engine,
        encoder: Encoder,
        refiner: Callable[[], Refiner | None],
        stages: Callable[[], OutputStages],
        deliveries: Callable[[SessionHandle], Deliveries],
    ):
        self.settings = settings
        self.engine = engine
        self._refiner = refiner
        self._stages = stages
        # Open streams and watchers (app.sessions.subscriptions, registered by their routes): a drain closes them
        # with a code saying whether their session was saved.
        self.connections: set[Connection] = set()
        # Set by the drain: no more checkpoints (the drain saves), no idle eviction (it would not remove snapshots).
        self.draining = False
        self._adopting: dict[str, _Turn] = {}
        self._adoption_slots = asyncio.Semaphore(settings.concurrent_adoptions)  # ``_adopt``
        self._creating: dict[str, _Turn] = {}  # PUTs in progress, by id (``creating``)
        # This replica's leases (app.persistence.leases) on the sessions it holds with a file in snapshot_dir, by id:
        # taken here (creation, adoption), shared with parking, the checkpoints and the drain.
        self.leases: dict[str, Lease] = {}
        # Sessions that ended whose file is not fenced off and removed yet (app.sessions.endings): refused meanwhile
        # (``lookup``), tried again by the upkeep timer. Shared by the checkpoints and parking, which end sessions.
        self.endings = Endings(self.snapshot_folder, settings.replica_id)
        # A session's durable copy (app.sessions.checkpoints): crash checkpoints, lease renewal, an ended session's
        # file. Built before the registry, which tells it when a session ends.
        self.checkpoints = Checkpoints(
            settings, metrics, engine, encoder,
            folder=self.snapshot_folder, leases_held=self.leases, endings=self.endings,
            draining=lambda: self.draining, lose=self.lose,
        )
        self.registry = Registry(
            max_sessions=settings.max_sessions,
            idle_timeout_s=settings.retention_s,
            idle_setting="session_retention_s" if settings.session_retention_s is not None else "session_idle_timeout_s",
            remember_evicted=settings.evicted_ids_remembered,
            retry_after_s=settings.retry_after_s,
            reattach_grace_s=settings.ws_reattach_grace_s,
            resume_units=settings.ws_resume_units,
            flushed_ttl_s=settings.flushed_session_ttl_s,
            deliveries=deliveries,
            on_close=self.checkpoints.forget,
            stages=stages,
        )
        # Bytes: accounting, admission by bytes, park / spill / page-in (app.sessions.parking).
        # Given what it uses, and nothing else of the store (a callable where the store's answer changes).
        self.parking = Parking(
            settings, metrics, self.registry, engine, encoder,
            refiner=refiner, folder=self.snapshot_folder, checkpointing=self.checkpoints.enabled,
            leases_held=self.leases, endings=self.endings, draining=lambda: self.draining, lose=self.lose,
        )
        self.registry.spills_at = self.parking.spills_at  # a 503 too_many_sessions counts the spills to come
        # Real-time admission (setting ``admission``): by the engine's measured cost per row (app.engine.pacing).
        self.realtime = Admission(settings, engine.pacer, self.registry.handles, refiner)

    @property
    def snapshot_folder(self) -> Path | None:
        folder = self.settings.snapshot_dir
        return None if folder is None else Path(folder).expanduser()

    # --- admission -----------------------------------------------------------------------------------------
    def admit(self, need_bytes: int = 0, what: str = "a new session", realtime: SessionConfig | None = None) -> None:
        """Room for one more session (or clip): ApiError 503 too_many_sessions past ``max_sessions``, 503
        insufficient_memory when ``need_bytes`` more device bytes do not fit ``device_memory_budget``. A new
        session's bytes are unknown until its first chunk (``prepare``), so they are checked there. A new
        real-time session (``realtime``: its config) must also fit the engine's time (503 over_capacity)."""
        self.registry.require_capacity()
        self.parking.require(need_bytes, what)
        self.realtime.check(realtime)

    async def prepare(self, handle: SessionHandle, shape: tuple[int, ...] | None,
                      prompt_tokens: int | None = None) -> None:
        """Right before work of ``handle`` (frames shaped ``shape``, or None) goes to the engine, within its turn:
        a parked session is brought back to the device, and its bytes with these frames (and a new prompt of
        ``prompt_tokens`` tokens) are reserved, or refused with insufficient_memory, before anything is allocated."""
        handle.last_work = self.registry.clock()
        await self.parking.activate(handle)
        if shape is not None:
            await self.parking.reserve(handle, shape, prompt_tokens)

    async def create(self, refiner: Refiner, config: SessionConfig, prompt: Prompt | None, outputs: Outputs,
                     session_id: str | None = None, realtime: bool = False) -> SessionHandle:
        """A new session under ``session_id`` (a client's, already checked to be free here) or a fresh id;
        ``realtime``: its blocks have deadlines (app.engine.pacing).

        With ``snapshot_dir`` (a folder other replicas may share) the session takes its lease at once, checkpoints
        or not: a live session is one replica's from its creation, so another replica asked to create the same id
        answers 503 session_moved naming the owner instead of forking it (two live copies, whose spills would
        later overwrite each other's file)."""
        admitted = config if realtime else None
        self.admit(realtime=admitted)
        folder = self.snapshot_folder
        if folder is not None:
            await self.parking.require_spill_room()
        session_id = session_id or uuid.uuid4().hex
        lease = None
        if folder is not None:
            lease = await self._claim(folder, session_id)
            try:
                self.admit(realtime=admitted)  # checked again: the place may have gone while the lease was taken
            except BaseException:
                await to_thread_to_the_end(leases.release, folder, session_id, lease)
                raise
            self.leases[session_id] = lease
        handle = self.registry.adopt(session_id, RefinerSession(refiner, config, prompt), outputs=outputs)
        if self.checkpoints.enabled:
            handle.durable_frames = 0  # nothing survives a crash until its first checkpoint
        if realtime:
            handle.engine_session.pacing = self.realtime.pacing(config)
        return handle

    @contextlib.contextmanager
    def clip(self) -> Iterator[None]:
        """A one-shot clip holds a session's place (and its memory) while it is refined."""
        self.admit()
        self.registry.clips += 1
        try:
            yield
        finally:
            self.registry.clips -= 1

    # --- the index -----------------------------------------------------------------------------------------
    async def lookup(self, session_id: str) -> SessionHandle:
        """The session ``session_id``: a live one of this replica, else one adopted from ``snapshot_dir`` (saved by
        a drain or a checkpoint, here or on another replica); ApiError 404 / 410 otherwise."""
        if not spec.is_session_id(session_id):
            # No session was ever given such an id, and it must never reach the snapshot folder as a path.
            raise ApiError("session_not_found", f"no session {session_id[:80]!r}: session ids are "
                                                f"{spec.SESSION_ID_RULE}; use the session_id POST /v1/sessions returned")
        handle = self.registry.existing(session_id)
        if handle is not None:
            handle.taken += 1  # a spill of it now gives way (app.sessions.parking)
            return handle
        folder = self.snapshot_folder
        ended = self.endings.refusal(session_id)
        if ended is not None:  # its file is not fenced off yet: it must not be adopted back
            raise ended
        # A stat of the shared folder (NFS can take seconds): off the event loop, like every call on the folder.
        if folder is not None and await asyncio.to_thread(has_snapshot, folder, session_id):
            if self.draining:
                # A draining server saves what it holds and exits: a session it adopted now would be saved by nobody
                # (the drain's list is taken) and, without checkpoints, its file deleted. It stays in the folder.
                raise _draining(session_id)
            started = time.perf_counter()
            # One adoption per id in this process (other replicas are kept off by the lease). The entry stays in
            # the table while anyone waits on it, so a lookup arriving meanwhile queues on the same lock.
            async with _turn(self._adopting, session_id):
                handle = self.registry.existing(session_id)
                if handle is None:
                    await self.parking.released(session_id)  # a spill of it here lets go of its lease first
                    # Its bytes, from the header, before the claim; counted until it counts for itself.
                    async with self.parking.room_for_file(folder, session_id):
                        handle = await self._adopt(folder, session_id)
            if handle is not None:
                self.parking.paged_in(session_id, started)  # a spilled session of this replica is back
                return handle
        if folder is not None and self.registry.existing(session_id) is None:
            # Live on another replica that has written no file of it yet: say where, rather than "no session".
            held = await asyncio.to_thread(leases.held_elsewhere, folder, session_id, self.settings.replica_id,
                                           self.settings.session_lease_s)
            if held is not None:
                raise _moved(held)
        return self.registry.get(session_id)

    async def delete(self, session_id: str) -> None:
        """End a live session. One with a file in snapshot_dir has its floor raised past its lease's generation
        first (``leases.raise_floor``), so that no file of it is adopted back, even one whose removal then fails; a
        folder that cannot take that now (read-only, full, gone) is 503 server_busy, and the session goes on
        unchanged (it was ended with a 204, its checkpoint left adoptable once the folder could be written again)."""
        lease, folder, cancelled = self.leases.get(session_id), self.snapshot_folder, False
        if lease is not None and folder is not None:
            # Seen to its end: a floor raised under a session that goes on would refuse its own later checkpoints.
            raised = in_thread(leases.raise_floor, folder, session_id, lease.generation + 1, self.settings.replica_id)
            cancelled = await outlast(raised)
            error = raised.exception()
            if error is not None:
                if cancelled:
                    raise asyncio.CancelledError
                log.warning("ending session %s: its floor in %s was not raised (%r)", session_id, folder, error)
                if not isinstance(error, OSError):
                    raise error
                raise ApiError("server_busy", f"snapshot_dir cannot be written now ({error.strerror or error}): "
                                              f"session {session_id} was not deleted and goes on unchanged; retry "
                                              "the DELETE later", retry_after_s=self.settings.retry_after_s)
            if self.registry.existing(session_id) is None:  # it went meanwhile (spilled, ended): ended all the same
                try:
                    forgotten = await self.parking.forget(session_id)
                finally:
                    if cancelled:  # the cancellation wins over the folder's 503 too: the caller has gone
                        raise asyncio.CancelledError
                if forgotten:
                    return
        self.registry.delete(session_id)
        for connection in list(self.connections):
            if connection.session_id == session_id:
                connection.close(1000, "session deleted")
        if cancelled:  # the floor is up: the session was ended first, as a DELETE that went away must still do
            raise asyncio.CancelledError

    def lose(self, handle: SessionHandle, reason: BaseException) -> None:
        """Another replica holds the session's lease now (this one stalled past session_lease_s, or two replicas
        were asked for it): drop this copy without touching the files, and send its clients to the new owner
        (503 session_moved for its work; streams close with 1012, and reconnect through the router)."""
        self.leases.pop(handle.id, None)
        log.warning("session %s: %s; dropping this replica's copy", handle.id, reason)
        error = ApiError("session_moved", f"session {handle.id} moved to another replica ({reason}); retry: "
                                          "through the router the request reaches the replica that holds it now")
        self.registry.drop(handle, error)
        for connection in list(self.connections):
            if connection.session_id == handle.id:
                connection.close(WS_SERVICE_RESTART, "session moved to another replica; reconnect with resume_from")

    def touch(self, handle: SessionHandle) -> None:
        """Work of the session started or ended (a chunk, a stream message): its idle clocks restart."""
        self.registry.touch(handle)
        handle.last_work = self.registry.clock()

    async def listing(self, limit: int, after: str | None) -> tuple[list[Any], str | None]:
        """A page of the sessions, live and spilled (``app.sessions.views.Spilled``), oldest first
        (``app.sessions.views.summary`` shows either)."""
        if not self.parking.spilled:
            return self.registry.listing(limit, after)
        self.registry.evict_idle()
        return page_after(await self.everything(), lambda e: (e.created_at, e.id), after, limit,
                          self.registry.ended_position, "this server")

    def created_at(self, session_id: str) -> float | None:
        """When ``session_id`` was created, if this replica holds it (live or spilled) or it ended here lately."""
        for entry in (*self.registry.handles(), *self.parking.spilled.values()):
            if entry.id == session_id:
                return entry.created_at
        position = self.registry.ended_position(session_id)
        return None if position is None else position[0]

    async def everything(self) -> list[Any]:
        """Every session of this replica: the live ones and the spilled ones whose file is still in snapshot_dir
        (one listing of the folder, off the event loop: ``Parking.stubs``)."""
        spilled = await self.parking.stubs()
        return [*self.registry.handles(), *spilled]

    def tracked(self, session_id: str) -> bool:
        """Whether this replica holds ``session_id`` (live, or spilled by it: its own retention counts GETs), so
        that a sweep of snapshot_dir leaves its files alone (``app.persistence.sweeps``). One this replica ended
        and still remembers as evicted is not held: its file is the sweep's like anyone's (asking the registry
        raised 410 there, which stopped the whole sweep pass)."""
        try:
            live = self.registry.existing(session_id) is not None
        except ApiError:
            live = False
        return live or session_id in self.parking.spilled

    # --- adoption --------------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def creating(self, session_id: str):
        """One creation of ``session_id`` at a time in this process (a PUT's check that the id is free, then its
        creation): two concurrent PUTs of one id must not both take its lease."""
        async with _turn(self._creating, session_id):
            yield

    async def _claim(self, folder: Path, session_id: str) -> Lease:
        """The session's lease for this replica (``app.persistence.leases.acquire``, on a worker thread); 503 session_moved
        naming the owner while another replica holds a live one."""
        settings = self.settings
        claim = in_thread(leases.acquire, folder, session_id, settings.replica_id, settings.session_lease_s)
        # The thread takes the lease whether or not its caller is still there: one cancelled meanwhile (a client
        # gone, a shutdown) lets go of it, or the id would be nobody's until the lease expired.
        cancelled = await outlast(claim)
        error = claim.exception()
        if cancelled:
            if error is None:
                with contextlib.suppress(Exception):  # the cancellation is what goes on; the lease expires then
                    await to_thread_to_the_end(leases.release, folder, session_id, claim.result())
            raise asyncio.CancelledError
        if isinstance(error, LeaseHeld):
            raise _moved(error) from None
        if isinstance(error, OSError):  # the folder's trouble (read-only, full, gone): nothing was taken or changed
            log.warning("taking the lease on session %s in %s failed: %r", session_id, folder, error)
            raise ApiError("server_busy", f"snapshot_dir cannot take session {session_id}'s lease now "
                                          f"({error.strerror or error}); nothing was changed: retry later",
                           retry_after_s=settings.retry_after_s) from None
        return claim.result()

    async def _adopt(self, folder: Path, session_id: str) -> SessionHandle | None:
        """Take the session's lease, load its file and hold the session (None when the file went meanwhile or
        cannot be loaded). 503 session_moved while another replica holds the lease. An adopted session counts
        against max_sessions: when full, the request gets 503 and the file stays for a replica with room. The lease is
        kept while the session lives here. With checkpoints on, the file stays (it is the session's durable copy);
        otherwise it is deleted once loaded, as a drain's snapshot is taken exactly once."""
        settings = self.settings
        self.admit()
        # The place is held across the awaits below, so that concurrent adoptions cannot pass the check together.
        self.registry.clips += 1
        try:
            # A bounded number at a time (concurrent_adoptions): each holds its file and the session built from it in
            # host memory meanwhile (twice the file's size, ~18 GiB for a 720p window). Waited for before the lease is
            # taken, so that waiting costs none of the lease's time.
            await self._adoption_slots.acquire()
            reading: asyncio.Future | None = None  # the worker thread reading and building: the slot is its
            try:
                lease = await self._claim(folder, session_id)
                ended = self.endings.refusal(session_id)
                if ended is not None:  # it ended here (expired, spilled) while the lease was taken: refused
                    await to_thread_to_the_end(leases.release, folder, session_id, lease)
                    raise ended
                path = snapshot_path(folder, session_id)
                refiner, stages = self._refiner(), self._stages()
                limits = snapshot_limits(settings)  # checked from the file's header before anything is allocated
                key, floor = settings.signing_key, lease.floor
                try:
                    # Read, header-checked and (signed) verified on a worker thread: the hash reads every byte of the
                    # file, time the engine thread spends on other sessions' blocks. The session is built there too, in
                    # host memory (pinned on CUDA); the engine thread only checks the record and queues its copies.
                    # The lease is renewed meanwhile, as the engine's queue may be long too.
                    def read_and_build():
                        if not path.is_file():  # removed meanwhile (stat'ed here: never on the event loop)
                            raise FileNotFoundError(path)
                        tensors, metadata = read_record(path, refiner, limits, key, floor, session_id)
                        return tensors, metadata, host_session(refiner, tensors, metadata)

                    async def load() -> SessionRecord:
                        nonlocal reading
                        # A plain future: the thread runs to its end whatever happens to this task, and holds the
                        # slot until then (its file and session are in host memory until it ends).
                        reading = in_thread(read_and_build)
                        tensors, metadata, built = await asyncio.shield(reading)
                        return await self.engine.call(
                            lambda: record_from_tensors(path, tensors, metadata, refiner, stages, session_id, built))

                    record = await self._renewing(lease, load())
                except FileNotFoundError:  # taken and removed by its owner meanwhile (it ended, or a drain-only move)
                    await to_thread_to_the_end(leases.release, folder, session_id, lease)
                    return None
                except (Draining, asyncio.CancelledError):  # a drain began, or the lookup was cancelled (client gone)
                    await to_thread_to_the_end(leases.release, folder, session_id, lease)
                    raise
                except (MemoryError, torch.OutOfMemoryError) as exc:
                    # This machine's memory (host memory to build it in, what it may lock, or the device's) cannot take
                    # the session now: the file is not to blame and stays, for a retry here or another replica (through
                    # the router, once the lease is free).
                    await to_thread_to_the_end(leases.release, folder, session_id, lease)
                    log.warning("session %s in snapshot_dir cannot be held in memory now (%s)", session_id, exc)
                    raise ApiError(
                        "insufficient_memory",
                        f"session {session_id} is saved in snapshot_dir, but this replica cannot hold it in memory now "
                        f"({exc}); nothing was changed: retry later, or another replica takes it",
                        retry_after_s=self.settings.retry_after_s) from None
                except LeaseLost as exc:  # another replica took the session while this one was reading it: it is theirs
                    log.warning("session %s was taken over while it was being adopted here (%s)", session_id, exc)
                    raise ApiError(
                        "session_moved",
                        f"session {session_id} was taken over by another replica while this one was loading it "
                        f"({exc}): it lives there now; retry through the router",
                        retry_after_s=1) from None
                except StaleRecord as exc:
                    # Its client is ahead of it: loading it would answer with an older session under the same id (the
                    # next chunk a 409, or worse, frames refined again from an earlier point). The session's later
                    # state is lost; its id answers 410 saying so, and the file is kept aside for the operator.
                    aside = folder / f"{path.name}.stale"
                    log.warning("snapshot of %s is an older copy (%s); moved aside to %s", session_id, exc, aside.name)
                    self.registry.mark_evicted(session_id, "its file in snapshot_dir turned out to be an older copy of "
                                                           f"it (set aside as {aside.name}): {exc}")
                    await to_thread_to_the_end(_set_aside, path, aside, folder, session_id, lease)
                    return None
                except NewerRecord as exc:
                    # A later version wrote it (a rolling upgrade): this one would misread it, and the file is not at
                    # fault; it stays for a replica of that version (the router's retry, once the lease is free).
                    await to_thread_to_the_end(leases.release, folder, session_id, lease)
                    log.warning("session %s in snapshot_dir was written by a later version (%s); the file is kept",
                                session_id, exc)
                    raise ApiError("server_busy", f"session {session_id} is saved in snapshot_dir by a later version "
                                                  f"of wm-refiner than this replica's ({exc}); nothing was changed: "
                                                  "retry, and a replica of that version serves it",
                                   retry_after_s=settings.retry_after_s) from None
                except SnapshotUnreadable as exc:
                    # An I/O error (the volume, this process's open files, a permission): the file is not known to
                    # be at fault and stays, for a retry here or another replica.
                    await to_thread_to_the_end(leases.release, folder, session_id, lease)
                    if exc.errno == errno.ENOENT:
                        return None  # removed meanwhile, as above
                    log.warning("session %s in snapshot_dir cannot be read now (%s); the file is kept", session_id, exc)
                    raise ApiError("server_busy", f"session {session_id} is saved in snapshot_dir but cannot be read "
                                                  f"now ({exc}); nothing was changed: retry later",
                                   retry_after_s=settings.retry_after_s) from None
                except Exception as exc:
                    aside = folder / f"{path.name}.corrupt"
                    log.warning("snapshot of %s cannot be adopted (%s); moved aside to %s", session_id, exc, aside.name)
                    await to_thread_to_the_end(_set_aside, path, aside, folder, session_id, lease)
                    return None
                if self.draining:
                    # The drain began while the file was read: it saves only the sessions it found, so this one is
                    # not held here (nor its file removed); the lease goes, for the next replica asked.
                    await to_thread_to_the_end(leases.release, folder, session_id, lease)
                    raise _draining(session_id)
            finally:
                if reading is not None and not reading.done():  # given up on (lease lost, cancelled): still reading
                    def let_go(future: asyncio.Future) -> None:
                        retrieve(future)
                        self._adoption_slots.release()

                    reading.add_done_callback(let_go)
                else:
                    self._adoption_slots.release()
        finally:
            self.registry.clips -= 1
        handle = self._hold(record)
        # An owner that stopped renewing crashed: its file may be a checkpoint its clients are ahead of, even one
        # that began as a drain's snapshot.
        handle.from_checkpoint = record.checkpoint or lease.previous != "none"
        # The lease is kept either way: a live session is this replica's until it ends, spills or is drained.
        self.leases[session_id] = lease
        if self.checkpoints.enabled:
            handle.durable_frames = record.session.state.frames_received
            handle.checkpoint_blocks = record.session.state.blocks_refined
        else:
            await to_thread_to_the_end(path.unlink, missing_ok=True)  # the session lives here now, cancelled or not
        log.info("adopted session %s from %s (lease generation %d)", session_id, folder, lease.generation)
        return handle

    async def _renewing(self, lease: Lease, work):
        """``work`` awaited with ``lease`` renewed every third of session_lease_s meanwhile, as a held session's is
        (``Checkpoints.renew_forever``): reading, verifying and building a large session (gigabytes) can outlast one
        lease, and another replica would then take the session mid-adoption. ``LeaseLost`` when it was taken."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.settings.session_lease_s / 3)
                if done:
                    return task.result()
                try:
                    await asyncio.to_thread(leases.renew, lease)
                except OSError as exc:  # the folder's trouble, not the file's: try again at the next period
                    log.warning("renewing the lease on session %s while adopting it failed: %r", lease.session_id, exc)
        finally:
            if not task.done():
                task.cancel()  # its thread runs to its end; what it built is dropped with it

    def _hold(self, record: SessionRecord) -> SessionHandle:
        # A session whose stream was open when it was saved waits ws_reattach_grace_s for its client.
        detached = record.streaming and not record.session.state.flushed
        handle = self.registry.adopt(record.session_id, record.session, detached=detached,
                                     outputs=record.outputs, stages=record.stages)
        if record.created_at is not None:
            handle.created_at = record.created_at
        handle.from_checkpoint = record.checkpoint
        handle.finished = record.session.state.flushed  # its units went out before it was saved
        # Its next forward waits on the device for the copies that brought it (a park, for the copies it reads).
        handle.engine_session.ready = handle.park_ready = record.ready
        if record.realtime:
            handle.engine_session.pacing = self.realtime.pacing(record.session.config)
        handle.chunks.restore(record.next_seq, record.last_seq, record.last_response, record.last_request)
        handle.first_block_done = record.session.state.blocks_refined > 0
        handle.retained.restore(record.units)
        if handle.deliveries is not None and record.units:
            handle.deliveries.handed_until = handle.engine_session.stages.key_at(record.units[-1].frame_end)
        return handle

class _Turn:
    """One id's lock and how many coroutines hold or wait for it (its table entry lives as long as they do)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.waiters = 0


@contextlib.asynccontextmanager
async def _turn(table: dict[str, _Turn], session_id: str):
    """One holder of ``session_id``'s turn in ``table`` at a time; the entry stays while anyone waits on it, so a
    coroutine arriving meanwhile queues on the same lock, and goes once nobody does."""
    turn = table.get(session_id)
    if turn is None:
        turn = table[session_id] = _Turn()
    turn.waiters += 1
    try:
        async with turn.lock:
            yield
    finally:
        turn.waiters -= 1
        if not turn.waiters:
            del table[session_id]


def _draining(session_id: str) -> ApiError:
    return ApiError("draining", f"session {session_id} is saved in snapshot_dir and this server is shutting down: it "
                                "stays there; retry once the server (or, behind a router, another replica) is back")


def _moved(held: LeaseHeld) -> ApiError:
    """503 session_moved for a session another replica holds the live lease on."""
    return ApiError(
        "session_moved",
        f"{held}: the session lives there. Send its requests through the router (or to that replica); if that "
        "replica is gone, this one takes the session once the lease expires: retry then",
        retry_after_s=max(1, math.ceil(held.expires_in)),
    )


def _set_aside(path: Path, aside: Path, folder: Path, session_id: str, lease) -> None:
    """Move a snapshot that cannot be adopted aside for the operator (best effort: gone or unwritable, it stays),
    then release the lease taken to read it. On a worker thread, both: a shared folder can be slow."""
    with contextlib.suppress(OSError):
        os.replace(path, aside)
    leases.release(folder, session_id, lease)
