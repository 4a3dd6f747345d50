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
from typing import Any, Iterable, Iterator, Mapping

import httpx
import numpy as np
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect

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
    from_answer,
    json_answer,
    limit_needs_info,
    message_limit,
    redirect_error,
    refine_query,
    resolve_api_key,
    resolve_url,
    response_error,
    resumed_frames,
    session_path,
    unit_answer_limit,
    warn_unreachable,
    watch_message,
    watch_open_failed,
    watch_open_timeout,
    watch_query,
    ws_url,
)
from .errors import APIError, ProtocolError, SessionNotFoundError, TransportError
from .protocol import DONE_SENDING, NEED_CHUNK, WAIT, ChunkSeq, RequestAttempts, StreamProtocol, connect_failure
from .retry import RetryPolicy
from .units import Array, EncodedVideo, ReturnTensors, Unit, concat, encode

log = logging.getLogger("wm_refiner_client")
OCTET = {"Content-Type": "application/octet-stream"}
# Sessions whose replica a client remembers (for telling a move from a missing session): enough for any one
# program's live sessions; the oldest are forgotten first.
REMEMBERED_REPLICAS = 4096


class Replicas:
    """Which replica (``X-Replica``) last served each session to this client."""

    def __init__(self) -> None:
        self._by_session: dict[str, str] = {}
        self._lock = threading.Lock()

    def get(self, session_id: str | None) -> str | None:
        return self._by_session.get(session_id) if session_id is not None else None

    def served(self, session_id: str, replica: str | None) -> None:
        if not replica:
            return
        with self._lock:
            self._by_session.pop(session_id, None)
            self._by_session[session_id] = replica
            while len(self._by_session) > REMEMBERED_REPLICAS:
                self._by_session.pop(next(iter(self._by_session)))

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._by_session.pop(session_id, None)

    def answer_or_wait(self, response, session_id: str | None, attempts: RequestAttempts) -> float | None:
        """What an HTTP response means for its request (the sync and the asyncio client alike): None for a success
        (its replica remembered for the session); else the seconds to wait before trying again, or the typed error
        raised when it is final (a 404 that ends the retries also forgets the session's replica)."""
        replica = response.headers.get("x-replica")
        if 300 <= response.status_code < 400:
            raise redirect_error(response, attempts.what)
        if response.status_code < 400:
            if session_id is not None:
                self.served(session_id, replica)
            return None
        error = response_error(response.status_code, response.content, response.headers)
        error.replica = replica
        try:
            return attempts.after_error(error, replica)
        except SessionNotFoundError:
            if session_id is not None:
                self.forget(session_id)
            raise


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
        self._replicas = Replicas()
        self._reached = False  # whether the server has answered this client once (protocol.RequestAttempts)

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
        return json_answer(self._request("GET", "/v1/info"), "GET /v1/info")

    def ready(self) -> bool:
        """Whether ``/ready`` answers 200 (model loaded and warmed up, not draining); never raises on a 503."""
        try:
            with self._http.stream("GET", "/ready") as response:  # the status alone: the body is never read
                return response.status_code == 200
        except httpx.HTTPError:
            return False

    def sessions(self, page_size: int = 100) -> list[SessionSummary]:
        """``GET /v1/sessions``: every live session, oldest first (all pages). Behind a router with ``peers``,
        replicas that gave no listing are logged as a warning (their sessions are missing)."""
        listing = Listing()
        while not listing.add(self._request("GET", "/v1/sessions", params=listing.params(page_size))):
            pass
        return listing.sessions

    # --- sessions ----------------------------------------------------------------------------------------------
    def create_session(self, **config: Any) -> Session:
        """``POST /v1/sessions``: a new session. ``config``: any of the session fields (``spec.FIELDS``: ``seed``,
        ``fps``, ``sink_frames``, ``block_size``, ``kv_max_frames``, ``sigmas``, ``positions``, ``outputs``,
        ``video_format``, ``video_quality``, ``video_lookahead``, ``realtime``); unset fields take the server's
        defaults (``info()["default_session_config"]``)."""
        body = check_config(config)
        # Not idempotent: retried only when the request provably never arrived (or was refused with a 503).
        response = self._request("POST", "/v1/sessions", json=body, idempotent=False)
        data = json_answer(response, "POST /v1/sessions", ("session_id", "config"))
        self._replicas.served(data["session_id"], response.headers.get("x-replica"))
        return Session(self, data["session_id"], data["config"], next_seq=0)

    def session(self, id: str, **config: Any) -> Session:
        """``PUT /v1/sessions/{id}``: the session named ``id`` (``[A-Za-z0-9_-]{8,64}``), created with ``config``
        unless it already exists with the same config (a safe retry; another config is ``SessionExistsError``)."""
        body = check_config(config)
        response = self._request("PUT", session_path(check_session_id(id)), json=body, session_id=id)
        data = json_answer(response, f"PUT /v1/sessions/{id}", ("session_id", "config"))
        if response.status_code == 201:
            return Session(self, data["session_id"], data["config"], next_seq=0)
        return self.get_session(data["session_id"])

    def get_session(self, id: str, *, frames_returned: int | None = None) -> Session:
        """A handle on an existing session, continuing from where it stands (``SessionNotFoundError`` /
        ``SessionEvictedError`` otherwise).

        ``frames_returned``: the refined frames the caller already holds (a program that stopped mid-stream: the
        last ``frame_end`` it kept). Its ``stream(..., from_session_start=True)`` then gets the server's units again
        from that frame (as far as the server still retains them). Without it the handle starts at the server's
        ``frames_returned``, which counts units sent to a connection that was gone: those are not sent again."""
        state = session_state(self._request("GET", session_path(id), session_id=id), id)
        return Session(self, state.session_id, state.config, next_seq=state.next_seq,
                       frames_returned=resumed_frames(state, frames_returned),
                       video_frames_returned=state.video_frames_returned if frames_returned is None else 0)

    def delete_session(self, id: str) -> None:
        """``DELETE /v1/sessions/{id}``: end it and free its cache."""
        self._request("DELETE", session_path(id), session_id=id)
        self._replicas.forget(id)  # a later 404 of this id is final

    # --- one shot ----------------------------------------------------------------------------------------------
    def refine(self, clip: Array, prompt: Array | None = None, prompt_mask: Array | None = None,
               **config: Any) -> Unit:
        """``POST /v1/refine``: the whole ``clip`` (B, C, T, H, W) refined in one call (T > sink_frames); the unit
        holds every frame, the sink frames included. ``config`` as for ``create_session`` (no ``sigmas``)."""
        payload = encode({"latents": clip, "prompt_embeds": prompt, "prompt_attention_mask": prompt_mask})
        response = self._request("POST", "/v1/refine", params=refine_query(config), content=payload, headers=OCTET,
                                 limit=unit_answer_limit(clip.shape, config, whole_clip=True))
        return Unit.from_payload(response.content, self.return_tensors)

    # --- plumbing ----------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, idempotent: bool = True, session_id: str | None = None,
                 limit: int | None = None, **kwargs: Any) -> Answer:
        """The answer, after the retries ``protocol.RequestAttempts`` decides (503s after Retry-After; when
        ``idempotent``, lost connections, timeouts and a router's 502/504; a 404 of ``session_id`` while it moves
        between replicas, for at most ``retry.move_timeout_s``; all within ``retry.deadline_s``); a typed
        ``APIError`` for any other error status. The body is read as it streams in, up to ``limit`` bytes for a
        successful binary answer, 16 MiB for any other (``AnswerBody``)."""
        what = f"{method} {path}"
        attempts = RequestAttempts(self.retry, what, idempotent=idempotent,
                                   known_replica=self._replicas.get(session_id), first_contact=not self._reached,
                                   server=self.base_url)
        while True:
            try:
                with self._http.stream(method, path, timeout=attempts.try_timeout(self.timeout), **kwargs) as streamed:
                    self._reached = True
                    body = AnswerBody(streamed, what, limit, attempts)
                    for piece in streamed.iter_bytes():
                        body.add(piece)
                response = body.answer()
            except httpx.TransportError as exc:
                wait = attempts.after_transport_error(exc, never_sent=isinstance(exc, (httpx.ConnectError,
                                                                                        httpx.ConnectTimeout)))
                log.info("%s", attempts.retry_note(wait), extra={"wait_s": wait})
                time.sleep(wait)
                continue
            wait = self._replicas.answer_or_wait(response, session_id, attempts)
            if wait is None:
                return response
            log.info("%s", attempts.retry_note(wait), extra={"wait_s": wait})
            time.sleep(wait)

    def _message_limit(self, what: str, config: Mapping[str, Any],
                       geometry: tuple[int, int, int, int] | None, watch: bool = False) -> MessageLimit:
        """What a WebSocket of a session of ``config`` may receive (``MessageLimit``); its latents' ``geometry``
        (B, C, H, W), when this client has not seen it, the widest the server allows (``GET /v1/info``; a ``watch``
        reads it for the VAE's figures too when its units may hold pixels: ``limit_needs_info``)."""
        info = self.info() if limit_needs_info(config, geometry, watch) else None
        return message_limit(what, config, geometry, info)

    def _connect(self, path: str, query: Mapping[str, Any] | None = None, limit: MessageLimit | None = None,
                 open_timeout: float | None = None) -> ClientConnection:
        """A WebSocket to ``path`` that receives no message over ``limit.max_size`` (websockets then closes it with
        1009: ``limit.too_big``); a refused handshake raises the typed error of its status and body."""
        url = ws_url(self.base_url, path, query)
        max_size = MAX_JSON_ANSWER_BYTES if limit is None else limit.max_size  # None: events only
        try:
            ws = connect(url, additional_headers=auth_headers(self.api_key), max_size=max_size,
                         compression=None, open_timeout=open_timeout or self.timeout,
                         close_timeout=CLOSE_TIMEOUT_S, logger=WS_LOG)
        except InvalidStatus as exc:
            self._reached = True  # the server answered (a refusal is an answer)
            raise handshake_error(exc) from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise connect_failure(f"WebSocket {path}", exc, self.base_url, not self._reached) from exc
        self._reached = True
        return ws


