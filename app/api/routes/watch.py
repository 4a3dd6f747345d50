"""WS /v1/sessions/{id}/watch: a read-only subscriber to a session's units (api.md 1.1, "Watching a session").

A watcher gets every unit the session finalizes from the moment it joins, over HTTP chunks or a stream alike, in
the session's formats restricted to ``?outputs=`` (default: all of the session's), each followed (for a refined
block) by ``{"type": "block", "frame_start", "frame_end", "latency_ms"}``; after the session's flush, ``{"type":
"done", "frames": N}`` and close 1000.

It never slows anything down: units are offered to its queue without waiting, and when ``watch_queue_units`` are
already waiting the unit is dropped and counted; the next message it gets is ``{"type": "dropped", "units": N}``.
A unit in the session's own outputs reuses the producer's bytes; another selection (``?outputs=``,
``?video_format=jpeg``, ``?video_quality=``) is put on the wire on the watchers' own encoder threads, never the
producer's, and its video is encoded once per unit and format however many watchers ask; a watcher whose
encodings fall behind loses units as a slow one does. A watcher does not keep its session alive (an evicted or deleted
session ends it with an error event) and cannot send chunks: a message from it is answered with an error event
and otherwise ignored.

Browsers cannot set headers on a WebSocket: with an API key, the page offers the subprotocol
``wm-refiner.bearer.<base64url key>`` (app.api.auth); the route accepts with one of the subprotocols offered
(``app.api.auth.select_subprotocol``), without which a browser fails the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import Any

from fastapi import APIRouter
from starlette.websockets import WebSocket, WebSocketDisconnect

from app.api.routes.stream import close_reason, deny, refuse, subprotocol
from app.core.error_kinds import WS_NORMAL, ApiError
from app.outputs.delivery import UnitCopies
from app.outputs.kinds import HostUnit, Outputs
from app.outputs.replay import SentUnit, latency_of, narrowed
from app.runtime.services import Services
from app.sessions.operations import RefuseInBand

log = logging.getLogger(__name__)
router = APIRouter(tags=["sessions"])


@router.websocket("/v1/sessions/{session_id}/watch")
async def watch(
    websocket: WebSocket, session_id: str,
    outputs: str | None = None, video_format: str | None = None, video_quality: str | None = None,
    resume_from: str | None = None,
) -> None:
    # The query is declared (as text: Outputs.restrict says what is wrong with it), so app.api.factory.QueryRule refuses
    # anything else.
    services: Services = websocket.app.state.services
    try:
        # Subscribed before the first await: no unit published meanwhile is missed.
        watcher = await services.sessions.watch(
            session_id, {"outputs": outputs, "video_format": video_format, "video_quality": video_quality,
                         "resume_from": resume_from},
            lambda sid, chosen: Watcher(websocket, sid, services, chosen))
    except RefuseInBand as refused:  # a bad resume_from: said in-band, as on a stream
        await refuse(websocket, refused.error, services)
        return
    except ApiError as error:
        await deny(websocket, error, services)
        return
    try:
        await websocket.accept(subprotocol=subprotocol(websocket))
        await watcher.run()
    finally:
        services.sessions.unwatch(watcher)
        watcher.done_event.set()


class Watcher:
    """One watcher: a bounded queue of units and one task writing it out. It is a watch subscription of its
    session (``app.sessions.subscriptions.WatchSubscriber``, registered by ``SessionOps.watch``)."""

    def __init__(self, websocket: WebSocket, session_id: str, services: Services, outputs: Outputs):
        self.websocket = websocket
        self.session_id = session_id
        self.services = services
        self.outputs = outputs
        self.limit = services.settings.watch_queue_units
        self.queue: deque[tuple] = deque()  # units (bounded by ``limit``) and, at the end, done / close
        self.dropped = 0  # units lost since the last "dropped" event
        self.skip_until = 0  # offered units ending at or before this frame are not sent (a resume: the client has them)
        self.wakeup = asyncio.Event()
        self.closing = False
        self.done_event = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def is_closed(self) -> bool:
        return self.done_event.is_set()

    async def closed(self) -> None:
        await self.done_event.wait()

    # --- fed from the loop (never waits) -------------------------------------------------------------------
    def offer(self, unit: HostUnit | UnitCopies, received: float, sent: SentUnit | None = None,
              metadata: dict[str, str] | None = None) -> None:
        """A unit the session finalized; ``sent``: its bytes in the session's outputs, when they are ours too;
        ``metadata``: what the unit's bytes say besides frames and latency (seq, durable_frames)."""
        if self.closing:
            return
        described = unit.unit if isinstance(unit, UnitCopies) else unit
        if described.frame_end <= self.skip_until:
            return
        if sum(1 for item in self.queue if item[0] == "unit") >= self.limit:
            self.dropped += 1
            self.services.metrics.watch_units_dropped.inc()
            return
        latency_ms = (time.perf_counter() - received) * 1000.0
        self.queue.append(("unit", unit, received, sent, latency_ms, metadata))
        self.wakeup.set()

    def replay(self, units: list[SentUnit], outputs: Outputs, resume_from: int) -> None:
        """``?resume_from=N``: ``units`` (retained, in the session's ``outputs``) go out first, outside the queue's
        bound (they are at most ``ws_resume_units``); units offered later that end at or before N are skipped."""
        self.skip_until = resume_from
        for unit in units:
            self.queue.append(("replay", unit, outputs))
        self.wakeup.set()

    def finish(self, frames: int) -> None:
        """The session was flushed and every unit offered (``frames`` returned in all): done, then close 1000."""
        if self.closing:
            return
        self.queue.append(("text", {"type": "done", "frames": frames}))
        self.close(WS_NORMAL, "stream flushed")

    def end(self, error: ApiError) -> None:
        """The session is gone (deleted, evicted): say why and close."""
        if self.closing:
            return
        self.queue.append(("text", {"type": "error", **error.envelope()}))
        self.close(error.spec.ws_close or WS_NORMAL, error.message)

    def close(self, code: int, reason: str) -> None:
        if not self.closing:
            self.closing = True
            self.queue.append(("close", code, close_reason(reason)))
            self.wakeup.set()

    def abort(self) -> None:
        self.closing = True
        for task in self._tasks:
            task.cancel()

    # --- the connection ------------------------------------------------------------------------------------
    async def run(self) -> None:
        writer = asyncio.create_task(self._write_loop(), name=f"watch-writer {self.session_id}")
        reader = asyncio.create_task(self._read_loop(), name=f"watch-reader {self.session_id}")
        self._tasks = [writer, reader]
        try:
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.closing = True
            for task in self._tasks:
                task.cancel()
            # wait, not gather: a cancellation of this task must reach it as sent (anyio's cancel scopes check it).
            await asyncio.wait(self._tasks)

    async def _read_loop(self) -> None:
        """Only to notice the client leaving; a watcher has nothing to send."""
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            if any(item[0] == "refusal" for item in self.queue):
                continue  # one unsent refusal says it all: a client that floods a watcher cannot grow its queue
            error = ApiError("invalid_request", "a watcher is read-only; send chunks on the session's stream "
                                                "(WS /v1/sessions/{id}/stream) or POST /v1/sessions/{id}/chunks")
            self.queue.appendleft(("refusal", {"type": "error", **error.envelope()}))
            self.wakeup.set()

    async def _write_loop(self) -> None:
        websocket = self.websocket
        try:
            while True:
                if not self.queue:
                    self.wakeup.clear()
                    await self.wakeup.wait()
                    continue
                item = self.queue.popleft()
                kind = item[0]
                if self.dropped and kind != "close":
                    dropped, self.dropped = self.dropped, 0
                    await websocket.send_text(json.dumps({"type": "dropped", "units": dropped}))
                if kind == "unit":
                    await self._send_unit(*item[1:])
                elif kind == "replay":
                    await self._send_replayed(*item[1:])
                elif kind in ("text", "refusal"):
                    await websocket.send_text(json.dumps(item[1]))
                else:
                    _, code, reason = item
                    with contextlib.suppress(Exception):
                        await websocket.close(code, reason)
                    return
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            log.info("watcher of %s went away (%r)", self.session_id, exc)

    async def _send_unit(self, unit: HostUnit | UnitCopies, received: float, sent: SentUnit | None,
                         latency_ms: float, metadata: dict[str, str] | None) -> None:
        if sent is not None and sent.payload is not None:
            data = sent.payload
        else:
            encoder = self.services.encoder

            def build() -> bytes:
                host = unit.wait() if isinstance(unit, UnitCopies) else unit
                return encoder.unit_bytes(host, self.outputs, received, metadata)

            data = await encoder.run_for_watcher(build)
        await self.websocket.send_bytes(data)
        described = unit.unit if isinstance(unit, UnitCopies) else unit  # both say kind and frames
        if described.kind == "block":
            event: dict[str, Any] = {"type": "block", "frame_start": described.frame_start,
                                     "frame_end": described.frame_end, "latency_ms": round(latency_ms, 3)}
            await self.websocket.send_text(json.dumps(event))

    async def _send_replayed(self, unit: SentUnit, session_outputs: Outputs) -> None:
        """A retained unit sent again: the session's bytes as they were (bit for bit what its producer got), without
        the kinds this watcher did not ask for; then, for a refined block, its "block" event (its latency as the unit
        says it)."""
        encoder = self.services.encoder
        if unit.payload is None:  # its first encoding failed: encoded now, in this watcher's outputs
            data = await encoder.run_for_watcher(
                lambda: encoder.unit_bytes(unit.host, self.outputs, time.perf_counter(), unit.metadata))
        elif self.outputs.kinds == session_outputs.kinds:
            data = unit.payload
        else:
            stages = encoder.stages
            dropped = {kind: stages[kind].wire_names or (kind,)
                       for kind in session_outputs.kinds if kind not in self.outputs.kinds}
            data = await encoder.run_for_watcher(lambda: narrowed(unit.payload, dropped))
        await self.websocket.send_bytes(data)
        if 0 < unit.frame_start < unit.frame_end:  # a block (the sink starts at frame 0, a tail holds no frame)
            latency = latency_of(data)
            event: dict[str, Any] = {"type": "block", "frame_start": unit.frame_start, "frame_end": unit.frame_end,
                                     "latency_ms": None if latency is None else round(latency, 3)}
            await self.websocket.send_text(json.dumps(event))
