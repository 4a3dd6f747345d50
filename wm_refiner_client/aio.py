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
    CLOSE_TIMEOUT_S,
    Answer,
    AnswerBody,
    WS_LOG,
    WATCH_SKIP,
    BlockEvent,
    DroppedEvent,
    MAX_JSON_ANSWER_BYTES,
    MessageLimit,
    SessionState,
    SessionSummary,
    StreamStats,
    auth_headers,
    check_config,
    check_session_id,
    json_answer,
    limit_needs_info,
    message_limit,
    refine_query,
    resolve_api_key,
    resolve_url,
    resumed_frames,
    session_path,
    unit_answer_limit,
    watch_message,
    watch_open_failed,
    watch_open_timeout,
    watch_query,
    ws_url,
)
from .client import (
    OCTET,
    Listing,
    Replicas,
    _close_code,
    _geometry,
    _join,
    _watched,
    handshake_error,
    session_state,
)
from .errors import APIError, TransportError
from .protocol import DONE_SENDING, NEED_CHUNK, WAIT, ChunkSeq, RequestAttempts, StreamProtocol, connect_failure
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
        self._replicas = Replicas()
        self._reached = False  # whether the server has answered this client once (protocol.RequestAttempts)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # --- the server --------------------------------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        """``GET /v1/info``."""
        return json_answer(await self._request("GET", "/v1/info"), "GET /v1/info")

    async def ready(self) -> bool:
        """Whether ``/ready`` answers 200; never raises on a 503."""
        try:
            async with self._http.stream("GET", "/ready") as response:  # the status alone: the body is never read
                return response.status_code == 200
        except httpx.HTTPError:
            return False

    async def sessions(self, page_size: int = 100) -> list[SessionSummary]:
        """``GET /v1/sessions``: every live session, oldest first (all pages). Behind a router with ``peers``,
        replicas that gave no listing are logged as a warning (their sessions are missing)."""
        listing = Listing()
        while not listing.add(await self._request("GET", "/v1/sessions", params=listing.params(page_size))):
            pass
        return listing.sessions

    # --- sessions ----------------------------------------------------------------------------------------------
    async def create_session(self, **config: Any) -> AsyncSession:
        """``POST /v1/sessions`` (see ``Client.create_session``)."""
        response = await self._request("POST", "/v1/sessions", json=check_config(config), idempotent=False)
        data = json_answer(response, "POST /v1/sessions", ("session_id", "config"))
        self._replicas.served(data["session_id"], response.headers.get("x-replica"))
        return AsyncSession(self, data["session_id"], data["config"], next_seq=0)

    async def session(self, id: str, **config: Any) -> AsyncSession:
        """``PUT /v1/sessions/{id}`` (see ``Client.session``)."""
        response = await self._request("PUT", session_path(check_session_id(id)), json=check_config(config),
                                       session_id=id)
        data = json_answer(response, f"PUT /v1/sessions/{id}", ("session_id", "config"))
        if response.status_code == 201:
            return AsyncSession(self, data["session_id"], data["config"], next_seq=0)
        return await self.get_session(data["session_id"])

    async def get_session(self, id: str, *, frames_returned: int | None = None) -> AsyncSession:
        """A handle on an existing session, continuing from where it stands (``frames_returned``: the refined
        frames the caller already holds; see ``Client.get_session``)."""
        state = session_state(await self._request("GET", session_path(id), session_id=id), id)
        return AsyncSession(self, state.session_id, state.config, next_seq=state.next_seq,
                            frames_returned=resumed_frames(state, frames_returned),
                            video_frames_returned=state.video_frames_returned if frames_returned is None else 0)

    async def delete_session(self, id: str) -> None:
        """``DELETE /v1/sessions/{id}``."""
        await self._request("DELETE", session_path(id), session_id=id)
        self._replicas.forget(id)

    async def refine(self, clip: Array, prompt: Array | None = None, prompt_mask: Array | None = None,
                     **config: Any) -> Unit:
        """``POST /v1/refine`` (see ``Client.refine``)."""
        payload = encode({"latents": clip, "prompt_embeds": prompt, "prompt_attention_mask": prompt_mask})
        response = await self._request("POST", "/v1/refine", params=refine_query(config), content=payload,
                                       headers=OCTET, limit=unit_answer_limit(clip.shape, config, whole_clip=True))
        return Unit.from_payload(response.content, self.return_tensors)

    # --- plumbing ----------------------------------------------------------------------------------------------
    async def _request(self, method: str, path: str, *, idempotent: bool = True, session_id: str | None = None,
                       limit: int | None = None, **kwargs: Any) -> Answer:
        """See ``Client._request``: the same decisions (``protocol.RequestAttempts``) and the same reading of the
        body (``AnswerBody``), awaited."""
        what = f"{method} {path}"
        attempts = RequestAttempts(self.retry, what, idempotent=idempotent,
                                   known_replica=self._replicas.get(session_id), first_contact=not self._reached,
                                   server=self.base_url)
        while True:
            try:
                async with self._http.stream(method, path, timeout=attempts.try_timeout(self.timeout),
                                             **kwargs) as streamed:
                    self._reached = True
                    body = AnswerBody(streamed, what, limit, attempts)
                    async for piece in streamed.aiter_bytes():
                        body.add(piece)
                response = body.answer()
            except httpx.TransportError as exc:
                wait = attempts.after_transport_error(exc, never_sent=isinstance(exc, (httpx.ConnectError,
                                                                                        httpx.ConnectTimeout)))
                log.info("%s", attempts.retry_note(wait), extra={"wait_s": wait})
                await asyncio.sleep(wait)
                continue
            wait = self._replicas.answer_or_wait(response, session_id, attempts)
            if wait is None:
                return response
            log.info("%s", attempts.retry_note(wait), extra={"wait_s": wait})
            await asyncio.sleep(wait)

    async def _message_limit(self, what: str, config: Mapping[str, Any],
                             geometry: tuple[int, int, int, int] | None, watch: bool = False) -> MessageLimit:
        """See ``Client._message_limit``."""
        info = await self.info() if limit_needs_info(config, geometry, watch) else None
        return message_limit(what, config, geometry, info)

    async def _connect(self, path: str, query: Mapping[str, Any] | None = None, limit: MessageLimit | None = None,
                       open_timeout: float | None = None) -> ClientConnection:
        """See ``Client._connect``."""
        url = ws_url(self.base_url, path, query)
        max_size = MAX_JSON_ANSWER_BYTES if limit is None else limit.max_size  # None: events only (see Client)
        try:
            ws = await connect(url, additional_headers=auth_headers(self.api_key), max_size=max_size,
                               compression=None, open_timeout=open_timeout or self.timeout,
                               close_timeout=CLOSE_TIMEOUT_S, logger=WS_LOG)
        except InvalidStatus as exc:
            self._reached = True  # the server answered (a refusal is an answer)
            raise handshake_error(exc) from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise connect_failure(f"WebSocket {path}", exc, self.base_url, not self._reached) from exc
        self._reached = True
        return ws


