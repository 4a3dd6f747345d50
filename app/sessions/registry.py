"""The session registry: admission (a maximum count), lookup, idle eviction, and cache-byte accounting.

Lives on the event loop. The sessions' tensors are only touched by the engine; the registry reads their
immutable ``SessionState`` snapshots for accounting.

A session whose client left its WebSocket before a flush is *detached*: it is kept ``ws_reattach_grace_s`` from
the moment the stream ended for the client to reconnect a stream, and evicted after that. Reading its state
does not extend the wait (a client polling GET is not back); a new stream, or a chunk accepted over HTTP, ends it.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from models import RefinerSession, SessionConfig

from app.core.error_kinds import ApiError
from app.engine.worker import EngineSession
from app.outputs.catalog import build_stages
from app.outputs.delivery import Deliveries
from app.outputs.kinds import Outputs
from app.outputs.replay import RetainedUnits
from app.outputs.stage import OutputStages, SessionStages
from app.sessions.chunk_log import ChunkLog
from app.sessions.subscriptions import StreamSubscriber, WatchSubscriber


@dataclass(eq=False)
class SessionHandle:
    id: str
    config: SessionConfig
    engine_session: EngineSession
    created_at: float = field(default_factory=time.time)
    last_active: float = 0.0  # registry clock
    last_active_wall: float = field(default_factory=time.time)
    streaming: bool = False  # a WebSocket is attached
    requests_in_flight: int = 0
    # The stream dropped before a flush; the session waits ws_reattach_grace_s for a reconnect.
    detached: bool = False
    detached_at: float = 0.0  # registry clock
    # Units this session returned, streamed or in HTTP responses, for a client that reattaches or a watcher that
    # resumes (app.outputs.replay).
    retained: RetainedUnits = field(default_factory=lambda: RetainedUnits(32))
    # The newest HTTP response's units being encoded to join ``retained`` (SessionOps._retain), or None.
    retaining: Any = None
    # The stream subscribed to its units now (app.sessions.subscriptions: StreamSession.claim registers it), or
    # None while detached.
    stream: StreamSubscriber | None = None
    # Engine futures of stream jobs not settled yet; a reattaching stream waits for them before it reports
    # where the stream stands, so its frame counts include every message the old connection handed over.
    stream_jobs: set = field(default_factory=set)
    # Sequence numbers and the stored response of the last chunk (app.sessions.chunk_log).
    chunks: ChunkLog = field(default_factory=ChunkLog)
    # Stream units between commit and publication (app.outputs.delivery); set by the registry.
    deliveries: Deliveries | None = None
    first_block_done: bool = False
    # What its units carry (latents, video) and how (api.md 1.1).
    outputs: Outputs = field(default_factory=Outputs)
    # Read-only subscribers (app.sessions.subscriptions; SessionOps.watch registers them): they get every unit
    # published from when they joined.
    watchers: set[WatchSubscriber] = field(default_factory=set)
    # The end of the newest unit offered to its watchers (a stream's when published, an HTTP response's at once):
    # a watcher resuming from an earlier frame is sent the retained units up to here, and gets the rest live.
    offered_until: int = 0
    # Its flush's units were all offered and its watchers told "done" (``SessionOps._finish_watchers``; an adopted
    # session saved flushed, ``SessionStore._hold``): a watcher joining later is told "done" at once.
    finished: bool = False
    # Crash checkpoints (app.sessions.checkpoints): blocks and time of the last, and its write in flight.
    checkpoint_blocks: int = 0
    checkpoint_at: float = field(default_factory=time.monotonic)
    checkpoint_write: Any = None
    from_checkpoint: bool = False  # adopted from a file that may be behind its clients (a crash checkpoint)
    # Input frames the session's last crash checkpoint covers (the client keeps what it may have to resend until
    # then); None when this server writes no checkpoints (snapshot_dir or checkpointing unset: a crash loses it).
    durable_frames: int | None = None
    # Where its tensors are (app.sessions.parking): active (device), parked (host), spilled (snapshot_dir, handle dropped).
    memory_state: str = "active"
    last_work: float = 0.0  # registry clock: when work of it last started or ended (parking's idle clock)
    spill_declined_at: float | None = None  # registry clock: when the timer last tried to spill it and did not
    spill_failed_at: float | None = None  # registry clock: when its spill last raised (a full or read-only disk)
    taken: int = 0  # lookups that handed it to a request (a spill in progress gives way to them)
    reserved_bytes: int = 0  # device bytes admission reserved at its first chunk (app.sessions.parking.Parking.reserve)
    park_ready: Any = None  # CUDA event of the copies that last moved its tensors (None on a CPU)
    moving: asyncio.Lock = field(default_factory=asyncio.Lock)  # held while its tensors move (app.sessions.parking)

    @property
    def session(self) -> RefinerSession:
        return self.engine_session.session

    @property
    def cache_bytes(self) -> int:
        """What the session holds on the device between chunks: its KV cache and its output stages' states (a
        decoder's)."""
        return self.session.cache_bytes + self.engine_session.stages.nbytes