def session_state(response: Answer, session_id: str) -> SessionState:
    """``GET /v1/sessions/{id}``'s answer; ``ProtocolError`` for one that is not a session's state."""
    what = f"GET /v1/sessions/{session_id}"
    return from_answer(SessionState, json_answer(response, what), what)


class Listing:
    """``GET /v1/sessions`` page by page (both clients): the sessions so far, the replicas that gave no listing
    (behind a router with ``peers``), the cursors followed. ``ProtocolError`` for a page that is not a listing, or a
    cursor given before (a server whose pages cycle would keep the client paging, its list growing, for ever)."""

    def __init__(self) -> None:
        self.sessions: list[SessionSummary] = []
        self.unreachable: list[str] = []
        self.seen: set[str] = set()
        self.after: str | None = None  # the next page's cursor

    def params(self, page_size: int) -> dict[str, Any]:
        return {"limit": page_size} if self.after is None else {"limit": page_size, "after": self.after}

    def add(self, response: Answer) -> bool:
        """One page's answer; True once it was the last (the replicas missing from the listing are then logged)."""
        page = json_answer(response, "GET /v1/sessions", ("sessions",))
        items = page["sessions"]
        if not isinstance(items, list):
            raise ProtocolError(f"GET /v1/sessions: 'sessions' is a {type(items).__name__}, not a list")
        self.sessions.extend(from_answer(SessionSummary, item, "GET /v1/sessions") for item in items)
        self.unreachable.extend(page.get("unreachable") or ())
        after = page.get("next")
        if after is None:
            warn_unreachable(self.unreachable)  # replicas whose sessions are missing: said, not silently left out
            return True
        if not isinstance(after, str) or after in self.seen:
            raise ProtocolError(f"GET /v1/sessions: the server's next page cursor {str(after)[:80]!r} "
                                + ("was given before: its pages cycle" if after in self.seen else "is not a string"))
        self.seen.add(after)
        self.after = after
        return False


