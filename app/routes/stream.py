"""WS /v1/sessions/{id}/stream: chunk payloads in, one binary message per finalized unit out.

Protocol (api.md): the client sends binary messages (chunk payloads, any split of the stream) and the text
message ``{"type": "flush"}``. The server sends each unit as soon as the engine commits it (safetensors with
metadata ``frame_start``, ``frame_end``, ``latency_ms``), ``{"type": "error", "error": {...}}`` events for a
rejected message (the session goes on as if it never arrived), and after a flush ``{"type": "done",
"frames": N}`` and close 1000. The connection is closed with an error only when the session cannot continue.

Flow control: one reader and one writer per connection. The reader submits a message only when the previous
one is done and fewer than ``ws_outbound_queue`` units wait to be written, so a client that stops reading
stalls its own stream (and, through TCP, its own sends) but never the engine or another session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from models.errors import RefinerError
from models.session import Unit

from ..codec import LATENTS, PROMPT_EMBEDS, PROMPT_MASK, decode, encode
from ..deps import check_payload
from ..engine import ChunkJob
from ..errors import WS_MESSAGE_TOO_BIG, WS_NORMAL, WS_POLICY_VIOLATION, ApiError, from_exception
from ..registry import SessionHandle
from ..services import Services

log = logging.getLogger(__name__)
router = APIRouter(tags=["sessions"])

_STOP = object()
# Close reasons must fit a control frame (123 bytes).
_MAX_REASON = 120


@router.websocket("/v1/sessions/{session_id}/stream")
async def stream(websocket: WebSocket, session_id: str) -> None:
    services: Services = websocket.app.state.services
    try:
        services.require_ready()
        handle = services.registry.get(session_id)
        if handle.streaming:
            raise ApiError(
                "stream_in_use",
                f"session {session_id} already has an open stream; close it before opening another",
            )
    except ApiError as error:
        await deny(websocket, error, services)
        return
    await websocket.accept()
    await StreamConnection(websocket, handle, services).run()


async def deny(websocket: WebSocket, error: ApiError, services: Services) -> None:
    """Refuse the handshake with the error's HTTP status (or, without the denial extension, close at once)."""
    services.reject(error)
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        headers = error.headers(services.settings.retry_after_s)
        await websocket.send_denial_response(JSONResponse(error.envelope(), status_code=error.status, headers=headers))
        return
    await websocket.accept()
    await websocket.send_text(json.dumps({"type": "error", **error.envelope()}))
    await websocket.close(error.spec.ws_close or WS_POLICY_VIOLATION, error.message[:_MAX_REASON])


