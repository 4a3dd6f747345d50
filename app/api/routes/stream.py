"""WS /v1/sessions/{id}/stream: chunk payloads in, one binary message per finalized unit out.

Protocol (api.md): the client sends binary messages (chunk payloads, any split of the stream) and the text
message ``{"type": "flush"}``. The server sends each unit as soon as the engine commits it (safetensors with
metadata ``frame_start``, ``frame_end``, ``latency_ms``), ``{"type": "error", "error": {...}}`` events for a
rejected message (the session goes on as if it never arrived), and after a flush ``{"type": "done",
"frames": N}`` and close 1000. The connection is closed with an error only when the session cannot continue.

Reattach (docs/api.md, "Reattach: a dropped stream is not a lost session"): ``?resume_from=N`` on the URL makes
the connection a resume of the session's stream. It takes the session over from a previous connection that is
still open (a dropped client whose socket the server has not noticed yet), waits until every message that
connection handed to the engine is done, then sends ``{"type": "session", ...}`` (frames received and returned,
next seq, flushed) and again every retained unit holding frames at or after N that the session streamed (not those
returned in HTTP responses: ``RetainedUnits.streamed``), before any new unit. Units are retained per session
(``ws_resume_units``), not per connection, so units committed while no client is attached are kept too.

Flow control: one reader and one writer per connection. The reader submits a message only when the previous
one is done and fewer than ``ws_outbound_queue`` units wait to be written, so a client that stops reading
stalls its own stream (and, through TCP, its own sends) but never the engine or another session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from models.errors import NonFiniteOutputError, RefinerError

from app.api.auth import select_subprotocol
from app.core.error_kinds import (
    WS_INTERNAL_ERROR, WS_MESSAGE_TOO_BIG, WS_NORMAL, WS_POLICY_VIOLATION, WS_TRY_AGAIN_LATER, ApiError,
    from_exception,
)
from app.engine.engine_errors import EngineError
from app.outputs.replay import SentUnit
from app.runtime.services import Services
from app.sessions.operations import RefuseInBand, StreamSession, StreamTakenOver

log = logging.getLogger(__name__)
router = APIRouter(tags=["sessions"])

_STOP = object()
# Tasks nobody awaits (a best-effort close): the event loop holds tasks only weakly, so one could be collected
# before it ran; each stays here until it is done.
_BACKGROUND: set[asyncio.Task] = set()
# Close reasons must fit a control frame (123 bytes).
_MAX_REASON = 120
# The longest text message a stream parses. Its one text message is {"type": "flush"}; a longer one is refused
# unread, since json.loads of a text up to max_ws_message_bytes runs on the event loop (a 50 MB object of 4 million
# keys held it, and every other connection, for 4 s and took 600 MB).
MAX_COMMAND_CHARS = 4096


@router.websocket("/v1/sessions/{session_id}/stream")
async def stream(websocket: WebSocket, session_id: str, resume_from: str | None = None) -> None:
    # resume_from is declared (as text: open_stream says what is wrong with it), so app.api.factory.QueryRule lets it through.
    services: Services = websocket.app.state.services
    try:
        session = await services.sessions.open_stream(session_id, resume_from)
    except RefuseInBand as refused:
        await refuse(websocket, refused.error, services)
        return
    except ApiError as error:
        await deny(websocket, error, services)
        return
    connection = StreamConnection(websocket, session, services)
    # Claimed before the first await, so two connections racing for one session cannot both pass the check.
    connection.claim()
    try:
        await websocket.accept(subprotocol=subprotocol(websocket))
    except BaseException:
        connection.release()
        raise
    await connection.run()


async def deny(websocket: WebSocket, error: ApiError, services: Services) -> None:
    """Refuse the handshake with the error's HTTP status (or, without the denial extension, close at once)."""
    services.reject(error)
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        headers = error.headers(services.settings.retry_after_s)
        await websocket.send_denial_response(JSONResponse(error.envelope(), status_code=error.status, headers=headers))
        return
    await websocket.accept(subprotocol=subprotocol(websocket))
    await websocket.send_text(json.dumps({"type": "error", **error.envelope()}))
    await websocket.close(error.spec.ws_close or WS_POLICY_VIOLATION, close_reason(error.message))