class AsyncSession:
    """One session, for asyncio (see ``Session``)."""

    def __init__(self, client: AsyncClient, id: str, config: dict[str, Any], *, next_seq: int | None = None,
                 frames_returned: int = 0, video_frames_returned: int = 0):
        self.client = client
        self.id = id
        self.config = config
        self._seq = ChunkSeq(next_seq)
        self._frames_returned = frames_returned
        self._video_frames_returned = video_frames_returned
        self._geometry: tuple[int, int, int, int] | None = None

    def __repr__(self) -> str:
        return f"AsyncSession(id={self.id!r}, frames_returned={self._frames_returned})"

    @property
    def frames_returned(self) -> int:
        return self._frames_returned

    @property
    def replica(self) -> str | None:
        """The replica that last served this session to this client (see ``Session.replica``)."""
        return self.client._replicas.get(self.id)

    async def send(self, latents: Array, prompt: Array | None = None, prompt_mask: Array | None = None, *,
                   flush: bool = False) -> Unit:
        """``POST /v1/sessions/{id}/chunks`` with automatic ``seq`` and idempotent retries (see ``Session.send``)."""
        if not self._seq.known:
            self._seq.learn((await self.state()).next_seq)
        seq = self._seq.take()
        body = encode({"latents": latents, "prompt_embeds": prompt, "prompt_attention_mask": prompt_mask})
        response = await self.client._request(
            "POST", session_path(self.id, "/chunks"), params={"seq": seq, "flush": str(flush).lower()},
            content=body, headers=OCTET, session_id=self.id, limit=unit_answer_limit(latents.shape, self.config),
        )
        unit = Unit.from_payload(response.content, self.client.return_tensors,
                                 replayed=response.headers.get("x-replayed") == "true")
        self._seq.accepted(seq)
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
               prompt_mask: Array | None = None, from_session_start: bool = False) -> AsyncStream:
        """Stream ``chunks`` over the WebSocket (see ``Session.stream``); ``async for`` over the units."""
        return AsyncStream(self, chunks, prompt, prompt_mask, from_session_start)

    def watch(self, outputs: str | Iterable[str] | None = None, *, video_format: str | None = None,
              video_quality: str | int | None = None, resume_from: int | None = None) -> AsyncWatch:
        """``WS /v1/sessions/{id}/watch`` (see ``Session.watch``; ``async for`` over it)."""
        return AsyncWatch(self, watch_query(outputs, video_format, video_quality, resume_from), video_format)

    async def state(self) -> SessionState:
        """``GET /v1/sessions/{id}``."""
        return session_state(await self.client._request("GET", session_path(self.id), session_id=self.id),
                             self.id)

    async def delete(self) -> None:
        await self.client.delete_session(self.id)


