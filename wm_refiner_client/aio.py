"""The asyncio client: ``AsyncClient`` and ``AsyncSession``, the same operations as ``Client``/``Session`` with
``await`` (and ``async for`` over streams and watches)::

    async with AsyncClient("http://127.0.0.1:8000") as client:
        session = await client.create_session(block_size=3)
        async for unit in session.stream(chunks, prompt=prompt):   # chunks: an iterable or an async iterable
            ...
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterable, AsyncIterator, Iterable, Mapping

import httpx
import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from ._common import (
    FLUSH_MESSAGE,
    RESUMABLE_EVENT_CODES,
    WS_MAX_SIZE,
    BlockEvent,
    DroppedEvent,
    SessionState,
    SessionSummary,
    StreamStats,
    auth_headers,
    check_config,
    check_session_id,
    event_error,
    parse_event,
    refine_query,
    resolve_api_key,
    resolve_url,
    response_error,
    session_path,
    ws_url,
)
from .client import OCTET, _geometry, _join, _raise_if_fatal, _take
from .errors import ProtocolError, ServiceUnavailableError, StreamClosedError, TransportError
from .resume import ChunkSource, UnitTracker, frames_before_flush
from .retry import RetryPolicy
from .units import Array, ReturnTensors, Unit, encode

log = logging.getLogger("wm_refiner_client")


class AsyncClient:
    """A wm-refiner server, for asyncio. Arguments as for ``Client``."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 120.0,
                 retry: RetryPolicy | None = None, return_tensors: ReturnTensors = "np"):
        if return_tensors not in ("np", "pt"):
            raise ValueError(f"return_tensors must be 'np' or 'pt', got {return_tensors!r}")
        self.base_url = resolve_url(base_url)
        self.api_key = resolve_api_key(api_key)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.return_tensors: ReturnTensors = return_tensors
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, headers=auth_headers(self.api_key))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # --- the server --------------------------------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        """``GET /v1/info``."""
        return (await self._request("GET", "/v1/info")).json()

    async def ready(self) -> bool:
        """Whether ``/ready`` answers 200; never raises on a 503."""
        try:
            return (await self._http.get("/ready")).status_code == 200
        except httpx.HTTPError:
            return False

    async def sessions(self, page_size: int = 100) -> list[SessionSummary]:
        """``GET /v1/sessions``: every live session, oldest first (all pages)."""
        found: list[SessionSummary] = []
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": page_size}
            if after is not None:
                params["after"] = after
            page = (await self._request("GET", "/v1/sessions", params=params)).json()
            found.extend(SessionSummary.from_json(item) for item in page["sessions"])
            after = page.get("next")
            if after is None:
                return found

    # --- sessions ----------------------------------------------------------------------------------------------
    async def create_session(self, **config: Any) -> AsyncSession:
        """``POST /v1/sessions`` (see ``Client.create_session``)."""
        response = await self._request("POST", "/v1/sessions", json=check_config(config), idempotent=False)
        data = response.json()
        return AsyncSession(self, data["session_id"], data["config"], next_seq=0)

    async def session(self, id: str, **config: Any) -> AsyncSession:
        """``PUT /v1/sessions/{id}`` (see ``Client.session``)."""
        response = await self._request("PUT", session_path(check_session_id(id)), json=check_config(config))
        data = response.json()
        if response.status_code == 201:
            return AsyncSession(self, data["session_id"], data["config"], next_seq=0)
        return await self.get_session(data["session_id"])

    async def get_session(self, id: str) -> AsyncSession:
        """A handle on an existing session, continuing from where it stands."""
        state = SessionState.from_json((await self._request("GET", session_path(id))).json())
        return AsyncSession(self, state.session_id, state.config, next_seq=state.next_seq,
                            frames_returned=state.frames_returned, video_frames_returned=state.video_frames_returned)

    async def delete_session(self, id: str) -> None:
        """``DELETE /v1/sessions/{id}``."""
        await self._request("DELETE", session_path(id))

    async def refine(self, clip: Array, prompt: Array | None = None, prompt_mask: Array | None = None,
                     **config: Any) -> Unit:
        """``POST /v1/refine`` (see ``Client.refine``)."""
        payload = encode({"latents": clip, "prompt_embeds": prompt, "prompt_attention_mask": prompt_mask})
        response = await self._request("POST", "/v1/refine", params=refine_query(config), content=payload,
                                       headers=OCTET)
        return Unit.from_payload(response.content, self.return_tensors)

    # --- plumbing ----------------------------------------------------------------------------------------------
    async def _request(self, method: str, path: str, *, idempotent: bool = True, **kwargs: Any) -> httpx.Response:
        failures = 0
        while True:
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                failures += 1
                if not (idempotent or never_sent) or failures >= self.retry.attempts:
                    raise TransportError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
                await asyncio.sleep(self.retry.delay(failures))
                continue
            if response.status_code < 400:
                return response
            error = response_error(response.status_code, response.content, response.headers)
            failures += 1
            if not isinstance(error, ServiceUnavailableError) or failures >= self.retry.attempts:
                raise error
            await asyncio.sleep(self.retry.delay(failures, error.retry_after))

    async def _connect(self, path: str, query: Mapping[str, Any] | None = None) -> ClientConnection:
        url = ws_url(self.base_url, path, query)
        try:
            return await connect(url, additional_headers=auth_headers(self.api_key), max_size=WS_MAX_SIZE,
                                 compression=None, open_timeout=self.timeout)
        except InvalidStatus as exc:
            response = exc.response
            raise response_error(response.status_code, response.body or b"", response.headers) from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise TransportError(f"WebSocket {path}: {type(exc).__name__}: {exc}") from exc


