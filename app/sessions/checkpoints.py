"""A live session's durable copy in ``snapshot_dir``: crash checkpoints, the leases that fence them, and the files
of a session that ended.

- ``write_due``: between two pieces of a session's work, its checkpoint when one is due
  (``checkpoint_every_blocks`` / ``checkpoint_interval_s``): a worker thread locks the host buffers, the engine
  queues the copies of its tensors into them (on CUDA on a side stream, without waiting: the session's next work
  waits for them on the device), a worker thread writes the file under the session's lease once they are done
  (``app.persistence.records.write_fenced``) while the session goes on.
- ``renew_forever``: every lease this replica holds (a live session holds one from its creation with a
  ``snapshot_dir``, checkpoints or not) is renewed every third of ``session_lease_s``; one found lost drops its
  session (``lose``).
- ``forget``: a session that ended (deleted, evicted, finished) takes its file and its lease with it, so that no
  replica adopts it back; a background removal, waited for by nothing but tracked until done (``removals``), and
  tried again later where the folder cannot take it now (``app.sessions.endings``).

Everything it uses is given to it by the store that owns the sessions (``SessionStore``): the lease table is the
store's (creation and adoption put leases in it; parking and the drain take them out), shared here by reference.
Lives on the event loop; the session's tensors are read only on the engine thread (``engine.call``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Callable

from models.snapshot import stage_copy
from models.transfer import HostMemoryError

from app.core.metrics import Metrics
from app.core.settings import Settings
from app.engine.engine_errors import Draining
from app.engine.worker import Engine
from app.outputs.delivery import Encoder
from app.persistence import leases
from app.persistence.leases import Lease, LeaseHeld, LeaseLost
from app.persistence.records import record_copy, write_fenced
from app.sessions.endings import Endings
from app.sessions.registry import SessionHandle
from app.sessions.saving import record_of

log = logging.getLogger("app")


class Checkpoints:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        engine: Engine,
        encoder: Encoder,
        *,
        folder: Path | None,
        leases_held: dict[str, Lease],
        endings: Endings,
        draining: Callable[[], bool],
        lose: Callable[[SessionHandle, BaseException], None],
    ):
        """``folder``: snapshot_dir (None: no files, nothing to do); ``leases_held``: the store's table of this
        replica's leases by id (shared: a checkpoint puts its lease there, an ending session takes it out);
        ``endings``: the ended sessions whose file is not fenced off and removed yet (the store's, shared with
        parking);
        ``draining``: a drain is under way (it saves the sessions itself: no checkpoint now); ``lose``: a session
        whose lease another replica took (the store drops it and closes its connections)."""
        self.settings = settings
        self.metrics = metrics
        self.engine = engine
        self.encoder = encoder
        self.folder = folder
        self.leases_held = leases_held
        self.endings = endings
        self.draining = draining
        self.lose = lose
        # Sessions a drain is writing (``app.sessions.drain.save_all``): it lets go of each one's lease as soon as
        # it is written, before the lease table forgets them all, so a renewal round finding such a lease gone must
        # not take it for another replica's. One that another replica did take is the drain's to find and drop (its
        # write is refused: ``app.sessions.drain.save_all``).
        self.saving: set[str] = set()
        self.removals: set[asyncio.Future] = set()  # removals of ended sessions' files, kept until done

    @property
    def enabled(self) -> bool:
        """Crash checkpoints are written (a snapshot_dir and ``checkpoint_every_blocks`` or
        ``checkpoint_interval_s``)."""
        return self.folder is not None and bool(
            self.settings.checkpoint_every_blocks or self.settings.checkpoint_interval_s)

    async def write_due(self, handle: SessionHandle) -> None:
        """Write the session's checkpoint when one is due (``checkpoint_every_blocks`` / ``checkpoint_interval_s``).
        Called by a chunk or stream message that just finished, within the session's turn, so the session is
        between two pieces of work: a worker thread locks the host buffers, the engine queues the copies of its
        tensors into them (one ``call``, between two model calls; on CUDA it does not wait for them, on a CPU it
        clones), and once they are done the file is serialized and written on a worker thread while the session
        goes on. A write still in flight makes this one wait for the next chance; the drain waits for them before it
        saves (``app.sessions.drain``)."""
        settings, folder = self.settings, self.folder
        every, interval = settings.checkpoint_every_blocks, settings.checkpoint_interval_s
        if folder is None or self.draining() or not (every or interval) or _ended(handle):
            return
        blocks = handle.session.state.blocks_refined
        due = (every and blocks - handle.checkpoint_blocks >= every) or (
            interval and blocks != handle.checkpoint_blocks and time.monotonic() - handle.checkpoint_at >= interval)
        if not due or (handle.checkpoint_write is not None and not handle.checkpoint_write.done()):
            return
        if handle.deliveries is not None:
            await handle.deliveries.flush()  # the units it streamed are retained, for a resume after the crash
        record = record_of(handle, self.encoder)
        frames = handle.session.state.frames_received  # the session's turn: nothing of it runs meanwhile
        # The copy's pinned host buffers (a 720p session's 9.6 GiB), locked here: on the engine thread that would
        # stall every session for seconds. Nothing without CUDA.
        try:
            host = await asyncio.to_thread(stage_copy, handle.session)
        except HostMemoryError as exc:
            # Durability first: copied into plain memory on the engine thread, as before staging (a stall).
            log.warning("session %s: its checkpoint is copied without pinned memory, which stalls the engine "
                        "(%s)", handle.id, exc)
            host = None

        def copy():
            # A page-in no forward has waited for yet (a message that only added pending frames) comes first: the
            # copies wait for it, and their event, which takes its place, covers it.
            tensors, metadata, ready = record_copy(record(), host, after=handle.engine_session.ready)
            # The copies are queued, not done: the session's next work waits for them on the device (``wait_for``;
            # its cache is written in place), the writer below waits for them before it reads the bytes.
            if ready is not None:
                handle.engine_session.ready = ready
            return tensors, metadata, ready

        try:
            tensors, metadata, ready = await self.engine.call(copy)
        except Draining:  # the engine stopped (drain): the drain saves the session itself
            return
        metrics, lease = self.metrics, self.leases_held.get(handle.id)
        if lease is None or _ended(handle):
            # It ended (deleted, evicted, lost to another replica) while its units were flushed or its tensors
            # copied: its file and lease went with it (``forget``), and no checkpoint may bring it back. A live
            # session always holds its lease (taken at its creation or adoption), so one is never taken here.
            return
        handle.checkpoint_blocks, handle.checkpoint_at = blocks, time.monotonic()

        def write() -> None:
            if ready is not None:
                ready.synchronize()  # the copies to the host, queued by the engine thread
            started = time.perf_counter()
            # Fenced by the session's lease: a replica that lost it never writes over its new owner's file.
            _, path = write_fenced(folder, handle.id, tensors, metadata, lease=lease,
                                   replica_id=settings.replica_id, lease_s=settings.session_lease_s,
                                   key=settings.signing_key)
            metrics.checkpoint_seconds.observe(time.perf_counter() - started)
            metrics.checkpoint_bytes.inc(path.stat().st_size)

        async def run() -> None:
            try:
                await asyncio.to_thread(write)
            except (LeaseHeld, LeaseLost) as exc:
                if self.leases_held.get(handle.id) is lease:  # not ended or dropped meanwhile
                    self.lose(handle, exc)
                return
            handle.durable_frames = max(handle.durable_frames or 0, frames)

        handle.checkpoint_write = asyncio.ensure_future(run())
        handle.checkpoint_write.add_done_callback(_log_failed_checkpoint)

    def forget(self, handle: SessionHandle) -> None:
        """A session that ended must never be adopted back from its last checkpoint: its floor goes up, then its
        file and its lease go (only while the lease is still this replica's: a session another replica took over
        is not ours to remove), once a write of it in flight is done. Its id is refused from now on until that is
        done, and a folder that cannot take it now has it tried again later (``app.sessions.endings``). The
        registry calls this when a session ends (its ``on_close``)."""
        lease = self.leases_held.get(handle.id)
        if self.folder is None or lease is None:
            return
        self.endings.end(handle.id, lease.generation, lease, handle.engine_session.closed)
        pending = handle.checkpoint_write

        async def remove() -> None:
            if pending is not None:
                await asyncio.wait({pending})
            if self.leases_held.get(handle.id) is lease:  # not a later session's of the same id
                del self.leases_held[handle.id]
            await self.endings.settle(handle.id)

        task = asyncio.ensure_future(remove())
        self.removals.add(task)
        task.add_done_callback(self.removals.discard)

    async def renew_forever(self, live: Callable[[], list[SessionHandle]]) -> None:
        """Renew every lease this replica holds, every third of session_lease_s; a lease found lost drops its
        session (``lose``) when it is one of ``live`` (the registry's sessions) still under that lease."""
        interval = self.settings.session_lease_s / 3
        while True:
            await asyncio.sleep(interval)
            await self._renew_round(live)

    async def _renew_round(self, live: Callable[[], list[SessionHandle]]) -> None:
        """One round, in a call of its own: what it looked at (the sessions live then) goes with it. Kept in the
        loop's locals, the last round's sessions stayed referenced while no lease was held (rounds with none to
        renew replace nothing), so a deleted session's KV cache (device memory on CUDA) was not freed."""
        held = dict(self.leases_held)
        if not held:
            return

        def renew_all() -> dict[str, LeaseLost]:
            lost = {}
            for session_id, lease in held.items():
                try:
                    leases.renew(lease)
                except LeaseLost as exc:
                    lost[session_id] = exc
                except OSError as exc:  # a shared folder that fails now: try again next time, keep the session
                    log.warning("renewing the lease on session %s failed: %r", session_id, exc)
            return lost

        lost = await asyncio.to_thread(renew_all)
        handles = {handle.id: handle for handle in live()}
        for session_id, exc in lost.items():
            handle = handles.get(session_id)
            if (handle is not None and self.leases_held.get(session_id) is held[session_id]
                    and session_id not in self.saving):
                self.lose(handle, exc)


def _log_failed_checkpoint(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("writing a checkpoint failed: %r", task.exception())


def _ended(handle: SessionHandle) -> bool:
    """The session's handle is closed: it ended (deleted, evicted, dropped, spilled), or its output failed (no work
    of it runs again here, so there is nothing new to save)."""
    return handle.engine_session.closed is not None
