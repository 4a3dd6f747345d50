"""The synchronous client: ``Client`` (the server) and ``Session`` (one session on it).

    from wm_refiner_client import Client

    with Client("http://127.0.0.1:8000") as client:          # api_key=... or WM_REFINER_API_KEY
        session = client.create_session(seed=42, block_size=3)
        for unit in session.stream(chunks, prompt=prompt):      # over the WebSocket, reconnecting by itself
            print(unit.frame_start, unit.frame_end, unit.latents.shape)

Threads: a ``Client`` may be shared by threads (httpx's pool is thread-safe); a ``Session`` counts its ``seq`` and
frames, so use each from one thread at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

import httpx
import numpy as np
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from ._common import (
    FATAL_CLOSE_CODES,
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
from .errors import (
    APIError,
    PayloadTooLargeCodeError,
    ProtocolError,
    ServiceUnavailableError,
    StreamClosedError,
    StreamInUseError,
    TransportError,
)
from .resume import ChunkSource, UnitTracker, frames_before_flush
from .retry import RetryPolicy
from .units import Array, ReturnTensors, Unit, concat, encode

log = logging.getLogger("wm_refiner_client")
OCTET = {"Content-Type": "application/octet-stream"}


class Client:
    """A wm-refiner server.

    ``base_url``: where it listens (default: the environment variable ``WM_REFINER_URL``, else
    http://127.0.0.1:8000). ``api_key``: sent as ``Authorization: Bearer``; default: the environment
    variable ``WM_REFINER_API_KEY``. ``timeout``: seconds for one HTTP request (a chunk's response waits for its
    blocks to be refined). ``retry``: how often and how long to retry what is safe to retry. ``return_tensors``:
    ``"np"`` (numpy arrays, default) or ``"pt"`` (torch tensors) for what comes back."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 120.0,
                 retry: RetryPolicy | None = None, return_tensors: ReturnTensors = "np"):
        if return_tensors not in ("np", "pt"):
            raise ValueError(f"return_tensors must be 'np' or 'pt', got {return_tensors!r}")
        self.base_url = resolve_url(base_url)
        self.api_key = resolve_api_key(api_key)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.return_tensors: ReturnTensors = return_tensors
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=auth_headers(self.api_key))

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the server --------------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """``GET /v1/info``: the model, the default session config, the limits (per request and per session)."""
        return self._request("GET", "/v1/info").json()

    def ready(self) -> bool:
        """Whether ``/ready`` answers 200 (model loaded and warmed up, not draining); never raises on a 503."""
        try:
            return self._http.get("/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def sessions(self, page_size: int = 100) -> list[SessionSummary]:
        """``GET /v1/sessions``: every live session, oldest first (all pages)."""
        found: list[SessionSummary] = []
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": page_size}
            if after is not None:
                params["after"] = after
            page = self._request("GET", "/v1/sessions", params=params).json()
            found.extend(SessionSummary.from_json(item) for item in page["sessions"])
            after = page.get("next")
            if after is None:
                return found

    # --- sessions ----------------------------------------------------------------------------------------------
    def create_session(self, **config: Any) -> Session:
        """``POST /v1/sessions``: a new session. ``config``: any of ``seed``, ``fps``, ``sink_frames``,
        ``block_size``, ``kv_max_frames``, ``sigmas``, ``positions``, ``outputs``, ``video_format``,
        ``video_lookahead``; unset fields take the server's defaults (``info()["default_session_config"]``)."""
        body = check_config(config)
        # Not idempotent: retried only when the request provably never arrived (or was refused with a 503).
        response = self._request("POST", "/v1/sessions", json=body, idempotent=False)
        data = response.json()
        return Session(self, data["session_id"], data["config"], next_seq=0)

    def session(self, id: str, **config: Any) -> Session:
        """``PUT /v1/sessions/{id}``: the session named ``id`` (``[A-Za-z0-9_-]{8,64}``), created with ``config``
        unless it already exists with the same config (a safe retry; another config is ``SessionExistsError``)."""
        body = check_config(config)
        response = self._request("PUT", session_path(check_session_id(id)), json=body)
        data = response.json()
        if response.status_code == 201:
            return Session(self, data["session_id"], data["config"], next_seq=0)
        return self.get_session(data["session_id"])

    def get_session(self, id: str) -> Session:
        """A handle on an existing session, continuing from where it stands (``SessionNotFoundError`` /
        ``SessionEvictedError`` otherwise)."""
        state = SessionState.from_json(self._request("GET", session_path(id)).json())
        return Session(self, state.session_id, state.config, next_seq=state.next_seq,
                       frames_returned=state.frames_returned, video_frames_returned=state.video_frames_returned)

    def delete_session(self, id: str) -> None:
        """``DELETE /v1/sessions/{id}``: end it and free its cache."""
        self._request("DELETE", session_path(id))

    # --- one shot ----------------------------------------------------------------------------------------------
    def refine(self, clip: Array, prompt: Array | None = None, prompt_mask: Array | None = None,
               **config: Any) -> Unit:
        """``POST /v1/refine``: the whole ``clip`` (B, C, T, H, W) refined in one call (T > sink_frames); the unit
        holds every frame, the sink frames included. ``config`` as for ``create_session`` (no ``sigmas``)."""
        payload = encode({"latents": clip, "prompt_embeds": prompt, "prompt_attention_mask": prompt_mask})
        response = self._request("POST", "/v1/refine", params=refine_query(config), content=payload, headers=OCTET)
        return Unit.from_payload(response.content, self.return_tensors)

    # --- plumbing ----------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, idempotent: bool = True, **kwargs: Any) -> httpx.Response:
        """The response, after retrying 503s (honouring Retry-After) and, when ``idempotent``, lost connections
        and timeouts; a typed ``APIError`` for any other error status."""
        failures = 0
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                failures += 1
                if not (idempotent or never_sent) or failures >= self.retry.attempts:
                    raise TransportError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
                wait = self.retry.delay(failures)
                log.info("%s %s: %s; retrying in %.2f s", method, path, type(exc).__name__, wait)
                time.sleep(wait)
                continue
            if response.status_code < 400:
                return response
            error = response_error(response.status_code, response.content, response.headers)
            failures += 1
            if not isinstance(error, ServiceUnavailableError) or failures >= self.retry.attempts:
                raise error
            wait = self.retry.delay(failures, error.retry_after)
            log.info("%s %s: %s; retrying in %.2f s", method, path, error.code, wait)
            time.sleep(wait)

    def _connect(self, path: str, query: Mapping[str, Any] | None = None) -> ClientConnection:
        """A WebSocket to ``path``; a refused handshake raises the typed error of its status and body."""
        url = ws_url(self.base_url, path, query)
        try:
            return connect(url, additional_headers=auth_headers(self.api_key), max_size=WS_MAX_SIZE,
                           compression=None, open_timeout=self.timeout)
        except InvalidStatus as exc:
            response = exc.response
            raise response_error(response.status_code, response.body or b"", response.headers) from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise TransportError(f"WebSocket {path}: {type(exc).__name__}: {exc}") from exc


class Session:
    """One session on a server: chunks over HTTP (``send``), a stream over the WebSocket (``stream``), its state,
    its watchers. Get one from ``Client.create_session``, ``Client.session(id=...)`` or ``Client.get_session``."""

    def __init__(self, client: Client, id: str, config: dict[str, Any], *, next_seq: int | None = None,
                 frames_returned: int = 0, video_frames_returned: int = 0):
        self.client = client
        self.id = id
        self.config = config
        self._next_seq = next_seq
        self._frames_returned = frames_returned
        self._video_frames_returned = video_frames_returned
        self._geometry: tuple[int, int, int, int] | None = None  # (B, C, H, W) of the latents sent

    def __repr__(self) -> str:
        return f"Session(id={self.id!r}, frames_returned={self._frames_returned})"

    @property
    def frames_returned(self) -> int:
        """Latent frames this handle has received (over HTTP and streams)."""
        return self._frames_returned

    # --- HTTP chunks -------------------------------------------------------------------------------------------
    def send(self, latents: Array, prompt: Array | None = None, prompt_mask: Array | None = None, *,
             flush: bool = False) -> Unit:
        """``POST /v1/sessions/{id}/chunks``: append ``latents`` (B, C, t, H, W) and get the frames they finalized
        (possibly none). The first chunk carries ``prompt`` (B, L, D) unless the server has a default prompt; a
        later one may switch it. ``flush``: also refine the pending frames as a final short block and end the
        stream. All or nothing: on an error the session is unchanged.

        Each chunk gets the next ``seq``; after a timeout, a lost connection or a 503 the same seq is sent again,
        so a chunk is never appended twice (a repeat returns the server's stored response, ``unit.replayed``)."""
        if self._next_seq is None:
            self._next_seq = self.state().next_seq
        seq = self._next_seq
        body = encode({"latents": latents, "prompt_embeds": prompt, "prompt_attention_mask": prompt_mask})
        response = self.client._request(
            "POST", session_path(self.id, "/chunks"), params={"seq": seq, "flush": str(flush).lower()},
            content=body, headers=OCTET,
        )
        unit = Unit.from_payload(response.content, self.client.return_tensors,
                                 replayed=response.headers.get("x-replayed") == "true")
        self._next_seq = seq + 1
        self._geometry = _geometry(latents)
        self._note(unit)
        return unit

    def flush(self) -> Unit:
        """End the stream: refine the pending frames as a final short block; the frames it finalized (all of them
        with their video's tail). Over HTTP when this handle sent a chunk (it knows the latents' shape), else over
        the WebSocket."""
        if self._geometry is not None:
            batch, channels, height, width = self._geometry
            return self.send(np.zeros((batch, channels, 0, height, width), np.float32), flush=True)
        units = list(self.stream(()))
        return _join(units, self._frames_returned, self._video_frames_returned)

    def _note(self, unit: Unit) -> None:
        self._frames_returned = max(self._frames_returned, unit.frame_end)
        if unit.video_frame_end is not None:
            self._video_frames_returned = max(self._video_frames_returned, unit.video_frame_end)

    # --- the WebSocket -----------------------------------------------------------------------------------------
    def stream(self, chunks: Iterable[Any], *, prompt: Array | None = None,
               prompt_mask: Array | None = None) -> Stream:
        """Stream ``chunks`` over the WebSocket and iterate over the refined units as they arrive; the stream is
        flushed once ``chunks`` is exhausted (so the last unit is the final short block).

        ``chunks``: latents arrays (B, C, t, H, W) in any split, or ``Chunk``/dicts carrying a prompt switch;
        ``prompt``/``prompt_mask`` go with the first chunk. A dropped connection, a server restart (close 1012)
        or a busy server is absorbed: the client reconnects with ``?resume_from=<frames received>``, resends from
        the server's ``frames_received``, and yields every frame exactly once, in order."""
        return Stream(self, chunks, prompt, prompt_mask)

    def watch(self, outputs: str | Iterable[str] | None = None) -> Iterator[Unit | BlockEvent | DroppedEvent]:
        """``WS /v1/sessions/{id}/watch``: every unit the session finalizes from now on (restricted to
        ``outputs``), a ``BlockEvent`` after each refined block, a ``DroppedEvent`` when this watcher fell behind;
        ends after the session's flush. Read-only: it neither slows nor keeps the session alive."""
        query = {} if outputs is None else {"outputs": outputs if isinstance(outputs, str) else ",".join(outputs)}
        ws = self.client._connect(session_path(self.id, "/watch"), query)
        with ws:
            while True:
                try:
                    message = ws.recv()
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

    # --- state -------------------------------------------------------------------------------------------------
    def state(self) -> SessionState:
        """``GET /v1/sessions/{id}``."""
        return SessionState.from_json(self.client._request("GET", session_path(self.id)).json())

    def delete(self) -> None:
        """``DELETE /v1/sessions/{id}``."""
        self.client.delete_session(self.id)


class Stream(Iterator[Unit]):
    """The units of one ``Session.stream(...)``, as they arrive; ``stats`` tells the progress (frames sent and
    refined, reconnects, the last block's latency). Closing it (or leaving a ``with`` block) stops the stream
    without flushing: the server keeps the session ``ws_reattach_grace_s`` for a later stream."""

    def __init__(self, session: Session, chunks: Iterable[Any], prompt: Array | None, prompt_mask: Array | None):
        self.session = session
        self.stats = StreamStats()
        self._units = self._run(iter(chunks), ChunkSource(prompt, prompt_mask))

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Unit:
        return next(self._units)

    def close(self) -> None:
        self._units.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self, chunks: Iterator[Any], source: ChunkSource) -> Iterator[Unit]:
        session, client, stats = self.session, self.session.client, self.stats
        tracker = UnitTracker(session._frames_returned, session._video_frames_returned)
        # Stream messages count as chunks (next_seq): the handle asks the server again before its next send.
        session._next_seq = None
        base: int | None = None  # the session's frame count when this stream's first frame was added
        failures, retry_after, last_error = 0, None, None
        while True:
            if failures:
                if failures >= client.retry.attempts:
                    raise TransportError(f"stream of session {session.id}: gave up after {failures} failed "
                                         f"attempts (last: {last_error})") from last_error
                time.sleep(client.retry.delay(failures, retry_after))
            retry_after = None
            try:
                ws = client._connect(session_path(session.id, "/stream"), {"resume_from": tracker.frames})
            except (ServiceUnavailableError, TransportError) as exc:
                failures, last_error = failures + 1, exc
                retry_after = getattr(exc, "retry_after", None)
                continue
            sender: _Sender | None = None
            try:
                try:
                    event = parse_event(_recv_text(ws))
                except TransportError as exc:  # closed before a word (a server going down): try again
                    failures, last_error = failures + 1, exc
                    continue
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
                    log.info("stream of session %s resumed at frame %d (server has %d)", session.id,
                             tracker.frames, event["frames_received"])
                source.rewind(event["frames_received"] - base)
                if event["flushed"] and not source.exhausted:
                    raise StreamClosedError(f"session {session.id} is flushed: it takes no more frames", status=409)
                offset = base

                def may_flush() -> bool:
                    target = frames_before_flush(offset + source.frames_added, session.config)
                    return event["flushed"] or tracker.frames >= target

                sender = _Sender(ws, source, chunks, stats, may_flush)
                sender.start()
                while True:
                    try:
                        message = ws.recv()
                    except ConnectionClosed as exc:
                        if sender.error is not None:
                            raise sender.error from None
                        _raise_if_fatal(exc, session.id)
                        failures, last_error = failures + 1, exc
                        break
                    taken = _take(message, tracker, source, session, stats, base, client.return_tensors)
                    if isinstance(taken, Unit):
                        failures = 0
                        sender.wake()
                        yield taken
                    elif taken is True:
                        return
                    elif taken is not None:
                        last_error = taken  # the server closes the stream after it; the close starts the reconnect
            finally:
                if sender is not None:
                    sender.stop()
                ws.close()
                if sender is not None:
                    sender.join()