class StreamConnection:
    def __init__(self, websocket: WebSocket, handle: SessionHandle, services: Services):
        self.websocket = websocket
        self.handle = handle
        self.services = services
        self.settings = services.settings
        self.loop = asyncio.get_running_loop()
        self.outbox: asyncio.Queue = asyncio.Queue()  # bounded by the reader, see _wait_for_room
        self.units_waiting = 0
        self.room = asyncio.Event()
        self.closing = False
        self._done = asyncio.Event()
        self._reader: asyncio.Task | None = None

    @property
    def session_id(self) -> str:
        return self.handle.id

    # --- lifecycle -----------------------------------------------------------------------------------------
    async def run(self) -> None:
        self.handle.streaming = True
        self.services.streams.add(self)
        writer = asyncio.create_task(self._write_loop(), name=f"ws-writer {self.session_id}")
        self._reader = asyncio.create_task(self._read_loop(), name=f"ws-reader {self.session_id}")
        try:
            # wait() rather than await: the writer cancels the reader after a close it initiated.
            await asyncio.wait({self._reader})
            self.outbox.put_nowait(_STOP)
            await asyncio.wait({writer}, timeout=self.settings.drain_timeout_s)
        finally:
            writer.cancel()
            self._reader.cancel()
            self.handle.streaming = False
            self.services.registry.touch(self.handle)
            self.services.streams.discard(self)
            self._done.set()

    def close(self, code: int, reason: str) -> None:
        """Close after everything already queued has been sent (drain, session deleted)."""
        if not self.closing:
            self.closing = True
            self.outbox.put_nowait(("close", code, reason[:_MAX_REASON]))

    async def closed(self) -> None:
        await self._done.wait()

    # --- reading -------------------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while not self.closing:
            try:
                message = await self.websocket.receive()
            except (WebSocketDisconnect, RuntimeError):
                return
            if message["type"] == "websocket.disconnect":
                return
            self.services.registry.touch(self.handle)
            data, text = message.get("bytes"), message.get("text")
            size = len(data) if data is not None else len((text or "").encode())
            if size > self.settings.max_ws_message_bytes:
                self._report(
                    ApiError(
                        "payload_too_large",
                        f"a {size}-byte message exceeds the limit of {self.settings.max_ws_message_bytes} bytes "
                        "(max_ws_message_bytes); send fewer frames per message",
                    ),
                    close_code=WS_MESSAGE_TOO_BIG,
                )
                return
            if data is not None:
                await self._wait_for_room()
                await self._chunk(data)
            else:
                await self._command(text or "")

    async def _wait_for_room(self) -> None:
        while self.units_waiting >= self.settings.ws_outbound_queue and not self.closing:
            self.room.clear()
            await self.room.wait()

    async def _chunk(self, data: bytes) -> None:
        received = time.perf_counter()
        try:
            tensors = decode(data)
            latents = check_payload(tensors, self.settings, self.settings.max_frames_per_chunk, "max_frames_per_chunk")
            job = ChunkJob(
                self.handle.lane,
                latents,
                tensors.get(PROMPT_EMBEDS),
                tensors.get(PROMPT_MASK),
                atomic=False,
                on_unit=self._deliver_from(received),
            )
            self.services.require_ready()
            await self.services.engine.run(job)
        except (ApiError, RefinerError) as exc:
            self._report(exc)
        except Exception as exc:
            log.exception("stream %s: chunk failed", self.session_id)
            self._report(exc)

    async def _command(self, text: str) -> None:
        try:
            command = json.loads(text)
        except ValueError:
            command = None
        if not isinstance(command, dict) or command.get("type") != "flush":
            self._report(
                ApiError(
                    "invalid_payload",
                    f"unknown text message {text[:80]!r}; send binary chunk payloads and the text {{\"type\": \"flush\"}}",
                )
            )
            return
        state = self.handle.session.state
        if not state.flushed:  # a second flush (say, after a reconnect) just repeats "done"
            try:
                self.services.require_ready()
                job = ChunkJob(
                    self.handle.lane, None, flush=True, atomic=False, on_unit=self._deliver_from(time.perf_counter())
                )
                await self.services.engine.run(job)
            except Exception as exc:
                self._report(exc)
                return
        frames = self.handle.session.state.frames_returned
        self.outbox.put_nowait(("text", json.dumps({"type": "done", "frames": frames})))
        self.close(WS_NORMAL, "stream flushed")

    # --- writing -------------------------------------------------------------------------------------------
    def _deliver_from(self, received: float):
        """An ``on_unit`` for the engine thread: encode there, hand the bytes to the loop, never block."""
        response_dtype = self.settings.response_dtype

        def deliver(unit: Unit) -> None:
            latents = unit.latents.float() if response_dtype == "float32" else unit.latents
            latency_ms = (time.perf_counter() - received) * 1000.0
            payload = encode(
                {LATENTS: latents},
                {"frame_start": unit.frame_start, "frame_end": unit.frame_end, "latency_ms": f"{latency_ms:.3f}"},
            )
            self.loop.call_soon_threadsafe(self._enqueue_unit, payload)

        return deliver

    def _enqueue_unit(self, payload: bytes) -> None:
        self.units_waiting += 1
        self.outbox.put_nowait(("bytes", payload))

    def _report(self, exc: BaseException, close_code: int | None = None) -> None:
        error = from_exception(exc)
        self.services.reject(error)
        self.outbox.put_nowait(("text", json.dumps({"type": "error", **error.envelope()})))
        code = close_code or error.spec.ws_close
        if code is not None:
            self.close(code, error.message)

    async def _write_loop(self) -> None:
        websocket = self.websocket
        while True:
            item: Any = await self.outbox.get()
            if item is _STOP:
                return
            kind = item[0]
            try:
                if kind == "bytes":
                    await websocket.send_bytes(item[1])
                    self.units_waiting -= 1
                    self.room.set()
                elif kind == "text":
                    await websocket.send_text(item[1])
                else:
                    _, code, reason = item
                    await websocket.close(code, reason)
                    self.closing = True
                    # The reader may sit in receive() until the client answers the close; it has nothing left
                    # to do, so stop it rather than wait.
                    if self._reader is not None and self._reader is not asyncio.current_task():
                        self._reader.cancel()
                    self.room.set()
                    return
            except (WebSocketDisconnect, RuntimeError, OSError) as exc:
                log.info("stream %s: client went away while sending (%r)", self.session_id, exc)
                self.closing = True
                if self._reader is not None:
                    self._reader.cancel()
                self.room.set()
                return
            except Exception:
                with contextlib.suppress(Exception):
                    log.exception("stream %s: send failed", self.session_id)
                self.closing = True
                if self._reader is not None:
                    self._reader.cancel()
                return