class AsyncSession:
    """One session, for asyncio (see ``Session``)."""

    def __init__(self, client: AsyncClient, id: str, config: dict[str, Any], *, next_seq: int | None = None,
                 frames_returned: int = 0, video_frames_returned: int = 0):
        self.client = client
        self.id = id
        self.config = config
        self._next_seq = next_seq
        self._frames_returned = frames_returned
        self._video_frames_returned = video_frames_returned
        self._geometry: tuple[int, int, int, int] | None = None

    def __repr__(self) -> str:
        return f"AsyncSession(id={self.id!r}, frames_returned={self._frames_returned})"

    @property
    def frames_returned(self) -> int:
        return self._frames_returned

    async def send(self, latents: Array, prompt: Array | None = None, prompt_mask: Array | None = None, *,
                   flush: bool = False) -> Unit:
        """``POST /v1/sessions/{id}/chunks`` with automatic ``seq`` and idempotent retries (see ``Session.send``)."""
        if self._next_seq is None:
            self._next_seq = (await self.state()).next_seq
        seq = self._next_seq
        body = encode({"latents": latents, "prompt_embeds": prompt, "prompt_attention_mask": prompt_mask})
        response = await self.client._request(
            "POST", session_path(self.id, "/chunks"), params={"seq": seq, "flush": str(flush).lower()},
            content=body, headers=OCTET,
        )
        unit = Unit.from_payload(response.content, self.client.return_tensors,
                                 replayed=response.headers.get("x-replayed") == "true")
        self._next_seq = seq + 1
        self._geometry = _geometry(latents)
        self._note(unit)
        return unit

    async def flush(self) -> Unit:
        """End the stream (see ``Session.flush``)."""
        if self._geometry is not None:
            batch, channels, height, width = self._geometry
            return await self.send(np.zeros((batch, channels, 0, height, width), np.float32), flush=True)
        units = [unit async for unit in self.stream(())]
        return _join(units, self._frames_returned, self._video_frames_returned)

    def _note(self, unit: Unit) -> None:
        self._frames_returned = max(self._frames_returned, unit.frame_end)
        if unit.video_frame_end is not None:
            self._video_frames_returned = max(self._video_frames_returned, unit.video_frame_end)

    def stream(self, chunks: Iterable[Any] | AsyncIterable[Any], *, prompt: Array | None = None,
               prompt_mask: Array | None = None) -> AsyncStream:
        """Stream ``chunks`` over the WebSocket (see ``Session.stream``); ``async for`` over the units."""
        return AsyncStream(self, chunks, prompt, prompt_mask)

    async def watch(self, outputs: str | Iterable[str] | None = None) -> AsyncIterator[Unit | BlockEvent | DroppedEvent]:
        """``WS /v1/sessions/{id}/watch`` (see ``Session.watch``)."""
        query = {} if outputs is None else {"outputs": outputs if isinstance(outputs, str) else ",".join(outputs)}
        ws = await self.client._connect(session_path(self.id, "/watch"), query)
        async with ws:
            while True:
                try:
                    message = await ws.recv()
                except ConnectionClosed as exc:
                    raise TransportError(f"the watch of session {self.id} ended before the session's flush ({exc})") from exc
                if isinstance(message, bytes):
                    yield Unit.from_payload(message, self.client.return_tensors)
                    continue
                event = parse_event(message)
                kind = event["type"]
                if kind == "block":
                    yield BlockEvent(event["frame_start"], event["frame_end"], event.get("latency_ms"))
                elif kind == "dropped":
                    yield DroppedEvent(event["units"])
                elif kind == "done":
                    return
                elif kind == "error":
                    raise event_error(event)

    async def state(self) -> SessionState:
        """``GET /v1/sessions/{id}``."""
        return SessionState.from_json((await self.client._request("GET", session_path(self.id))).json())

    async def delete(self) -> None:
        await self.client.delete_session(self.id)