class Registry:
    def __init__(
        self,
        max_sessions: int,
        idle_timeout_s: float,
        remember_evicted: int,
        retry_after_s: int,
        reattach_grace_s: float = 60.0,
        resume_units: int = 32,
        flushed_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        deliveries: Callable[[SessionHandle], Deliveries] | None = None,
        on_close: Callable[[SessionHandle], None] | None = None,
        stages: Callable[[], OutputStages] = build_stages,
        idle_setting: str = "session_idle_timeout_s",
    ):
        self.max_sessions = max_sessions
        self.idle_setting = idle_setting  # the setting idle_timeout_s came from, named in an eviction's reason
        self.idle_timeout_s = idle_timeout_s
        self.reattach_grace_s = reattach_grace_s
        self.flushed_ttl_s = flushed_ttl_s
        self.resume_units = resume_units
        self.remember_evicted = remember_evicted
        self.retry_after_s = retry_after_s
        self.clock = clock
        self._deliveries = deliveries
        self._on_close = on_close  # a session ended (deleted, evicted): forget its checkpoint
        # When the timer would spill a session (app.sessions.parking), which frees its place too; set by the store.
        self.spills_at: Callable[[SessionHandle], float | None] = lambda handle: None
        self._stages = stages  # the server's output stages, once loaded: a new session's come from there
        self._sessions: dict[str, SessionHandle] = {}
        self.clips = 0  # one-shot clips being refined: they count against max_sessions while they run
        # Evicted ids answer 410 (the client should start over), unknown or deleted ones 404; the value says why.
        self._evicted: OrderedDict[str, str] = OrderedDict()
        # When each session that ended lately was created: a listing's ``after`` may name one (the ``next`` of a page
        # whose last session was deleted or evicted since), and the next page goes on from where it stood.
        self._ended: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def handles(self) -> list[SessionHandle]:
        return list(self._sessions.values())

    def existing(self, session_id: str) -> SessionHandle | None:
        """The live session of that id, or None (unknown); ApiError 410 while it is remembered as evicted."""
        try:
            return self.get(session_id)
        except ApiError as error:
            if error.kind == "session_evicted":
                raise
            return None

    def require_capacity(self) -> None:
        self._require_capacity()

    def _require_capacity(self) -> None:
        self.evict_idle()
        if len(self._sessions) + self.clips >= self.max_sessions:
            clips = f" ({self.clips} of them one-shot clips being refined)" if self.clips else ""
            soonest = self._soonest_release()
            if soonest is None:
                when, retry = ("every session is in use, so none will be released on its own: retry once a client "
                               "deletes or finishes one"), None
            else:
                wait, how = soonest
                retry = max(1, math.ceil(wait))
                when = f"the next idle session is {how} in {wait:.0f} s: retry then"
            raise ApiError(
                "too_many_sessions",
                f"the server holds its maximum of {self.max_sessions} sessions (max_sessions){clips}; delete one "
                f"you no longer need, or {when}",
                retry_after_s=retry,
            )

    def _soonest_release(self) -> tuple[float, str] | None:
        """Seconds until the first session that is not in use would be evicted (released) or spilled, each of which
        frees its place, and which of the two; None: all in use."""
        now = self.clock()
        times = [(at - now, how) for handle in self._sessions.values()
                 for at, how in ((self._release_at(handle), "released"),
                                 (self.spills_at(handle), "spilled to snapshot_dir")) if at is not None]
        if not times:
            return None
        wait, how = min(times)
        return max(wait, 0.0), how

    def adopt(self, session_id: str, session: RefinerSession, detached: bool = False, outputs: Outputs = Outputs(),
              stages: SessionStages | None = None) -> SessionHandle:
        """Register a session under ``session_id`` (a new one, or one restored from a snapshot; no capacity
        check there: those sessions were admitted before the restart). ``stages``: its output stages as restored
        (default: new ones for ``outputs``)."""
        if stages is None:
            stages = self._stages().for_session(outputs, session.config)
        handle = SessionHandle(
            id=session_id,
            config=session.config,
            engine_session=EngineSession(session=session, name=f"session {session_id}", stages=stages),
            last_active=self.clock(),
            last_work=self.clock(),
            retained=RetainedUnits(self.resume_units),
            outputs=outputs,
            # Adopted: every unit it had committed went out before it was saved (its retained units end there).
            offered_until=session.state.frames_returned,
        )
        if self._deliveries is not None:
            handle.deliveries = self._deliveries(handle)
        if detached:
            self.detach(handle)
        self._sessions[session_id] = handle
        return handle

    def detach(self, handle: SessionHandle) -> None:
        """The session's stream ended before a flush: the grace period starts now."""
        handle.detached = True
        handle.detached_at = self.clock()

    def attach(self, handle: SessionHandle) -> None:
        handle.detached = False

    def get(self, session_id: str) -> SessionHandle:
        """The live session, touched; ApiError 404 (unknown or deleted) or 410 (evicted) otherwise."""
        handle = self._sessions.get(session_id)
        if handle is not None and self._idle(handle, self.clock()):
            self._evict(handle)
            handle = None
        if handle is None:
            reason = self._evicted.get(session_id)
            if reason is not None:
                raise ApiError(
                    "session_evicted",
                    f"session {session_id} was evicted after {reason}; create a new session and send the stream "
                    "again",
                )
            raise ApiError(
                "session_not_found", f"no session {session_id!r}; create one with POST /v1/sessions"
            )
        self.touch(handle)
        return handle

    def touch(self, handle: SessionHandle) -> None:
        handle.last_active = self.clock()
        handle.last_active_wall = time.time()

    def delete(self, session_id: str) -> None:
        handle = self.get(session_id)
        self._close(handle, ApiError("session_not_found", f"session {session_id} was deleted"))

    def drop(self, handle: SessionHandle, error: ApiError) -> None:
        """Let go of a session this replica no longer owns (another replica took it over): its work fails with
        ``error`` and its id is not remembered as deleted or evicted (it lives on elsewhere)."""
        if self._sessions.get(handle.id) is handle:
            self._close(handle, error)

    def evict_idle(self) -> list[str]:
        now = self.clock()
        idle = [h for h in self._sessions.values() if self._idle(h, now)]
        for handle in idle:
            self._evict(handle)
        return [h.id for h in idle]

    def holds(self, handle: SessionHandle) -> bool:
        """Whether ``handle`` is the live session of its id (without touching it)."""
        return self._sessions.get(handle.id) is handle

    def release(self, handle: SessionHandle, error: ApiError) -> None:
        """Drop a session that lives on elsewhere (spilled to snapshot_dir): nothing of it ends, its file stays."""
        handle.engine_session.closed = error
        self._sessions.pop(handle.id, None)

    def mark_evicted(self, session_id: str, reason: str) -> None:
        """A session that was not live here (spilled) ended: its id answers 410 with ``reason``."""
        self._evicted[session_id] = reason
        while len(self._evicted) > self.remember_evicted:
            self._evicted.popitem(last=False)

    def total_cache_bytes(self) -> int:
        return sum(h.cache_bytes for h in self._sessions.values())

    def listing(self, limit: int, after: str | None) -> tuple[list[SessionHandle], str | None]:
        """Sessions oldest first (creation order), ``limit`` of them after the id ``after``; and the id to pass
        as ``after`` for the next page (None at the end)."""
        self.evict_idle()
        return page_after(self.handles(), lambda h: (h.created_at, h.id), after, limit, self.ended_position,
                          "this server")

    def remember_ended(self, session_id: str, created_at: float) -> None:
        """A session that ended (here, or spilled by this replica and deleted): where it stood in the listing."""
        self._ended[session_id] = created_at
        self._ended.move_to_end(session_id)
        while len(self._ended) > self.remember_evicted:
            self._ended.popitem(last=False)

    def ended_position(self, session_id: str) -> tuple[float, str] | None:
        """The listing's sort key of a session that ended here lately, None if none is remembered."""
        created_at = self._ended.get(session_id)
        return None if created_at is None else (created_at, session_id)

    # --- internals -----------------------------------------------------------------------------------------
    def _idle(self, handle: SessionHandle, now: float) -> bool:
        release_at = self._release_at(handle)
        return release_at is not None and now > release_at

    def _release_at(self, handle: SessionHandle) -> float | None:
        """When (registry clock) the session is released if nothing happens; None while it is in use."""
        # A session with an open stream or work in the engine is in use however long since its last request.
        if handle.streaming or handle.requests_in_flight or handle.engine_session.queued:
            return None
        if handle.detached:
            return handle.detached_at + self.reattach_grace_s
        if handle.session.state.flushed:
            # Finished: kept long enough to repeat the last seq or reconnect for the tail, then released so that
            # finished sessions never exhaust max_sessions.
            return handle.last_active + min(self.flushed_ttl_s, self.idle_timeout_s)
        return handle.last_active + self.idle_timeout_s

    def _evict(self, handle: SessionHandle) -> None:
        if handle.session.state.flushed and not handle.detached:
            reason = f"it was flushed and finished {self.flushed_ttl_s:g} s ago (flushed_session_ttl_s)"
        elif handle.detached:
            reason = f"its stream dropped and none reattached within {self.reattach_grace_s:g} s (ws_reattach_grace_s)"
        else:
            reason = f"{self.idle_timeout_s:g} s without activity ({self.idle_setting})"
        self._close(handle, ApiError("session_evicted", f"session {handle.id} was evicted after {reason}"))
        self._evicted[handle.id] = reason
        while len(self._evicted) > self.remember_evicted:
            self._evicted.popitem(last=False)

    def _close(self, handle: SessionHandle, error: ApiError) -> None:
        handle.engine_session.closed = error
        self._sessions.pop(handle.id, None)
        self.remember_ended(handle.id, handle.created_at)
        if self._on_close is not None:
            self._on_close(handle)
        for watcher in list(handle.watchers):
            watcher.end(error)


def page_after(entries: list[Any], key: Callable[[Any], tuple[Any, str]], after: str | None, limit: int,
               ended: Callable[[str], tuple[Any, str] | None], where: str) -> tuple[list[Any], str | None]:
    """A page of ``entries`` in ``key`` order ((created, id): oldest first): ``limit`` of them after the one whose
    id is ``after``, and the id to pass as ``after`` for the next (None at the end). ``after`` may name a session
    that ended since its page was served, if ``ended`` still knows where it stood: the listing goes on from there,
    so churn (a delete, an eviction) never stops a client walking the pages. 422 for an id never listed here."""
    ordered = sorted(entries, key=key)
    if after is not None:
        keys = [key(entry) for entry in ordered]
        at = next((k for k in keys if k[1] == after), None) or ended(after)
        if at is None:
            raise ApiError("invalid_request", f"after={after!r} is not a session of {where} (nor one that ended "
                                              "lately); pass the 'next' of the previous page")
        ordered = ordered[bisect.bisect_right(keys, at):]
    page = ordered[:limit]
    return page, (key(page[-1])[1] if len(ordered) > limit else None)
