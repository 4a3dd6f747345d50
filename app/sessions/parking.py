"""Sessions by memory: byte accounting, admission by bytes, and parking, spilling and paging sessions back in.

A session is in one of three states (``memory_state`` on its handle, ``state`` in its JSON and metrics):

    active    its KV cache, pending frames and prompt are on the device, counted against device_memory_budget
    parked    no work for park_after_s: those tensors moved to host memory (pinned, on CUDA); they come back
              before its next work runs. On a CPU server the tensors already are in host memory and stay where
              they are: parking there only moves the session's bytes out of the budget (the state machine, the
              accounting and page-in run exactly as on CUDA)
    spilled   no request for spill_after_s: written to snapshot_dir like a drain's snapshot (adoptable by any
              replica) and dropped from memory; the next request adopts it back from the file
              (``SessionStore.lookup``). Without snapshot_dir nothing spills: a session stays parked until
              session_retention_s

and is deleted (410 ``session_evicted``) only session_retention_s after its last request, whatever its state.

Who moves tensors: only the engine thread (``engine.call``, between two of its iterations), and only for a
session excluded from scheduling: a session is parked or spilled only when it has no work queued or running, no
HTTP request in flight and no stream message in progress, and every state change of one session happens under
its own lock (``SessionHandle.moving``), which ``activate`` (the step before any work of the session is handed to
the engine) also takes: work never reaches the engine while the session's tensors are away or moving. On CUDA the
copies themselves run on a side stream (``models.move.Move``): the engine thread only queues them.

A spill writes the file with the lock held and commits it (drops the session from memory) only if nothing took the
session meanwhile (no lookup handed it to a request, no stream or watcher attached, no work); otherwise the file is
removed and the session stays parked. A GET reads a spilled session from what was saved, without bringing it back.

Admission by bytes (``device_memory_budget``): a session's bytes are known once its geometry is, at its first chunk
(``models.session_bytes.session_bytes_estimate``, prompt and rollback copies included, before anything is allocated;
again at a later chunk that makes it hold more); what does not fit is refused with 503
``insufficient_memory`` after the least recently used sessions with no work were parked to make room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from models import Refiner
from models.move import move_session, stage_host
from models.session import Geometry
from models.session_bytes import session_bytes_estimate
from models.snapshot import SnapshotError, _read_metadata, read_header

from app.core.error_kinds import ApiError
from app.core.metrics import Metrics
from app.core.settings import Settings
from app.core.tasks import in_thread, outlast
from app.engine.worker import Engine
from app.outputs.delivery import Encoder
from app.persistence import leases
from app.persistence.leases import Lease, LeaseHeld, LeaseLost
from app.persistence.records import FolderView, folder_view, record_tensors, remove_record, snapshot_path, write_fenced
from app.sessions.endings import Endings
from app.sessions.footprint import MOVED_PARTS, handle_bytes, handle_parts
from app.sessions.registry import Registry, SessionHandle
from app.sessions.saving import record_of
from app.sessions.views import Spilled, description, spilled


log = logging.getLogger("app")

STATES = ("active", "parked", "spilled")
WHERE = ("device", "host", "disk")


class Parking:
    """The store's memory side: accounting, admission by bytes, the park/spill/retention loop and page-in."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        registry: Registry,
        engine: Engine,
        encoder: Encoder,
        *,
        refiner: Callable[[], Refiner],
        folder: Path | None,
        checkpointing: bool,
        leases_held: dict[str, Lease],
        endings: Endings,
        draining: Callable[[], bool],
        lose: Callable[[SessionHandle, BaseException], None],
    ):
        """Everything parking uses is given here, by the store that owns it (``SessionStore``), and parking names
        nothing of the store: ``registry`` (the live sessions), ``engine`` (the only mover of tensors), ``encoder``
        (a spilled record's last response), ``refiner`` (the loaded model, for its sizes and device), ``folder``
        (snapshot_dir, None: nothing spills), ``checkpointing`` (a spill's file is a session's checkpoint too),
        ``leases_held`` (the store's table of this replica's leases, by id: shared, a spill takes and releases
        them), ``endings`` (the ended sessions whose file is not fenced off and removed yet: a spilled session past
        its retention joins them), ``draining`` (a drain is under way: nothing moves, the drain saves) and ``lose``
        (a session whose lease another replica took: the store drops it and closes its connections)."""
        self.settings = settings
        self.registry = registry
        self.engine = engine
        self.encoder = encoder
        self.refiner = refiner
        self.folder = folder
        self.checkpointing = checkpointing
        self.leases_held = leases_held
        self.endings = endings
        self.draining = draining
        self.lose = lose
        self.spilled: dict[str, Spilled] = {}
        self.budget: int | None = None  # resolved once the model is warm (``resolve_budget``)
        self._moves: set[asyncio.Future] = set()  # CUDA copies of parked sessions not complete yet
        self._clip_bytes = 0
        # Device bytes of sessions on their way back (a page-in, an adoption from snapshot_dir), by id: counted
        # from the moment room was made for them until they count as active, so that no one else takes that room
        # while they await the engine or the disk.
        self._incoming: dict[str, int] = {}
        # Spills letting go of their lease, by id: an adoption of the id waits for it (``released``).
        self._releasing: dict[str, asyncio.Future] = {}
        self.page_in_seconds = metrics.page_in_seconds
        self.moves = metrics.session_moves

    # --- the budget ------------------------------------------------------------------------------------------
    def resolve_budget(self, device: torch.device) -> None:
        """``device_memory_budget`` as bytes: a number as set; ``auto``: on CUDA what is free now (after the
        warm-up) minus device_memory_reserve, on the CPU no budget."""
        setting = self.settings.device_memory_budget
        if setting is None:
            self.budget = None
        elif setting == "auto":
            if device.type == "cuda":
                # What the caching allocator holds unused (the warm-up's activations, the load's casts) is memory
                # the sessions can have, but mem_get_info counts it as taken: hand it back first.
                torch.cuda.empty_cache()
                free, _ = torch.cuda.mem_get_info(device)
                self.budget = max(free - self.settings.device_memory_reserve, 0)
            else:
                self.budget = None
        else:
            self.budget = int(setting)
        if self.budget is not None:
            log.info("device memory budget for sessions: %d bytes", self.budget)

    # --- accounting --------------------------------------------------------------------------------------------
    def device_used(self, exclude: Any = None) -> int:
        """Device bytes the sessions hold or have reserved (an active session counts at least what admission
        reserved for it; a parked one only what stays on the device), plus clips being refined."""
        handles = self.registry.handles()
        # A session coming in counts its reservation until it counts for itself (active here), not both at once.
        counted = {handle.id for handle in handles if handle.memory_state == "active"}
        used = self._clip_bytes + sum(n for session_id, n in self._incoming.items()
                                      if session_id not in counted
                                      and (exclude is None or session_id != getattr(exclude, "id", None)))
        for handle in handles:
            if handle is exclude:
                continue
            device = handle_bytes(handle)["device"]
            if handle.memory_state == "active" and (handle.session.state.geometry is not None
                                                    or handle.chunks.waiting or handle.engine_session.queued):
                # Its reservation holds once it has frames, or while its first chunk is on its way (a first chunk
                # that was refused holds none).
                device = max(device, handle.reserved_bytes)
            used += device
        return used

    def totals(self) -> dict[tuple[str, str], int]:
        """Bytes by (state, where), for /metrics."""
        out = {(state, where): 0 for state in STATES for where in WHERE}
        for handle in self.registry.handles():
            counted = handle_bytes(handle)
            out[(handle.memory_state, "device")] += counted["device"]
            out[(handle.memory_state, "host")] += counted["host"]
        for stub in self.spilled.values():
            out[("spilled", "disk")] += stub.file_bytes
        return out

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for handle in self.registry.handles():
            out[handle.memory_state] += 1
        out["spilled"] = len(self.spilled)
        return out

    def report(self) -> dict[str, Any]:
        """``/v1/info``'s ``memory``."""
        used = self.device_used()
        totals = self.totals()
        host = sum(n for (state, where), n in totals.items() if where == "host")
        return {
            "budget": self.budget,
            "used": used,
            "free": None if self.budget is None else max(self.budget - used, 0),
            "host": host,
            "disk": totals[("spilled", "disk")],
            # The same figures under the names of the service's spec (api.md 1.2), and as /metrics gauges.
            "device_budget": self.budget,
            "device_used": used,
            "host_used": host,
            "sessions": self.counts(),
            "park_after_s": self.settings.park_after_s,
            "spill_after_s": self.settings.spill_after_s if self.folder is not None else None,
            "session_retention_s": self.settings.retention_s,
        }

    # --- admission by bytes -------------------------------------------------------------------------------------
    def fits(self, need: int, exclude: Any = None) -> bool:
        return self.budget is None or self.device_used(exclude) + need <= self.budget

    def require(self, need: int, what: str, exclude: Any = None) -> None:
        """ApiError 503 insufficient_memory unless ``need`` more device bytes fit the budget now."""
        if self.fits(need, exclude):
            return
        used = self.device_used(exclude)
        free = max(self.budget - used, 0)
        raise ApiError(
            "insufficient_memory",
            f"{what} needs {need} bytes of device memory and {free} of the budget's {self.budget} are free "
            f"(device_memory_budget; sessions hold {used}); nothing was allocated. Every session that could be "
            "moved off the device has been: retry once a session finishes or goes idle, send smaller frames, a "
            "smaller window (kv_max_frames) or batch, or use another replica",
            retry_after_s=self.settings.retry_after_s,
            fields={"bytes_needed": int(need), "bytes_free": int(free), "bytes_budget": int(self.budget)},
        )

    async def make_room(self, need: int, what: str, exclude: Any = None) -> None:
        """Park the least recently used sessions with no work (never ``exclude``, never one with work queued) until
        ``need`` bytes fit; 503 insufficient_memory when they still do not."""
        if self.budget is None:
            return
        tried: set[str] = set()
        while not self.fits(need, exclude):
            # Least recently used first; those being parked already (the upkeep's round, another admission) last.
            idle = sorted((h for h in self.registry.handles()
                           if h is not exclude and h.id not in tried and h.memory_state == "active" and _idle(h)
                           and handle_bytes(h)["device"] > 0),
                          key=lambda h: (h.moving.locked(), h.last_work))
            if not idle:
                break
            handle = idle[0]
            tried.add(handle.id)  # each at most once: one that got work meanwhile stays, the next is tried
            if handle.moving.locked():  # its park is under way: its bytes are on their way off the device
                async with handle.moving:
                    pass
            else:
                await self.park(handle, reason="admission")
        self.require(need, what, exclude)

    def estimate(self, config: Any, shape: tuple[int, ...], prompt_tokens: int = 0) -> int:
        """Device bytes a session of ``config`` will hold once frames of ``shape`` (B, C, t, H, W) give it its
        geometry and a chunk of t frames runs, with a prompt of ``prompt_tokens`` tokens
        (``models.session_bytes.session_bytes_estimate``: every part, the prompt's and the rollback copies' included)."""
        refiner = self.refiner()
        if len(shape) != 5 or min(shape) <= 0:
            return 0  # no frames of a session: the session's own check refuses them, with what to send instead
        batch, channels, frames, height, width = (int(n) for n in shape)
        parts = session_bytes_estimate(refiner.num_layers, refiner.info.inner_dim, config,
                                       Geometry(batch, channels, height, width), refiner.dtype,
                                       prompt_tokens=prompt_tokens, caption_channels=refiner.info.caption_channels,
                                       chunk_frames=frames)
        return sum(parts.values())

    async def reserve(self, handle: SessionHandle, shape: tuple[int, ...], prompt_tokens: int | None = None) -> None:
        """Before a chunk of frames ``shape`` (and a prompt of ``prompt_tokens`` tokens, None: the session's own or
        the server's default) reaches the engine: what the session will hold with it, reserved (or refused with
        insufficient_memory) before anything is allocated. The first chunk reserves the session's bytes; a later
        one that makes it hold more (a longer prompt, a larger chunk) reserves the difference first."""
        if prompt_tokens is None:
            prompt = handle.session.state.prompt  # a new session starts with the server's default_prompt
            prompt_tokens = 0 if prompt is None else int(prompt.embeds.shape[1])
        need = self.estimate(handle.config, shape, prompt_tokens)
        if need <= handle.reserved_bytes:
            return
        await self.make_room(need, f"session {handle.id} (frames {tuple(shape)}, a prompt of {prompt_tokens} "
                             "tokens)", exclude=handle)
        handle.reserved_bytes = need

    @contextlib.asynccontextmanager
    async def clip(self, need: int):
        """A one-shot clip's bytes, held while it is refined."""
        await self.make_room(need, "this clip")
        self._clip_bytes += need
        try:
            yield
        finally:
            self._clip_bytes -= need

    @contextlib.asynccontextmanager
    async def room_for_file(self, folder: Path, session_id: str):
        """While a session saved in ``folder`` is adopted: its bytes, from the file's header alone, must fit, and
        stay counted until the adopted session counts for itself (the context's end)."""
        need = await self._file_bytes(folder, session_id) if self.budget is not None else 0
        if need:
            await self.make_room(need, f"session {session_id} (saved in snapshot_dir)")
        with self._coming_in(session_id, need):
            yield

    async def _file_bytes(self, folder: Path, session_id: str) -> int:
        """Device bytes the session saved in ``folder`` will hold, from the file's header (0: unreadable; the
        adoption reports what is wrong with the file)."""
        try:
            headers, metadata = await asyncio.to_thread(read_header, snapshot_path(folder, session_id))
            _, config, counters = _read_metadata(metadata)
            geometry = counters.get("geometry")
        except (SnapshotError, OSError):
            return 0
        if not isinstance(geometry, list) or len(geometry) != 4:
            return 0
        refiner = self.refiner()
        prompt = headers.get("prompt_embeds")  # (B, L, caption): what the file's session holds
        tokens = int(prompt.shape[1]) if prompt is not None and len(prompt.shape) == 3 else 0
        return sum(session_bytes_estimate(refiner.num_layers, refiner.info.inner_dim, config,
                                          Geometry(*(int(n) for n in geometry)), refiner.dtype,
                                          prompt_tokens=tokens, caption_channels=refiner.info.caption_channels
                                          ).values())

    @contextlib.contextmanager
    def _coming_in(self, session_id: str, need: int):
        """``need`` device bytes counted for ``session_id`` (not yet active) while the context lasts."""
        self._incoming[session_id] = self._incoming.get(session_id, 0) + need
        try:
            yield
        finally:
            left = self._incoming.pop(session_id, 0) - need
            if left > 0:
                self._incoming[session_id] = left

    async def released(self, session_id: str) -> None:
        """Wait until a spill of ``session_id`` has let go of its lease (before an adoption takes it)."""
        releasing = self._releasing.get(session_id)
        if releasing is not None:
            await asyncio.wait({releasing})

    # --- park and page in ----------------------------------------------------------------------------------------
    async def activate(self, handle: SessionHandle) -> None:
        """Bring a parked session back to the device before work of it reaches the engine (room made for it
        first). Called within the session's chunk turn, right before ``engine.run``."""
        if handle.memory_state == "active" and not handle.moving.locked():
            return
        async with handle.moving:
            if handle.memory_state != "parked":
                return
            started = time.perf_counter()
            moved = sum(n for name, n in handle_parts(handle).items() if name in MOVED_PARTS)
            need = max(moved, handle.reserved_bytes)
            await self.make_room(need, f"session {handle.id} (coming back from host memory)", exclude=handle)
            device, session, ready = self.refiner().device, handle.session, handle.park_ready
            with self._coming_in(handle.id, need):  # the room just made is its own until it counts as active
                # A spilled session read back from its file is in plain memory: pinned here, off the engine thread.
                host = await asyncio.to_thread(stage_host, session, device)

                def page_in():
                    # On a side stream, after the copies that parked it; its next forward waits for these copies on
                    # the device (``app.engine.worker.wait_for``), other sessions' forwards do not.
                    moved = move_session(session, device, after=ready, host=host)
                    handle.engine_session.ready = moved
                    return moved

                def paged_in(ready) -> None:
                    handle.park_ready = ready
                    handle.memory_state = "active"

                await self._move(page_in, paged_in)
            self.page_in_seconds.labels(state="parked").observe(time.perf_counter() - started)
            self.moves.labels(to="active").inc()

    async def park(self, handle: SessionHandle, reason: str = "idle") -> bool:
        """Move an active session with no work to host memory; False when it got work (or went) meanwhile, or
        its tensors are being moved already (never waited for: a page-in making room holds its own session's
        lock)."""
        if handle.moving.locked():
            return False
        async with handle.moving:
            if handle.memory_state != "active" or not _idle(handle) or self.draining():
                return False
            if not self.registry.holds(handle):
                return False
            device, session, paged_in = torch.device("cpu"), handle.session, handle.park_ready
            # The host buffers, page-locked on a worker thread (seconds for a 720p window: on the engine thread that
            # would stall every session); work that arrived meanwhile keeps the session active.
            host = await asyncio.to_thread(stage_host, session, device)
            if not _idle(handle) or self.draining() or not self.registry.holds(handle):
                return False

            def parked(ready) -> None:
                handle.memory_state = "parked"
                handle.park_ready = ready
                self.moves.labels(to="parked").inc()
                if ready is not None:
                    # Accounted as host bytes at once; the drain waits for the copies before it reads them.
                    waiting = asyncio.ensure_future(asyncio.to_thread(ready.synchronize))
                    self._moves.add(waiting)
                    waiting.add_done_callback(self._moves.discard)
                log.debug("parked session %s (%s)", handle.id, reason)

            # after=: the copies of its last page-in, if no work of it ran since (nothing else waited for them).
            await self._move(lambda: move_session(session, device, after=paged_in, host=host), parked)
            return True

    async def _move(self, move: Callable[[], Any], moved: Callable[[Any], None]) -> None:
        """Run ``move`` (a park's or page-in's ``move_session``) on the engine thread, then ``moved(its result)``:
        the state that says where the session's tensors are. A call queued on the engine cannot be taken back, so
        a caller cancelled meanwhile (a request that went away while it made room) still waits for it and records
        it, with the session's lock still held, before the cancellation goes on: the state never says "active"
        while the tensors are on the host."""
        call = asyncio.ensure_future(self.engine.call(move))
        cancelled = await outlast(call)  # cancelled twice (the request gone, then the shutdown) waits all the same
        if call.cancelled():
            raise asyncio.CancelledError
        moved(call.result())
        if cancelled:
            raise asyncio.CancelledError

    async def settle(self) -> None:
        """Every queued device-to-host copy complete (before a drain reads the parked sessions)."""
        if self._moves:
            await asyncio.wait(set(self._moves))

    # --- spill ---------------------------------------------------------------------------------------------------
    async def spill(self, handle: SessionHandle) -> bool:
        """Write a parked session to snapshot_dir and drop it from memory; False when it was kept (asked for
        meanwhile, or it cannot be spilled: no folder, a stream or watcher attached, flushed)."""
        folder, registry = self.folder, self.registry
        if folder is None:
            return False
        if await self.spill_full():
            return False  # at max_spilled_sessions / max_spilled_bytes: it stays parked, holding its place
        async with handle.moving:
            if not _spillable(handle) or self.draining() or not registry.holds(handle):
                return False
            if handle.checkpoint_write is not None and not handle.checkpoint_write.done():
                return False  # the same file: the next round spills it
            if handle.deliveries is not None:
                await handle.deliveries.flush()
            await self.settle()
            seen = handle.taken
            record = record_of(handle, self.encoder)  # the drain's record of a session: the same file, adoptable by any replica
            frames = handle.session.state.frames_received
            tensors, metadata = await self.engine.call(lambda: record_tensors(record()))
            settings, lease = self.settings, self.leases_held.get(handle.id)
            if lease is None or not registry.holds(handle):
                return False  # it ended meanwhile (its lease went with it): nothing of it may be written

            def write() -> tuple[int, int]:
                # Like a checkpoint: the file is written under the session's lease, fenced by it.
                _, path = write_fenced(folder, handle.id, tensors, metadata, lease=lease,
                                       replica_id=settings.replica_id, lease_s=settings.session_lease_s,
                                       key=settings.signing_key)
                stat = path.stat()
                return stat.st_size, stat.st_ino

            # Tracked as the session's write in flight: a session deleted meanwhile has its file removed (and its
            # floor raised) only once this write is done (``Checkpoints.forget`` waits for it), never before.
            handle.checkpoint_write = asyncio.ensure_future(asyncio.to_thread(write))
            try:
                size, inode = await asyncio.shield(handle.checkpoint_write)
            except (LeaseHeld, LeaseLost) as exc:
                if self.leases_held.get(handle.id) is lease:  # not ended or dropped meanwhile
                    self.lose(handle, exc)
                return False
            if self.leases_held.get(handle.id) is not lease or not registry.holds(handle):
                return False  # it ended (deleted, lost) while the file was written: the file went with it
            if self.draining():
                return False  # the drain saves it (over this file): it must find it live
            if not _spillable(handle) or handle.taken != seen or not registry.holds(handle):
                # Asked for while it was written: it stays parked here, and no other replica may adopt the file.
                if self.checkpointing:  # the file is its durable copy now (a newer checkpoint), under its lease
                    handle.durable_frames = max(handle.durable_frames or 0, frames)
                else:  # the lease stays: a live session holds it, checkpoints or not (SessionStore.create)
                    await asyncio.to_thread(remove_record, folder, handle.id)
                return False
            # Committed here, with no await since the check above: a request, stream or watcher that takes the
            # session from now on finds it gone from memory and adopts it from the file, once the lease is let go
            # (``released``: the adoption waits for it). Released, as a drain's file is: whichever replica is asked
            # for the session next adopts it at once.
            self.leases_held.pop(handle.id, None)
            self.spilled[handle.id] = spilled(handle, size, inode)  # what the listing and GET show of it now
            registry.release(handle, ApiError(
                "session_not_found", f"session {handle.id} was moved to snapshot_dir; send the request again"))
            handle.memory_state = "spilled"
            releasing = asyncio.ensure_future(asyncio.to_thread(leases.release, folder, handle.id, lease))
            self._releasing[handle.id] = releasing
            releasing.add_done_callback(
                lambda done: self._releasing.pop(handle.id) if self._releasing.get(handle.id) is done else None)
            await asyncio.wait({releasing})
            self.moves.labels(to="spilled").inc()
            log.debug("spilled session %s to %s", handle.id, snapshot_path(folder, handle.id).name)
            return True

    # --- the bound on spilled sessions ---------------------------------------------------------------------------
    def spilled_bytes(self) -> int:
        return sum(stub.file_bytes for stub in self.spilled.values())

    async def spill_full(self) -> bool:
        """At ``max_spilled_sessions`` (or ``max_spilled_bytes``) once the spilled sessions past their retention
        are deleted (oldest first)."""
        if not self._at_spill_bound():
            return False
        await self.expire_spilled()
        return self._at_spill_bound()

    def _at_spill_bound(self) -> bool:
        settings = self.settings
        return len(self.spilled) >= settings.max_spilled_sessions or (
            settings.max_spilled_bytes is not None and self.spilled_bytes() >= settings.max_spilled_bytes)

    def spills_at(self, handle: SessionHandle) -> float | None:
        """When (the registry's clock) the timer spills ``handle`` if nothing happens, which frees its max_sessions
        place: a 503 too_many_sessions says that time when it comes before any release. None when it will not be
        spilled (no snapshot_dir, at the spill bound, in use, a stream or watcher attached, flushed)."""
        if self.folder is None or self._at_spill_bound() or handle.memory_state not in ("active", "parked"):
            return None
        if not _idle(handle) or handle.streaming or handle.watchers or handle.session.state.flushed:
            return None
        if handle.spill_declined_at is not None and handle.spill_declined_at >= handle.last_work:
            return None  # tried since its last work and kept (a full disk, a checkpoint in flight): not to count on
        settings = self.settings
        # It parks first (park_after_s), then spills at the timer's next round past spill_after_s.
        return handle.last_work + max(settings.park_after_s, settings.spill_after_s) + settings.upkeep_interval_s

    async def require_spill_room(self) -> None:
        """Before a new session is created: 503 over_capacity when the spilled sessions are at their bound (it
        could never be spilled, and a live session is never deleted to make room)."""
        if not await self.spill_full():
            return
        settings = self.settings
        limit = (f"max_spilled_sessions {settings.max_spilled_sessions}" if len(self.spilled) >=
                 settings.max_spilled_sessions else f"max_spilled_bytes {settings.max_spilled_bytes}")
        raise ApiError(
            "over_capacity",
            f"this replica holds {len(self.spilled)} spilled sessions ({self.spilled_bytes()} bytes in "
            f"snapshot_dir), its {limit}, and none is past session_retention_s; no session is deleted before its "
            "retention ends. Retry after the Retry-After seconds, end sessions you no longer need (DELETE), or use "
            "another replica",
            retry_after_s=self.settings.retry_after_s,
            fields={"spilled_sessions": len(self.spilled), "spilled_bytes": self.spilled_bytes(),
                    "max_spilled_sessions": settings.max_spilled_sessions,
                    "max_spilled_bytes": settings.max_spilled_bytes},
        )

    async def expire_spilled(self, view: FolderView | None = None, releasing: frozenset[str] = frozenset()) -> int:
        """Delete the spilled sessions past session_retention_s, oldest first (their files too; 410 from then on);
        how many. One adopted by another replica meanwhile is not this one's to delete: it is only forgotten. Its
        file is looked at, fenced off and removed on worker threads (``app.sessions.endings``: a folder that cannot
        take that now has it tried again later, the id refused meanwhile)."""
        registry, retention = self.registry, self.settings.retention_s
        now = registry.clock()
        expired = sorted((stub.last_active, session_id) for session_id, stub in self.spilled.items()
                         if now - stub.last_active > retention)
        deleted = 0
        for _, session_id in expired:
            stub = self.spilled.get(session_id)
            if stub is not None and view is not None and self._gone(session_id, stub, view,
                                                                    self._ours(session_id, releasing)):
                stub = self._drop(session_id, stub)
            # Its file itself, before it is deleted: another replica may have adopted the session and spilled it
            # again between two listings (another inode: not this replica's spill any more).
            stub, generation = await self._look(session_id, stub)
            if stub is None or now - stub.last_active <= retention or self.spilled.get(session_id) is not stub:
                continue  # adopted elsewhere, or asked for (or deleted) while the folder was looked at
            # Committed here, with no await since the look: ended, refused from now on, then fenced off and removed.
            self.spilled.pop(session_id)
            reason = f"{retention:g} s without activity (session_retention_s)"
            registry.mark_evicted(session_id, reason)
            registry.remember_ended(session_id, stub.created_at)
            self.endings.end(session_id, generation, None, ApiError(
                "session_evicted", f"session {session_id} was evicted after {reason}; create a new session and "
                                   "send the stream again"))
            await self.endings.settle(session_id)
            deleted += 1
        return deleted

    def _ours(self, session_id: str, releasing: frozenset[str] = frozenset()) -> bool:
        """A lease on a spilled session is another replica's (that replica adopted it), unless this replica's spill
        is still releasing its own (``releasing``: those that were when a listing began): the session is spilled
        (and counted) from the moment the spill commits, before the lease file is gone."""
        return session_id in self._releasing or session_id in releasing

    def _gone(self, session_id: str, stub: Spilled, view: FolderView | None, ours: bool) -> bool:
        """Whether the spilled session's file is gone or another replica's now (it adopted the session). ``view``:
        the folder as one listing saw it (``folder_view``), for a caller asking about many sessions; without it this
        looks at the folder for this one session (call it on a worker thread then). ``ours``: a lease on it is
        this replica's spill's (``_ours``)."""
        folder = self.folder
        if folder is None:
            return True
        if view is not None:  # names only (a listing's inode numbers need not be stat's, on FUSE volumes)
            return session_id not in view.saved or (session_id in view.leased and not ours)
        try:
            stat = snapshot_path(folder, session_id).stat()
        except FileNotFoundError:
            stat = None
        except OSError:  # the volume's trouble (EIO, ESTALE): not known to be gone; asked again next time
            return False
        # Another inode: another replica adopted it and spilled it again (its own now, with its own retention).
        return stat is None or (stub.file_inode is not None and stat.st_ino != stub.file_inode) or (
            not ours and bool(leases.generations(folder, session_id)))

    def _drop(self, session_id: str, stub: Spilled) -> None:
        """Forget a spilled session whose file went (unless it changed meanwhile: spilled again, deleted)."""
        if self.spilled.get(session_id) is stub:
            del self.spilled[session_id]

    async def _look(self, session_id: str, stub: Spilled | None) -> tuple[Spilled | None, int]:
        """The spilled session ``session_id`` (None: not one, or its file went or is another replica's now) and the
        floor its file was written under, its file looked at on a worker thread (the loop, /health included,
        never waits on the folder)."""
        if stub is None or self.folder is None:
            return None, 0

        ours = self._ours(session_id)

        def look() -> tuple[bool, int]:
            return self._gone(session_id, stub, None, ours), leases.read_floor(self.folder, session_id)

        gone, floor = await asyncio.to_thread(look)
        if gone:
            self._drop(session_id, stub)
            return None, floor
        return stub, floor

    async def stubs(self) -> list[Spilled]:
        """Every spilled session whose file is still there: one listing of the folder, on a worker thread (so the
        cost of a page of sessions does not grow with the folder's size, and the event loop, /health included,
        never waits on it)."""
        folder = self.folder
        if not self.spilled:
            return []
        releasing = frozenset(self._releasing)  # before the listing: it may see their leases, gone by its end
        view = None if folder is None else await asyncio.to_thread(folder_view, folder)
        kept = []
        for session_id, stub in list(self.spilled.items()):
            if self._gone(session_id, stub, view, self._ours(session_id, releasing)):
                self._drop(session_id, stub)
            else:
                kept.append(stub)
        return kept

    async def read(self, session_id: str) -> dict[str, Any] | None:
        """GET of a spilled session: its description, without bringing it back (a request all the same: its
        retention restarts, as a GET of a live session's does)."""
        stub, _ = await self._look(session_id, self.spilled.get(session_id))
        if stub is None or self.spilled.get(session_id) is not stub:  # gone, or adopted or deleted meanwhile
            return None
        stub.last_active = self.registry.clock()
        await asyncio.to_thread(self.record_use, session_id)
        return description(stub)

    def record_use(self, session_id: str) -> None:
        """Write down in the folder that the spilled session was used now, for every replica's sweep
        (``app.persistence.sweeps.FolderSweep.expired_files``) to see: the file's modification time is set to now.
        A spilled session has no lease (it is adoptable at once), so its file is the only record every replica
        reads; its write time alone would let another replica's sweep delete a session polled here within its
        retention.
        One ``utime`` (it never creates the file: one adopted meanwhile stays gone), called on a worker thread."""
        folder = self.folder
        if folder is None:
            return
        with contextlib.suppress(OSError):
            os.utime(snapshot_path(folder, session_id))

    def paged_in(self, session_id: str, started: float) -> None:
        """A spilled session was adopted back (``SessionStore.lookup``)."""
        if self.spilled.pop(session_id, None) is not None:
            self.page_in_seconds.labels(state="spilled").observe(time.perf_counter() - started)
            self.moves.labels(to="active").inc()

    async def forget(self, session_id: str) -> bool:
        """Delete a spilled session (its file); False if it is not one. A folder that cannot be written now
        (read-only, full, gone) is 503 server_busy, and the session stays spilled: a DELETE that did not happen
        must not drop it from the listing and the spilled count while its file stays adoptable. The folder is
        looked at and written on a worker thread, seen to its end even when the DELETE is cancelled meanwhile (the
        file gone, the session must be too)."""
        stub = self.spilled.get(session_id)
        if stub is None or self.folder is None:
            return False
        folder, ours = self.folder, self._ours(session_id)

        def delete() -> bool:
            if self._gone(session_id, stub, None, ours):
                return False
            # Ended: the file it was spilled to (under the floor's generation) may not be adopted back if put back
            # (the floor first, as above).
            leases.raise_floor(folder, session_id, leases.read_floor(folder, session_id) + 1,
                               self.settings.replica_id)
            remove_record(folder, session_id)
            return True

        deleting = in_thread(delete)
        cancelled = await outlast(deleting)
        error = deleting.exception()
        if error is None:  # deleted, or its file went (another replica adopted it): not spilled here any more
            self._drop(session_id, stub)
            if deleting.result():
                self.registry.remember_ended(session_id, stub.created_at)
        if cancelled:
            raise asyncio.CancelledError
        if isinstance(error, OSError):
            log.warning("deleting spilled session %s from %s failed: %r", session_id, folder, error)
            raise ApiError("server_busy", f"snapshot_dir cannot be written now ({error.strerror or error}): spilled "
                                          f"session {session_id} was not deleted and its file stays; retry the "
                                          "DELETE later", retry_after_s=self.settings.retry_after_s) from None
        if error is not None:
            raise error
        return deleting.result()

    # --- the timer ------------------------------------------------------------------------------------------------
    async def tick(self) -> None:
        """One round: park the active sessions idle for park_after_s, spill the parked ones idle for
        spill_after_s, delete the spilled ones past session_retention_s."""
        settings, registry, now = self.settings, self.registry, self.registry.clock()
        for handle in registry.handles():
            idle_for = now - handle.last_work
            if handle.memory_state == "active" and idle_for >= settings.park_after_s and _idle(handle):
                await self.park(handle)
            # A spill that failed (a full or read-only disk) is tried again spill_after_s later, unless the session
            # worked since: each try reads the whole session on the engine thread and writes it.
            failed = handle.spill_failed_at
            backing_off = (failed is not None and failed >= handle.last_work
                           and now - failed < settings.spill_after_s)
            if (handle.memory_state == "parked" and idle_for >= settings.spill_after_s
                    and self.folder is not None and not backing_off):
                moved = False
                try:
                    moved = await self.spill(handle)
                except Exception:  # a full disk must not stop parking; the session stays parked
                    handle.spill_failed_at = registry.clock()
                    log.exception("spilling session %s failed; it stays parked, tried again in %g s", handle.id,
                                  settings.spill_after_s)
                if not moved:
                    handle.spill_declined_at = registry.clock()  # no longer a place that frees soon (spills_at)
        retention = settings.retention_s
        if any(now - stub.last_active > retention for stub in self.spilled.values()):
            view, releasing = None, frozenset(self._releasing)
            if self.folder is not None:
                view = await asyncio.to_thread(folder_view, self.folder)
            await self.expire_spilled(view, releasing)


def _idle(handle: SessionHandle) -> bool:
    """No work queued, running or on its way (the only sessions whose tensors may move)."""
    return not (handle.requests_in_flight or handle.engine_session.queued or handle.stream_jobs
                or handle.chunks.waiting or handle.engine_session.run is not None)


def _spillable(handle: SessionHandle) -> bool:
    return (handle.memory_state == "parked" and _idle(handle) and not handle.streaming and not handle.watchers
            and not handle.session.state.flushed)