class AsyncWatch(AsyncIterator["Unit | BlockEvent | DroppedEvent"]):
    """The items of one ``AsyncSession.watch(...)`` (see ``Watch``: ``frames``, ``frame_end``); ``await
    watch.aclose()`` ends it."""

    def __init__(self, session: AsyncSession, query: dict[str, str], video_format: str | None):
        self.session = session
        self.frames: int | None = None
        self.frame_end: int | None = None
        self._items = self._run(query, video_format)

    def __aiter__(self) -> AsyncWatch:
        return self

    async def __anext__(self) -> Unit | BlockEvent | DroppedEvent:
        return await self._items.__anext__()

    async def aclose(self) -> None:
        await self._items.aclose()

    async def __aenter__(self) -> AsyncWatch:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _run(self, query: dict[str, str],
                   video_format: str | None) -> AsyncIterator[Unit | BlockEvent | DroppedEvent]:
        session, client = self.session, self.session.client
        what = f"watch of session {session.id}"
        limit = await client._message_limit(what, _watched(session.config, video_format), session._geometry,
                                            watch=True)
        deadline_s = client.retry.deadline_s
        try:
            ws = await client._connect(session_path(session.id, "/watch"), query, limit,
                                       watch_open_timeout(client.timeout, deadline_s))
        except TransportError as exc:
            raise watch_open_failed(exc, what, client.timeout, deadline_s) from exc.__cause__
        async with ws:
            while True:
                try:
                    message = await ws.recv()
                except ConnectionClosed as exc:
                    raise limit.too_big(exc) or TransportError(
                        f"the watch of session {session.id} ended before the session's flush ({exc})",
                        close_code=_close_code(exc)[0]) from exc
                item = watch_message(self, limit, message, client.return_tensors)
                if item is None:
                    return
                if item is not WATCH_SKIP:
                    yield item


class AsyncStream(AsyncIterator[Unit]):
    """The units of one ``AsyncSession.stream(...)`` (see ``Stream``); ``await stream.aclose()`` stops it."""

    def __init__(self, session: AsyncSession, chunks: Iterable[Any] | AsyncIterable[Any], prompt: Array | None,
                 prompt_mask: Array | None, from_session_start: bool = False):
        self.session = session
        self.stats = StreamStats()
        self._protocol = StreamProtocol(
            session.id, session.config, session.client.retry, prompt=prompt, prompt_mask=prompt_mask,
            frames_returned=session._frames_returned, video_frames_returned=session._video_frames_returned,
            known_replica=session.replica, return_tensors=session.client.return_tensors, on_unit=session._note,
            stats=self.stats, from_session_start=from_session_start, geometry=session._geometry,
        )
        chunk_iterator = chunks.__aiter__() if hasattr(chunks, "__aiter__") else _aiter(chunks)
        self._units = self._run(_AsyncFeed(chunk_iterator))

    @property
    def replica(self) -> str | None:
        """The replica serving this stream (``X-Replica`` of the last connection's handshake)."""
        return self._protocol.replica

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

    async def _run(self, feed: _AsyncFeed) -> AsyncIterator[Unit]:
        """The I/O of ``StreamProtocol`` (see ``Stream._run``): a connection at a time, a sender task beside this
        receiving generator."""
        session, client, protocol = self.session, self.session.client, self._protocol
        session._seq.forget()
        try:
            while True:
                if protocol.reads_first_chunk():  # the size of what may come back follows from the first chunk's
                    protocol.expect(await feed.peek())
                wait = protocol.wait_before_connect()
                if wait:
                    log.info("%s", protocol.reconnect_note(wait), extra={"wait_s": wait})
                await asyncio.sleep(wait)
                limit = await client._message_limit(protocol.what, protocol.config, protocol.geometry)
                opening = protocol.connect_timeout(client.timeout)  # raises once the deadline passed: not a refusal
                try:
                    ws = await client._connect(session_path(session.id, "/stream"), protocol.query(), limit, opening)
                except (APIError, TransportError) as exc:
                    protocol.refused(exc, getattr(exc, "replica", None))
                    continue
                sender: asyncio.Task | None = None
                try:
                    try:
                        waited = protocol.connect_timeout(client.timeout)
                        first = await asyncio.wait_for(ws.recv(), waited)
                    except ConnectionClosed as exc:
                        too_big = limit.too_big(exc)
                        if too_big is not None:
                            raise too_big from None
                        protocol.failed(TransportError(f"the stream closed before the session event ({exc})"))
                        continue
                    except asyncio.TimeoutError:  # see Stream._run: a server silent after the handshake is stuck
                        protocol.failed(TransportError(f"no session event within {waited:g} s of connecting"))
                        continue
                    limit.check(first)
                    if not protocol.opened(first, ws.response.headers.get("x-replica") if ws.response else None):
                        continue
                    client._replicas.served(session.id, protocol.replica)
                    failed: list[BaseException] = []
                    woken = asyncio.Event()
                    sender = asyncio.create_task(_send_all(ws, protocol, feed, failed, woken))
                    while True:
                        try:
                            message = await ws.recv()
                        except ConnectionClosed as exc:
                            if failed:
                                raise failed[0] from None
                            too_big = limit.too_big(exc)
                            if too_big is not None:
                                raise too_big from None
                            protocol.lost(*_close_code(exc), exc)
                            break
                        limit.check(message)
                        taken = protocol.received(message)
                        if taken is True:
                            return
                        if taken is not None:
                            woken.set()
                            yield taken
                finally:
                    if sender is not None and not sender.done():
                        sender.cancel()  # it never runs the caller's code (see _AsyncFeed): nothing of theirs is hit
                        await asyncio.gather(sender, return_exceptions=True)
                    await ws.close()
        finally:
            await feed.aclose()


