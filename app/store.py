"""The session store: where sessions live and how they move.

It holds the live sessions (``app.registry.Registry``, the in-memory index: lookup, eviction, listing), admits new
ones (``admit``: a count today), adopts sessions other lives of this server or other replicas saved to
``snapshot_dir`` (``lookup``), writes crash checkpoints between two pieces of a session's work (``checkpoint``)
and, for a drain, settles and saves every live session (``settle``, ``save_all``). It also keeps the set of open
connections (streams and watchers) that a drain closes once the sessions are saved.

The registry stays a module of its own: it is plain bookkeeping over handles (no files, no engine, no awaits),
which is what its eviction and admission rules need to be read and tested alone; the store adds what touches the
disk and the engine around it.

Lives on the event loop. The sessions' tensors are touched only on the engine thread (``engine.call``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from models import Prompt, Refiner, RefinerSession, SessionConfig
from wm_refiner_client import spec

from .delivery import Deliveries, Encoder
from .engine import Engine
from .engine_errors import Draining
from .errors import ApiError
from .metrics import Metrics
from .outputs import Outputs
from .realtime import Admission
from .registry import Registry, SessionHandle
from .resume import SentUnit
from .settings import Settings
from .snapshots import (
    SUFFIX,
    SessionRecord,
    claim,
    has_snapshot,
    load_record,
    record_tensors,
    release_claim,
    remove_record,
    save_record,
    snapshot_limits,
    write_record,
)
from .stages import OutputStages

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
        self.metrics = metrics
        self.engine = engine
        self.encoder = encoder
        self._refiner = refiner
        self._stages = stages
        self.registry = Registry(
            max_sessions=settings.max_sessions,
            idle_timeout_s=settings.session_idle_timeout_s,
            remember_evicted=settings.evicted_ids_remembered,
            retry_after_s=settings.retry_after_s,
            reattach_grace_s=settings.ws_reattach_grace_s,
            resume_units=settings.ws_resume_units,
            flushed_ttl_s=settings.flushed_session_ttl_s,
            deliveries=deliveries,
            on_close=self._forget_checkpoint,
            stages=stages,
        )
        # Open streams and watchers (app.routes.stream.StreamConnection, app.routes.watch.Watcher): a drain
        # closes them with a code saying whether their session was saved.
        self.connections: set[Any] = set()
        # Set by the drain: no more checkpoints (the drain saves), no idle eviction (it would not remove snapshots).
        self.draining = False
        self._adopting: dict[str, asyncio.Lock] = {}
        # Real-time admission (setting ``admission``): by the engine's measured cost per row (app.realtime).
        self.realtime = Admission(settings, engine.pacer, self.registry.handles, refiner)

    @property
    def snapshot_folder(self) -> Path | None:
        folder = self.settings.snapshot_dir
        return None if folder is None else Path(folder).expanduser()

    # --- admission -----------------------------------------------------------------------------------------
    def admit(self, realtime: SessionConfig | None = None) -> None:
        """Room for one more session (or clip), or ApiError 503 too_many_sessions. A count today
        (``max_sessions``); a memory budget (bytes held by the sessions) is the next check to add here. A new
        real-time session (``realtime``: its config) must also fit the engine's time (503 over_capacity)."""
        self.registry.require_capacity()
        self.realtime.check(realtime)

    def create(self, refiner: Refiner, config: SessionConfig, prompt: Prompt | None, outputs: Outputs,
               session_id: str | None = None, realtime: bool = False) -> SessionHandle:
        """A new session under ``session_id`` (a client's, already checked to be free) or a fresh id;
        ``realtime``: its blocks have deadlines (app.realtime)."""
        self.admit(config if realtime else None)
        handle = self.registry.adopt(session_id or uuid.uuid4().hex, RefinerSession(refiner, config, prompt),
                                     outputs=outputs)
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
            return handle
        folder = self.snapshot_folder
        if folder is not None and has_snapshot(folder, session_id):
            lock = self._adopting.setdefault(session_id, asyncio.Lock())
            async with lock:  # one adoption per id in this process; other replicas are kept off by the claim
                handle = self.registry.existing(session_id) or await self._adopt(folder, session_id)
            self._adopting.pop(session_id, None)
            if handle is not None:
                return handle
        return self.registry.get(session_id)

    def delete(self, session_id: str) -> None:
        self.registry.delete(session_id)
        for connection in list(self.connections):
            if connection.session_id == session_id:
                connection.close(1000, "session deleted")

    def touch(self, handle: SessionHandle) -> None:
        self.registry.touch(handle)

    def listing(self, limit: int, after: str | None) -> tuple[list[SessionHandle], str | None]:
        return self.registry.listing(limit, after)

    def handles(self) -> list[SessionHandle]:
        return self.registry.handles()

    async def evict_forever(self) -> None:
        settings = self.settings
        interval = min(settings.session_idle_timeout_s / 2, settings.ws_reattach_grace_s / 2, 5.0)
        while True:
            await asyncio.sleep(interval)
            if self.draining:
                # The sessions are saved as they stand; evicting them now would not remove their snapshots.
                continue
            evicted = self.registry.evict_idle()
            if evicted:
                log.info("evicted %d idle session(s)", len(evicted))

    # --- crash checkpoints ---------------------------------------------------------------------------------------
    async def checkpoint(self, handle: SessionHandle) -> None:
        """Write the session's checkpoint when one is due (``checkpoint_every_blocks`` / ``checkpoint_interval_s``).
        Called by a chunk or stream message that just finished, within the session's turn, so the session is
        between two pieces of work: the engine copies its tensors (one ``call``, between two model calls), and the
        file is serialized and written on a worker thread while the session goes on. A write still in flight makes
        this one wait for the next chance; the drain waits for them before it saves."""
        settings, folder = self.settings, self.snapshot_folder
        every, interval = settings.checkpoint_every_blocks, settings.checkpoint_interval_s
        if folder is None or self.draining or not (every or interval):
            return
        blocks = handle.session.state.blocks_refined
        due = (every and blocks - handle.checkpoint_blocks >= every) or (
            interval and blocks != handle.checkpoint_blocks and time.monotonic() - handle.checkpoint_at >= interval)
        if not due or (handle.checkpoint_write is not None and not handle.checkpoint_write.done()):
            return
        if handle.deliveries is not None:
            await handle.deliveries.flush()  # the units it streamed are retained, for a resume after the crash
        record = _record(handle, self.encoder)
        try:
            tensors, metadata = await self.engine.call(lambda: record_tensors(record(), copy=True))
        except Draining:  # the engine stopped (drain): the drain saves the session itself
            return
        handle.checkpoint_blocks, handle.checkpoint_at = blocks, time.monotonic()
        metrics = self.metrics

        def write() -> None:
            started = time.perf_counter()
            path = write_record(folder, handle.id, tensors, metadata)
            metrics.checkpoint_seconds.observe(time.perf_counter() - started)
            metrics.checkpoint_bytes.inc(path.stat().st_size)

        handle.checkpoint_write = asyncio.ensure_future(asyncio.to_thread(write))
        handle.checkpoint_write.add_done_callback(_log_failed_checkpoint)

    def _forget_checkpoint(self, handle: SessionHandle) -> None:
        """A session that ended must never be adopted back from its last checkpoint."""
        folder = self.snapshot_folder
        if folder is None or not (self.settings.checkpoint_every_blocks or self.settings.checkpoint_interval_s):
            return
        pending = handle.checkpoint_write

        async def remove() -> None:
            if pending is not None:
                await asyncio.wait({pending})
            await asyncio.to_thread(remove_record, folder, handle.id)

        asyncio.ensure_future(remove())

    # --- adoption --------------------------------------------------------------------------------------------
    async def _adopt(self, folder: Path, session_id: str) -> SessionHandle | None:
        """Claim the session's file (None when another replica was first), load it and hold the session. An adopted
        session counts against max_sessions: when full, the file goes back and the request gets 503."""
        claimed = claim(folder, session_id, self.settings.replica_id)
        if claimed is None:
            return None
        try:
            self.admit()
        except ApiError:
            release_claim(claimed, session_id)
            raise
        refiner, stages = self._refiner(), self._stages()
        try:
            limits = snapshot_limits(self.settings)  # checked from the file's header before anything is allocated
            record = await self.engine.call(lambda: load_record(claimed, refiner, stages, session_id, limits))
        except Exception as exc:
            aside = folder / f"{session_id}{SUFFIX}.corrupt"
            log.warning("snapshot of %s cannot be adopted (%s); moved aside to %s", session_id, exc, aside.name)
            with contextlib.suppress(OSError):
                os.replace(claimed, aside)
            return None
        handle = self._hold(record)
        claimed.unlink(missing_ok=True)
        log.info("adopted session %s from %s", session_id, folder)
        return handle

    def _hold(self, record: SessionRecord) -> SessionHandle:
        # A session whose stream was open when it was saved waits ws_reattach_grace_s for its client.
        detached = record.streaming and not record.session.state.flushed
        handle = self.registry.adopt(record.session_id, record.session, detached=detached,
                                     outputs=record.outputs, stages=record.stages)
        if record.created_at is not None:
            handle.created_at = record.created_at
        handle.from_checkpoint = record.checkpoint
        chunks = handle.chunks
        chunks.next_seq, chunks.last_seq, chunks.last_response = record.next_seq, record.last_seq, record.last_response
        handle.first_block_done = record.session.state.blocks_refined > 0
        handle.retained.restore(record.units)
        if handle.deliveries is not None and record.units:
            handle.deliveries.handed_until = handle.engine_session.stages.key_at(record.units[-1].frame_end)
        return handle

    def clean_snapshot_dir(self) -> None:
        """Writes that never reached their rename are garbage; claims of this replica id from an earlier life of
        it (a crash between claim and load) go back to the folder. Nothing else is touched: sessions are adopted on
        their first request, by whichever replica the router sends it to."""
        folder = self.snapshot_folder
        if folder is None or not folder.is_dir():
            return
        for leftover in folder.glob(f".*{SUFFIX}.*.tmp"):
            leftover.unlink(missing_ok=True)
        for stale in folder.glob(f".*{SUFFIX}.claimed-{self.settings.replica_id}"):
            session_id = stale.name[1 : -len(f"{SUFFIX}.claimed-{self.settings.replica_id}")]
            with contextlib.suppress(OSError, ValueError):  # ValueError: not a session's name, not ours to move
                release_claim(stale, session_id)

    # --- drain snapshots ---------------------------------------------------------------------------------------
    async def settle(self) -> list[SessionHandle]:
        """Once the engine is paused: every committed unit delivered (so retained), and no checkpoint write still
        in flight (it must not land after, and over, the drain's snapshot). Returns the live sessions."""
        handles = self.registry.handles()
        await asyncio.gather(*(h.deliveries.flush() for h in handles if h.deliveries is not None),
                             return_exceptions=True)
        writes = [h.checkpoint_write for h in handles if h.checkpoint_write is not None]
        if writes:
            await asyncio.wait(writes)
        return handles

    async def save_all(self, handles: list[SessionHandle]) -> set[str]:
        """Write every session of ``handles`` to ``snapshot_dir`` (none when unset), on the engine thread (paused by
        now, so no forward can run while a session is read). Returns the ids written."""
        folder = self.snapshot_folder
        if folder is None:
            return set()
        # The service's fields that live on the loop are read here, on the loop.
        records = {handle.id: _record(handle, self.encoder) for handle in handles}

        def save_all() -> set[str]:
            written = set()
            for session_id, record in records.items():
                try:
                    save_record(folder, record())
                except Exception:  # one session that cannot be saved must not cost the others
                    log.exception("drain: could not save session %s", session_id)
                    continue
                written.add(session_id)
            return written

        try:
            written = await self.engine.call(save_all)
        except Exception:
            log.exception("drain: saving sessions to %s failed", folder)
            return set()
        log.info("drain: saved %d of %d session(s) to %s", len(written), len(handles), folder)
        return written


def _record(handle: SessionHandle, encoder: Encoder) -> Callable[[], SessionRecord]:
    """What saving ``handle`` writes, read now (on the loop); the returned function builds the record (on the
    engine thread: it may encode the last response)."""
    chunks = handle.chunks
    units = list(handle.retained)
    streaming = handle.streaming or handle.detached
    next_seq, last_seq = chunks.next_seq, chunks.last_seq

    def build() -> SessionRecord:
        return SessionRecord(handle.id, handle.session, next_seq, last_seq, chunks.stored_response(), units, streaming,
                             encode=encode, outputs=handle.outputs, stages=handle.engine_session.stages,
                             created_at=handle.created_at)

    def encode(unit: SentUnit) -> bytes:
        return encoder.unit_bytes(unit.host, unit.outputs, time.perf_counter())

    return build


def _log_failed_checkpoint(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("writing a checkpoint failed: %r", task.exception())