def handshake_error(exc: InvalidStatus) -> APIError:
    """The typed error of a refused WebSocket handshake, naming the replica that refused it."""
    response = exc.response
    error = response_error(response.status_code, response.body or b"", response.headers)
    error.replica = response.headers.get("x-replica")
    return error


class Session:
    """One session on a server: chunks over HTTP (``send``), a stream over the WebSocket (``stream``), its state,
    its watchers. Get one from ``Client.create_session``, ``Client.session(id=...)`` or ``Client.get_session``."""

    def __init__(self, client: Client, id: str, config: dict[str, Any], *, next_seq: int | None = None,
                 frames_returned: int = 0, video_frames_returned: int = 0):
        self.client = client
        self.id = id
        self.config = config
        self._seq = ChunkSeq(next_seq)
        self._frames_returned = frames_returned
        self._video_frames_returned = video_frames_returned
        self._geometry: tuple[int, int, int, int] | None = None  # (B, C, H, W) of the latents sent

    def __repr__(self) -> str:
        return f"Session(id={self.id!r}, frames_returned={self._frames_returned})"

    @property
    def frames_returned(self) -> int:
        """Latent frames this handle has received (over HTTP and streams)."""
        return self._frames_returned

    @property
    def replica(self) -> str | None:
        """The replica that last served this session to this client (its ``X-Replica`` header; behind a router,
        which replica holds the session), None before any answer named one."""
        return self.client._replicas.get(self.id)

    # --- HTTP chunks -------------------------------------------------------------------------------------------
    def send(self, latents: Array, prompt: Array | None = None, prompt_mask: Array | None = None, *,
             flush: bool = False) -> Unit:
        """``POST /v1/sessions/{id}/chunks``: append ``latents`` (B, C, t, H, W) and get the frames they finalized
        (possibly none). The first chunk carries ``prompt`` (B, L, D) unless the server has a default prompt; a
        later one may switch it. ``flush``: also refine the pending frames as a final short block and end the
        stream. All or nothing: on an error the session is unchanged.

        Each chunk gets the next ``seq``; after a timeout, a lost connection or a 503 the same seq is sent again,
        so a chunk is never appended twice (a repeat returns the server's stored response, ``unit.replayed``)."""
        if not self._seq.known:
            self._seq.learn(self.state().next_seq)
        seq = self._seq.take()
        body = encode({"latents": latents, "prompt_embeds": prompt, "prompt_attention_mask": prompt_mask})
        response = self.client._request(
            "POST", session_path(self.id, "/chunks"), params={"seq": seq, "flush": str(flush).lower()},
            content=body, headers=OCTET, session_id=self.id, limit=unit_answer_limit(latents.shape, self.config),
        )
        unit = Unit.from_payload(response.content, self.client.return_tensors,
                                 replayed=response.headers.get("x-replayed") == "true")
        self._seq.accepted(seq)
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
    def stream(self, chunks: Iterable[Any], *, prompt: Array | None = None, prompt_mask: Array | None = None,
               from_session_start: bool = False) -> Stream:
        """Stream ``chunks`` over the WebSocket and iterate over the refined units as they arrive; the stream is
        flushed once ``chunks`` is exhausted (so the last unit is the final short block).

        ``chunks``: latents arrays (B, C, t, H, W) in any split, or ``Chunk``/dicts carrying a prompt switch;
        ``prompt``/``prompt_mask`` go with the first chunk. A dropped connection, a server restart (close 1012)
        or a busy server is absorbed: the client reconnects with ``?resume_from=<frames received>``, resends from
        the server's ``frames_received``, and yields every frame exactly once, in order.

        ``from_session_start``: ``chunks`` are the session's input from its frame 0 (the same clip again, to
        continue an interrupted run): the frames the server already has are skipped, the rest sent. Units start
        after the frames this handle has (``frames_returned``; a handle made with ``frames_returned=K`` gets the
        server's units again from frame K, as far as it still holds them)."""
        return Stream(self, chunks, prompt, prompt_mask, from_session_start)

    def watch(self, outputs: str | Iterable[str] | None = None, *, video_format: str | None = None,
              video_quality: str | int | None = None, resume_from: int | None = None) -> Watch:
        """``WS /v1/sessions/{id}/watch``: every unit the session finalizes from now on (restricted to
        ``outputs``), a ``BlockEvent`` after each refined block, a ``DroppedEvent`` when this watcher fell behind;
        ends after the session's flush. Read-only: it neither slows nor keeps the session alive. ``video_format``,
        ``video_quality``: another encoding of the session's video than its own (``jpeg``, ``h264``, ...).
        ``resume_from``: the latent frames this watcher already has (a previous watch's ``frame_end``): the server
        first sends again the units it kept from there (a unit straddling it whole), then live ones; an
        ``APIError`` ``resume_unavailable`` (409) names the first frame it can still send when the ones from
        ``resume_from`` are no longer kept. What it cannot have seen otherwise (units finalized before it joined,
        or while it was away): ``Watch``."""
        return Watch(self, watch_query(outputs, video_format, video_quality, resume_from), video_format)

    # --- state -------------------------------------------------------------------------------------------------
    def state(self) -> SessionState:
        """``GET /v1/sessions/{id}``."""
        return session_state(self.client._request("GET", session_path(self.id), session_id=self.id), self.id)

    def delete(self) -> None:
        """``DELETE /v1/sessions/{id}``."""
        self.client.delete_session(self.id)