class _AsyncFeed:
    """The caller's chunks, one ``__anext__`` at a time in a task of its own that outlives a connection: a sender
    awaits it shielded, so a reconnect that cancels the sender never throws ``CancelledError`` into the caller's
    async generator (which would end it, and the stream would take the clip as complete); the next connection's
    sender awaits the same pending chunk."""

    def __init__(self, chunks: AsyncIterator[Any]):
        self._chunks = chunks
        self._next: asyncio.Future | None = None

    async def take(self) -> tuple[str, Any]:
        """("item", chunk) or ("end", None); the caller's own exception is raised."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._chunks.__anext__())
        try:
            item = await asyncio.shield(self._next)
        except StopAsyncIteration:
            self._next = None
            return ("end", None)
        except asyncio.CancelledError:
            if self._next.done() and self._next.cancelled():
                self._next = None  # the chunk's own task was cancelled (the caller's code), not this sender
            raise
        except BaseException:
            self._next = None
            raise
        self._next = None
        return ("item", item)

    async def peek(self) -> Any:
        """The caller's next chunk, read (awaiting it) but left for ``take``; None when there is none (the chunks are
        exhausted, or their iterator raised: ``take`` raises that)."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._chunks.__anext__())
        try:
            return await asyncio.shield(self._next)
        except asyncio.CancelledError:
            if self._next.done() and self._next.cancelled():
                self._next = None
            raise
        except BaseException:  # StopAsyncIteration, the caller's error: ``take`` meets it again
            return None

    async def aclose(self) -> None:
        """The stream is over: a chunk still being read is not wanted any more."""
        if self._next is not None and not self._next.done():
            self._next.cancel()
            await asyncio.gather(self._next, return_exceptions=True)
        self._next = None


async def _send_all(ws: ClientConnection, protocol: StreamProtocol, feed: _AsyncFeed, failed: list[BaseException],
                    woken: asyncio.Event) -> None:
    """Sends what ``StreamProtocol.next_message`` says; a failing chunk iterator closes the stream after noting its
    error in ``failed``, which the receiving loop raises."""
    try:
        while True:
            message = protocol.next_message()
            if message == NEED_CHUNK:
                kind, item = await feed.take()
                if kind == "end":
                    protocol.finish()
                    continue
                message = protocol.add(item)
                if message is None:
                    continue
            elif message == WAIT:
                await woken.wait()
                woken.clear()
                continue
            elif message == DONE_SENDING:
                return
            await ws.send(message)
    except ConnectionClosed:
        return
    except Exception as exc:
        failed.append(exc)
        await ws.close()


async def _aiter(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item