class AsyncStream(AsyncIterator[Unit]):
    """The units of one ``AsyncSession.stream(...)`` (see ``Stream``); ``await stream.aclose()`` stops it."""

    def __init__(self, session: AsyncSession, chunks: Iterable[Any] | AsyncIterable[Any], prompt: Array | None,
                 prompt_mask: Array | None):
        self.session = session
        self.stats = StreamStats()
        chunk_iterator = chunks.__aiter__() if hasattr(chunks, "__aiter__") else _aiter(chunks)
        self._units = self._run(chunk_iterator, ChunkSource(prompt, prompt_mask))

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Unit:
        return await self._units.__anext__()

    async def aclose(self) -> None:
        await self._units.aclose()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _run(self, chunks: AsyncIterator[Any], source: ChunkSource) -> AsyncIterator[Unit]:
        session, client, stats = self.session, self.session.client, self.stats
        tracker = UnitTracker(session._frames_returned, session._video_frames_returned)
        # Stream messages count as chunks (next_seq): the handle asks the server again before its next send.
        session._next_seq = None
        base: int | None = None
        failures, retry_after, last_error = 0, None, None
        while True:
            if failures:
                if failures >= client.retry.attempts:
                    raise TransportError(f"stream of session {session.id}: gave up after {failures} failed "
                                         f"attempts (last: {last_error})") from last_error
                await asyncio.sleep(client.retry.delay(failures, retry_after))
            retry_after = None
            try:
                ws = await client._connect(session_path(session.id, "/stream"), {"resume_from": tracker.frames})
            except (ServiceUnavailableError, TransportError) as exc:
                failures, last_error = failures + 1, exc
                retry_after = getattr(exc, "retry_after", None)
                continue
            sender: asyncio.Task | None = None
            try:
                try:
                    first = await ws.recv()
                except ConnectionClosed as exc:
                    failures, last_error = failures + 1, exc
                    continue
                if isinstance(first, bytes):
                    raise ProtocolError("expected the session event, got a binary message")
                event = parse_event(first)
                if event["type"] == "error":
                    error = event_error(event)
                    if error.code not in RESUMABLE_EVENT_CODES:
                        raise error
                    failures, last_error = failures + 1, error
                    continue
                if event["type"] != "session":
                    raise ProtocolError(f"expected the session event first, got {event}")
                if base is None:
                    base = event["frames_received"]
                else:
                    stats.reconnects += 1
                    log.info("stream of session %s resumed at frame %d", session.id, tracker.frames)
                source.rewind(event["frames_received"] - base)
                if event["flushed"] and not source.exhausted:
                    raise StreamClosedError(f"session {session.id} is flushed: it takes no more frames", status=409)
                failed: list[BaseException] = []
                woken = asyncio.Event()
                offset, flushed = base, event["flushed"]

                def may_flush() -> bool:
                    return flushed or tracker.frames >= frames_before_flush(offset + source.frames_added, session.config)

                sender = asyncio.create_task(_send_all(ws, source, chunks, stats, failed, may_flush, woken))
                while True:
                    try:
                        message = await ws.recv()
                    except ConnectionClosed as exc:
                        if failed:
                            raise failed[0] from None
                        _raise_if_fatal(exc, session.id)
                        failures, last_error = failures + 1, exc
                        break
                    taken = _take(message, tracker, source, session, stats, base, client.return_tensors)
                    if isinstance(taken, Unit):
                        failures = 0
                        woken.set()
                        yield taken
                    elif taken is True:
                        return
                    elif taken is not None:
                        last_error = taken  # the server closes the stream after it; the close starts the reconnect
            finally:
                if sender is not None and not sender.done():
                    sender.cancel()
                    await asyncio.gather(sender, return_exceptions=True)
                await ws.close()


async def _send_all(ws: ClientConnection, source: ChunkSource, chunks: AsyncIterator[Any], stats: StreamStats,
                    failed: list[BaseException], may_flush, woken: asyncio.Event) -> None:
    """Resends first, then the caller's chunks, then the flush; a failing chunk iterator closes the stream after
    noting its error in ``failed``, which the receiving loop raises."""
    try:
        while True:
            payload = source.next_resend()
            if payload is None:
                if source.exhausted:
                    break
                try:
                    item = await chunks.__anext__()
                except StopAsyncIteration:
                    source.finish()
                    break
                payload = source.add(item)
                if payload is None:
                    continue
            await ws.send(payload)
            stats.frames_sent = source.frames_sent
        # The flush waits for the full blocks to come back (see frames_before_flush): a refused chunk is then known.
        while not may_flush():
            await woken.wait()
            woken.clear()
        await ws.send(FLUSH_MESSAGE)
    except ConnectionClosed:
        return
    except Exception as exc:
        failed.append(exc)
        await ws.close()


async def _aiter(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item