class Watch(Iterator["Unit | BlockEvent | DroppedEvent"]):
    """The items of one ``Session.watch(...)`` as they arrive: ``Unit``, ``BlockEvent``, ``DroppedEvent``; it ends
    after the session's flush. Closing it (or leaving a ``with`` block) ends the watch.

    A watch gets the units the session finalizes while it is attached, and, opened with ``resume_from=N``, first the
    units the session kept (its last ``ws_resume_units``) holding frames from N on. It does not reconnect by itself (a
    restart of the session's replica ends it with a ``TransportError`` whose ``close_code`` is 1012 or 1001):
    watch again with ``resume_from=frame_end`` (``python -m app watch`` does) to lose nothing the server still
    keeps. What it missed is said, not hidden: units dropped because it fell behind by a
    ``DroppedEvent``, and at the end ``frames``, the frames the session returned in all (the ``done`` event's; None
    until then), against ``frame_end``, where the last unit it received ends (None before one): frames
    ``[frame_end, frames)`` were finalized while it could not get them. A caller that watches again after a
    failure without ``resume_from`` learns the frames finalized meanwhile from ``state().frames_returned``: the new
    watch's units start there or later."""

    def __init__(self, session: Session, query: dict[str, str], video_format: str | None):
        self.session = session
        self.frames: int | None = None
        self.frame_end: int | None = None
        self._items = self._run(query, video_format)

    def __iter__(self) -> Watch:
        return self

    def __next__(self) -> Unit | BlockEvent | DroppedEvent:
        return next(self._items)

    def close(self) -> None:
        self._items.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self, query: dict[str, str], video_format: str | None) -> Iterator[Unit | BlockEvent | DroppedEvent]:
        session, client = self.session, self.session.client
        what = f"watch of session {session.id}"
        limit = client._message_limit(what, _watched(session.config, video_format), session._geometry,
                                      watch=True)
        deadline_s = client.retry.deadline_s
        try:
            ws = client._connect(session_path(session.id, "/watch"), query, limit,
                                 watch_open_timeout(client.timeout, deadline_s))
        except TransportError as exc:
            raise watch_open_failed(exc, what, client.timeout, deadline_s) from exc.__cause__
        with ws:
            while True:
                try:
                    message = ws.recv()
                except ConnectionClosed as exc:
                    raise limit.too_big(exc) or TransportError(
                        f"the watch of session {session.id} ended before the session's flush ({exc})",
                        close_code=_close_code(exc)[0]) from exc
                item = watch_message(self, limit, message, client.return_tensors)
                if item is None:
                    return
                if item is not WATCH_SKIP:
                    yield item