class _Sender(threading.Thread):
    """Sends a stream's messages (resends first, then the caller's chunks, then the flush) while the caller's
    thread receives: reading and writing at once is what keeps a stream of large units from deadlocking."""

    def __init__(self, ws: ClientConnection, source: ChunkSource, chunks: Iterator[Any], stats: StreamStats,
                 may_flush: Callable[[], bool]):
        super().__init__(name="wm-refiner-stream-sender", daemon=True)
        self.ws, self.source, self.chunks, self.stats = ws, source, chunks, stats
        self.may_flush = may_flush
        self.error: BaseException | None = None
        self._stopped = threading.Event()
        self._woken = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        self._woken.set()

    def wake(self) -> None:
        """A unit arrived: the flush may be due."""
        self._woken.set()

    def run(self) -> None:
        try:
            while not self._stopped.is_set():
                payload = self.source.next_resend()
                if payload is None:
                    if self.source.exhausted:
                        break
                    try:
                        item = next(self.chunks)
                    except StopIteration:
                        self.source.finish()
                        break
                    payload = self.source.add(item)
                    if payload is None:
                        continue
                self.ws.send(payload)
                self.stats.frames_sent = self.source.frames_sent
            while not self._stopped.is_set() and not self.may_flush():
                self._woken.wait()
                self._woken.clear()
            if not self._stopped.is_set():
                self.ws.send(FLUSH_MESSAGE)
        except ConnectionClosed:
            pass  # the receiving side sees the close and reconnects
        except BaseException as exc:  # the caller's chunks raised, or a chunk is not an array: end the stream
            self.error = exc
            self.ws.close()