def subprotocol(websocket: WebSocket) -> str | None:
    """What to accept with: a browser fails a connection whose 101 names none of the subprotocols it offered."""
    return select_subprotocol(websocket.scope.get("subprotocols") or [])


def close_reason(text: str) -> str:
    """``text`` as a close frame's reason: at most ``_MAX_REASON`` bytes of UTF-8, cut at a character (a control
    frame carries 125 bytes, 2 of them the code; websockets refuses a longer one: a message that quotes what a client
    sent in another script, 3 bytes a character, was cut to 120 characters and broke the close)."""
    return text.encode()[:_MAX_REASON].decode(errors="ignore")


async def refuse(websocket: WebSocket, error: ApiError, services: Services) -> None:
    """Accept, explain with an error event, close: for resume errors, which a client handles in-band (many
    WebSocket clients cannot read a refused handshake's body)."""
    services.reject(error)
    await websocket.accept(subprotocol=subprotocol(websocket))
    await websocket.send_text(json.dumps({"type": "error", **error.envelope()}))
    await websocket.close(error.spec.ws_close or WS_POLICY_VIOLATION, close_reason(error.message))


class StreamConnection:
    """The WebSocket side of one stream: a reader, a writer and the outbox between them; what it does to the
    session goes through its ``StreamSession`` (app.sessions.operations). It is the session's stream subscription
    (``app.sessions.subscriptions.StreamSubscriber``, registered by ``claim``): units reach it through that
    protocol's ``send_unit`` only."""

    def __init__(self, websocket: WebSocket, session: StreamSession, services: Services):
        self.websocket = websocket
        self.session = session
        self.services = services
        self.settings = services.settings
        self.resume_from = session.resume_from
        self.skip_until = 0  # units ending at or before this frame are not sent (the client has them)
        self.loop = asyncio.get_running_loop()
        self.outbox: asyncio.Queue = asyncio.Queue()  # bounded by the reader, see _wait_for_room
        self.units_waiting = 0
        self.events_waiting = 0  # text events in the outbox: they count against ws_outbound_queue like units
        self.room = asyncio.Event()
        self.closing = False
        # Units reach this connection only once it is attached: before that they are retained by the session
        # and sent as part of the resume, so a unit is never sent twice or skipped.
        self.attached = False
        # The client went away (closed or lost the connection) rather than the server closing the stream.
        self.dropped = False
        self._done = asyncio.Event()
        self._reader: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None

    @property
    def session_id(self) -> str:
        return self.session.session_id

    # --- lifecycle -----------------------------------------------------------------------------------------
    def claim(self) -> None:
        """Become the session's connection (a previous one, if any, is abandoned in ``run``)."""
        self.session.claim(self)

    def release(self) -> None:
        self.session.release(self, self.dropped)
        self._done.set()

    async def run(self) -> None:
        self.claim()
        self._writer = asyncio.create_task(self._write_loop(), name=f"ws-writer {self.session_id}")
        try:
            if await self._attach():
                self._reader = asyncio.create_task(self._read_loop(), name=f"ws-reader {self.session_id}")
                # wait() rather than await: the writer cancels the reader after a close it initiated.
                await asyncio.wait({self._reader})
                failed = None if self._reader.cancelled() else self._reader.exception()
                if failed is not None:  # a bug: said to the client and the log, not a silent end of the stream
                    log.error("stream %s: reading the connection failed", self.session_id, exc_info=failed)
                    self._report(failed, close_code=WS_INTERNAL_ERROR)
                # Units of the messages already handed over are still being encoded: they go out before the end
                # (a failed or late hand-over is the session's: its units stay retained for a resume).
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.session.settle(), timeout=self.settings.drain_timeout_s)
            self.outbox.put_nowait(_STOP)
            await asyncio.wait({self._writer}, timeout=self.settings.drain_timeout_s)
        finally:
            self._writer.cancel()
            if self._reader is not None:
                self._reader.cancel()
            self.release()

    async def _attach(self) -> bool:
        """Start receiving units; on a resume, first report the stream's position and send what was missed.
        False when the connection is to be closed instead (the error is queued)."""
        if self.resume_from is None:
            self.attached = True
            return True
        try:
            event, units = await self.session.resume(self, self.settings.drain_timeout_s)
        except StreamTakenOver as taken:
            self.close(WS_POLICY_VIOLATION, taken.message)
            return False
        except ApiError as error:
            busy = error.kind == "engine_busy"
            self._report(error, close_code=WS_TRY_AGAIN_LATER if busy else WS_POLICY_VIOLATION)
            return False
        self.skip_until = self.resume_from
        self._send_text(event)
        # No await from here to ``attached``: a unit published meanwhile is either in ``units`` or sent live.
        for unit in units:
            self.send_unit(unit, force=True)
        self.attached = True
        return True

    def close(self, code: int, reason: str) -> None:
        """Close after everything already queued has been sent (drain, session deleted)."""
        if not self.closing:
            self.closing = True
            self.outbox.put_nowait(("close", code, close_reason(reason)))

    def abandon(self) -> None:
        """A reattaching connection took the session over: stop at once. Nothing is lost by dropping the queue:
        the session retains the units, and the new connection resends what its client is missing."""
        self.closing = True
        self.attached = False
        while not self.outbox.empty():
            self.outbox.get_nowait()
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()
        self.room.set()
        # Best effort: a live peer learns why; a dead one costs nothing (bounded, off the reattach path).
        _keep(self._close_quietly(WS_POLICY_VIOLATION, "another connection resumed this session"))

    async def _close_quietly(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.websocket.close(code, reason), timeout=5.0)

    async def closed(self) -> None:
        await self._done.wait()

    # --- reading -------------------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while not self.closing:
            try:
                message = await self.websocket.receive()
            except (WebSocketDisconnect, RuntimeError):
                self.dropped = not self.closing
                return
            if message["type"] == "websocket.disconnect":
                self.dropped = not self.closing
                return
            self.session.touch()
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
            # Every message waits for room, not only chunks: each bad one queues an error event, and a client that
            # sends a million of them without reading must meet TCP back-pressure, not grow the server.
            await self._wait_for_room()
            if data is not None:
                await self._chunk(data)
            else:
                await self._command(text or "")

    async def _wait_for_room(self) -> None:
        # Units still being encoded count too: they are this connection's as soon as they are published.
        while (self.units_waiting + self.events_waiting + self.session.pending_units >= self.settings.ws_outbound_queue
               and not self.closing):
            self.room.clear()
            await self.room.wait()

    async def _chunk(self, data: bytes) -> None:
        try:
            await self.session.message(data)
        except (ApiError, EngineError) as exc:
            # A message refused for capacity was not taken, but the client's next ones are already on their way:
            # taken, they would land after a hole. Close instead; the client reconnects with ?resume_from=N and
            # resends from frames_received.
            busy = from_exception(exc).kind in ("engine_busy", "insufficient_memory")
            self._report(exc, close_code=WS_TRY_AGAIN_LATER if busy else None)
        except NonFiniteOutputError as exc:
            # The session dropped frames it could not refine (app.engine.worker, _drop_unrefined): where to resend from.
            self._report(exc, extra={"frames_received": self.session.frames_received})
        except RefinerError as exc:
            self._report(exc)
        except Exception as exc:
            log.exception("stream %s: chunk failed", self.session_id)
            self._report(exc)

    async def _command(self, text: str) -> None:
        if len(text) > MAX_COMMAND_CHARS:
            self._report(ApiError(
                "invalid_payload",
                f"a text message of {len(text)} characters, more than the {MAX_COMMAND_CHARS} a stream reads; its one "
                "text message is {\"type\": \"flush\"} (binary messages carry the chunk payloads)"))
            return
        try:
            command = json.loads(text)
        except (ValueError, RecursionError):  # "[" * 5000 nests past the parser's recursion limit
            command = None
        if not isinstance(command, dict) or command.get("type") != "flush":
            self._report(
                ApiError(
                    "invalid_payload",
                    f"unknown text message {text[:80]!r}; send binary chunk payloads and the text {{\"type\": \"flush\"}}",
                )
            )
            return
        if len(command) > 1:  # nothing a client sends is ignored without a word: a key it meant did nothing
            others = ", ".join(repr(key) for key in sorted(command) if key != "type")
            self._report(ApiError(
                "invalid_payload", f"the flush takes no other key than \"type\" (got {others[:200]}); send "
                "{\"type\": \"flush\"} alone (the session's fields are set when it is created)"))
            return
        try:
            frames = await self.session.flush()
        except NonFiniteOutputError as exc:  # the final block: its frames were dropped, as for a chunk
            self._report(exc, extra={"frames_received": self.session.frames_received})
            return
        except Exception as exc:
            self._report(exc)
            return
        self._send_text({"type": "done", "frames": frames})
        self.close(WS_NORMAL, "stream flushed")

    # --- writing -------------------------------------------------------------------------------------------
    def send_unit(self, unit: SentUnit, force: bool = False) -> None:
        """Queue a unit for this client (``SessionOps.published`` calls it for every unit, through the
        subscription; before the connection is attached a unit is skipped, as it is retained for the resume)."""
        if not (self.attached or force) or self.closing or unit.frame_end <= self.skip_until:
            return
        self.units_waiting += 1
        self.outbox.put_nowait(("unit", unit))

    @property
    def is_closed(self) -> bool:
        return self._done.is_set()

    def abort(self) -> None:
        """Stop now, without waiting for a client that neither reads nor closes (the drain's deadline passed)."""
        self.closing = True
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()
        self.room.set()

    def _send_text(self, event: dict[str, Any]) -> None:
        self.events_waiting += 1
        self.outbox.put_nowait(("text", json.dumps(event)))

    def _report(self, exc: BaseException, close_code: int | None = None, extra: dict[str, Any] | None = None) -> None:
        error = from_exception(exc)
        self.services.reject(error)
        self._send_text({"type": "error", **error.envelope(), **(extra or {})})
        code = close_code or error.spec.ws_close
        if error.kind == "draining" and self.services.draining:
            # The drain closes every stream itself once the sessions are saved, with the code that says whether
            # this one was (1012) or not (1001); closing here would pre-empt that.
            code = None
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
                if kind == "unit":
                    try:
                        data = item[1].data(self.session.encode_again)
                    except Exception as exc:  # the unit stays retained: a reconnecting client gets it again
                        log.exception("stream %s: a unit cannot be encoded", self.session_id)
                        await websocket.send_text(json.dumps({"type": "error", **from_exception(exc).envelope()}))
                        await websocket.close(WS_INTERNAL_ERROR, "a unit could not be encoded; reconnect to resume")
                        self.closing = True
                        if self._reader is not None:
                            self._reader.cancel()
                        return
                    await websocket.send_bytes(data)
                    self.units_waiting -= 1
                    self.room.set()
                elif kind == "text":
                    await websocket.send_text(item[1])
                    self.events_waiting -= 1
                    self.room.set()
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
                self.dropped = not self.closing
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


def _keep(coroutine) -> asyncio.Task:
    task = asyncio.ensure_future(coroutine)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task