class Stream(Iterator[Unit]):
    """The units of one ``Session.stream(...)``, as they arrive; ``stats`` tells the progress (frames sent and
    refined, reconnects, the last block's latency), ``replica`` which replica serves it. Closing it (or leaving a
    ``with`` block) stops the stream without flushing: the server keeps the session ``ws_reattach_grace_s`` for a
    later stream."""

    def __init__(self, session: Session, chunks: Iterable[Any], prompt: Array | None, prompt_mask: Array | None,
                 from_session_start: bool = False):
        self.session = session
        self.stats = StreamStats()
        self._protocol = StreamProtocol(
            session.id, session.config, session.client.retry, prompt=prompt, prompt_mask=prompt_mask,
            frames_returned=session._frames_returned, video_frames_returned=session._video_frames_returned,
            known_replica=session.replica, return_tensors=session.client.return_tensors, on_unit=session._note,
            stats=self.stats, from_session_start=from_session_start, geometry=session._geometry,
        )
        self._units = self._run(_Feed(iter(chunks)))

    @property
    def replica(self) -> str | None:
        """The replica serving this stream (``X-Replica`` of the last connection's handshake)."""
        return self._protocol.replica

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

    def _run(self, feed: _Feed) -> Iterator[Unit]:
        """The I/O of ``StreamProtocol`` (which decides everything): a connection at a time, a sender thread
        beside this receiving generator."""
        session, client, protocol = self.session, self.session.client, self._protocol
        session._seq.forget()  # stream messages count as chunks: the handle asks the server before its next send
        while True:
            if protocol.reads_first_chunk():  # the size of what may come back follows from the first chunk's
                protocol.expect(feed.peek())
            wait = protocol.wait_before_connect()
            if wait:
                log.info("%s", protocol.reconnect_note(wait), extra={"wait_s": wait})
            time.sleep(wait)
            limit = client._message_limit(protocol.what, protocol.config, protocol.geometry)
            opening = protocol.connect_timeout(client.timeout)  # raises once the deadline passed: not a refusal
            try:
                ws = client._connect(session_path(session.id, "/stream"), protocol.query(), limit, opening)
            except (APIError, TransportError) as exc:
                protocol.refused(exc, getattr(exc, "replica", None))
                continue
            sender: _Sender | None = None
            try:
                waited = protocol.connect_timeout(client.timeout)
                try:
                    first = ws.recv(timeout=waited)
                except ConnectionClosed as exc:  # closed before a word (a server going down): try again
                    too_big = limit.too_big(exc)
                    if too_big is not None:
                        raise too_big from None
                    protocol.failed(TransportError(f"the stream closed before the session event ({exc})"))
                    continue
                except TimeoutError:  # the server sends it at once: one that stays silent is stuck, try again
                    protocol.failed(TransportError(f"no session event within {waited:g} s of connecting"))
                    continue
                limit.check(first)
                if not protocol.opened(first, ws.response.headers.get("x-replica") if ws.response else None):
                    continue
                client._replicas.served(session.id, protocol.replica)
                sender = _Sender(ws, protocol, feed)
                sender.start()
                while True:
                    try:
                        message = ws.recv()
                    except ConnectionClosed as exc:
                        if sender.error is not None:
                            raise sender.error from None
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
                        sender.wake()
                        yield taken
            finally:
                if sender is not None:
                    sender.stop()
                ws.close()
                if sender is not None:
                    sender.join()