def _recv_text(ws: ClientConnection) -> str:
    try:
        message = ws.recv()
    except ConnectionClosed as exc:
        raise TransportError(f"the stream closed before the session event ({exc})") from exc
    if isinstance(message, bytes):
        raise ProtocolError("expected the session event, got a binary message")
    return message


def _take(message: str | bytes, tracker: UnitTracker, source: ChunkSource, session, stats: StreamStats, base: int,
          return_tensors: ReturnTensors) -> Unit | bool | APIError | None:
    """One message of a stream (sync and asyncio alike): a fresh unit to hand out (the books updated), True when
    the stream is done, a resumable error event, or None (nothing new). Other errors are raised."""
    if isinstance(message, bytes):
        fresh = tracker.accept(Unit.from_payload(message, return_tensors))
        if fresh is None:
            return None
        source.confirm(tracker.frames - base)
        session._note(fresh)
        stats.frames_refined, stats.video_frames = tracker.frames - base, tracker.video_frames
        stats.units += 1
        if fresh.latency_ms is not None:
            stats.last_latency_ms = fresh.latency_ms
        return fresh
    event = parse_event(message)
    if event["type"] == "done":
        if event.get("frames") != tracker.frames:
            raise ProtocolError(f"the server returned {event.get('frames')} frames in all but this stream received "
                                f"{tracker.frames}")
        return True
    if event["type"] == "error":
        error = event_error(event)
        if error.code not in RESUMABLE_EVENT_CODES:
            raise error
        return error
    return None