class _Feed:
    """The caller's chunks, read on a thread of their own, one when a sender asks for it. A sender waits here, never
    inside the caller's code, so a reconnect stops it at once even while the caller's source blocks (a live
    generator waiting for its next frames); the chunk being read goes to the next connection's sender. A thread
    blocked in the caller's source when the stream ends is left to finish on its own (daemon)."""

    def __init__(self, chunks: Iterator[Any]):
        self._chunks = chunks
        self._cond = threading.Condition()
        self._reading = False
        self._result: tuple[str, Any] | None = None  # ("item", chunk), ("end", None) or ("error", exception)

    def take(self, stopped: threading.Event) -> tuple[str, Any] | None:
        """The next of the caller's chunks, or None once ``stopped`` is set (see ``interrupt``)."""
        with self._cond:
            if self._result is None and not self._reading:
                self._reading = True
                threading.Thread(target=self._read, name="wm-refiner-stream-feed", daemon=True).start()
            while self._result is None:
                if stopped.is_set():
                    return None
                self._cond.wait()
            result, self._result = self._result, None
            return result

    def peek(self) -> Any:
        """The caller's next chunk, read (waiting for it) but left for ``take``; None when there is none (the chunks
        are exhausted, or their iterator raised: ``take`` hands that on)."""
        with self._cond:
            if self._result is None and not self._reading:
                self._reading = True
                threading.Thread(target=self._read, name="wm-refiner-stream-feed", daemon=True).start()
            while self._result is None:
                self._cond.wait()
            kind, item = self._result
            return item if kind == "item" else None

    def interrupt(self) -> None:
        """Wake a ``take`` whose ``stopped`` was just set."""
        with self._cond:
            self._cond.notify_all()

    def _read(self) -> None:
        try:
            result: tuple[str, Any] = ("item", next(self._chunks))
        except StopIteration:
            result = ("end", None)
        except BaseException as exc:  # the caller's source failed: the stream ends with its error
            result = ("error", exc)
        with self._cond:
            self._result, self._reading = result, False
            self._cond.notify_all()


class _Sender(threading.Thread):
    """Sends what ``StreamProtocol.next_message`` says (resends, the caller's chunks, the flush) while the caller's
    thread receives: reading and writing at once is what keeps a stream of large units from deadlocking."""

    def __init__(self, ws: ClientConnection, protocol: StreamProtocol, feed: _Feed):
        super().__init__(name="wm-refiner-stream-sender", daemon=True)
        self.ws, self.protocol, self.feed = ws, protocol, feed
        self.error: BaseException | None = None
        self._stopped = threading.Event()
        self._woken = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        self._woken.set()
        self.feed.interrupt()

    def wake(self) -> None:
        """A unit arrived: the flush may be due."""
        self._woken.set()

    def run(self) -> None:
        try:
            while not self._stopped.is_set():
                message = self.protocol.next_message()
                if message == NEED_CHUNK:
                    taken = self.feed.take(self._stopped)
                    if taken is None:
                        return  # stopped (a reconnect): the feed hands the chunk to the next connection
                    kind, item = taken
                    if kind == "error":
                        raise item
                    if kind == "end":
                        self.protocol.finish()
                        continue
                    message = self.protocol.add(item)
                    if message is None:
                        continue
                elif message == WAIT:
                    self._woken.wait()
                    self._woken.clear()
                    continue
                elif message == DONE_SENDING:
                    return
                self.ws.send(message)
        except ConnectionClosed:
            pass  # the receiving side sees the close and reconnects
        except BaseException as exc:  # the caller's chunks raised, or a chunk is not an array: end the stream
            self.error = exc
            self.ws.close()


def _close_code(exc: ConnectionClosed) -> tuple[int | None, str]:
    """The close code and reason the server sent (None: the connection dropped without a close frame)."""
    return (exc.rcvd.code, exc.rcvd.reason) if exc.rcvd is not None else (None, "")


def _watched(config: Mapping[str, Any], video_format: str | None) -> dict[str, Any]:
    """The config a watch's units follow: the session's, with the watch's own ``video_format`` when it asks one."""
    return dict(config) if video_format is None else {**config, "video_format": video_format}


def _geometry(latents: Array) -> tuple[int, int, int, int]:
    batch, channels, _, height, width = (int(n) for n in latents.shape)
    return batch, channels, height, width


def _join(units: list[Unit], frame_end: int, video_end: int) -> Unit:
    """Several consecutive units as one (a flush over the WebSocket may bring more than one). Kinds beyond latents
    and video are joined by their form: encoded pieces one after another (``EncodedVideo.join``), arrays along
    axis 1 (the axis after the batch: a unit's frames or items)."""
    if not units:
        return Unit(frame_start=frame_end, frame_end=frame_end)
    with_latents = [u for u in units if u.latents is not None]
    with_video = [u for u in units if u.video is not None]
    encoded = [u.encoded_video for u in units if u.encoded_video is not None]
    video_starts = [u.video_frame_start for u in units if u.video_frame_start is not None]
    others: dict[str, Any] = {}
    for kind in dict.fromkeys(k for u in units for k in u.payloads if k not in ("latents", "video")):
        parts = [u.payloads[kind] for u in units if kind in u.payloads]
        if all(isinstance(part, EncodedVideo) for part in parts):
            others[kind] = EncodedVideo.join(parts)
        else:
            others[kind] = np.concatenate([np.asarray(part) for part in parts], axis=1) if len(parts) > 1 \
                else parts[0]
    return Unit(
        frame_start=units[0].frame_start,
        frame_end=units[-1].frame_end,
        latents=concat(with_latents) if with_latents else None,
        video=concat(with_video, "video") if with_video else None,
        video_frame_start=video_starts[0] if video_starts else None,
        video_frame_end=video_end if video_starts else None,
        encoded_video=EncodedVideo.join(encoded) if encoded else None,
        video_error=next((u.video_error for u in units if u.video_error), None),
        payloads=others,
    )