def _raise_if_fatal(exc: ConnectionClosed, session_id: str) -> None:
    code = exc.rcvd.code if exc.rcvd is not None else None
    if code not in FATAL_CLOSE_CODES:
        return
    reason = exc.rcvd.reason if exc.rcvd is not None else ""
    if code == 1009:
        raise PayloadTooLargeCodeError(f"session {session_id}: {reason or 'a message was over the size limit'}",
                                       status=413)
    raise StreamInUseError(f"session {session_id}: the stream was closed: {reason or 'policy violation'}", status=409)


def _geometry(latents: Array) -> tuple[int, int, int, int]:
    batch, channels, _, height, width = (int(n) for n in latents.shape)
    return batch, channels, height, width


def _join(units: list[Unit], frame_end: int, video_end: int) -> Unit:
    """Several consecutive units as one (a flush over the WebSocket may bring more than one)."""
    if not units:
        return Unit(frame_start=frame_end, frame_end=frame_end)
    with_latents = [u for u in units if u.latents is not None]
    with_video = [u for u in units if u.video is not None]
    video_starts = [u.video_frame_start for u in units if u.video_frame_start is not None]
    return Unit(
        frame_start=units[0].frame_start,
        frame_end=units[-1].frame_end,
        latents=concat(with_latents) if with_latents else None,
        video=concat(with_video, "video") if with_video else None,
        video_frame_start=video_starts[0] if video_starts else None,
        video_frame_end=video_end if video_starts else None,
    )

