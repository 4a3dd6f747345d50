"""The one error table: each kind of failure, its HTTP status, its WebSocket behaviour and its JSON envelope.

Routes raise ``ApiError(kind, message)``; the handlers in ``app.api.factory`` and the stream route turn it into the
response. Errors raised where they arise are mapped here by ``from_exception``: those of ``models`` (each with a
stable ``code``) and the engine's own (``app.engine.engine_errors``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.errors import RefinerError


# WebSocket close codes (RFC 6455 section 7.4.1).
WS_NORMAL = 1000
WS_GOING_AWAY = 1001
WS_POLICY_VIOLATION = 1008
WS_MESSAGE_TOO_BIG = 1009
WS_INTERNAL_ERROR = 1011
WS_SERVICE_RESTART = 1012  # the session was saved: reconnect to the same id once the server is back
WS_TRY_AGAIN_LATER = 1013


@dataclass(frozen=True)
class ErrorKind:
    """How one kind of failure is reported.

    ``ws_close``: None keeps the WebSocket open after the error event (the session can continue); a code
    closes it after the event. Before the handshake is accepted every kind is an HTTP denial with ``status``.
    """

    status: int
    ws_close: int | None = None
    retry_after: bool = False


ERRORS: dict[str, ErrorKind] = {
    # 400: the payload cannot be read, or a tensor the request needs is absent.
    "invalid_payload": ErrorKind(400),
    "missing_input": ErrorKind(400),
    # 401
    "unauthorized": ErrorKind(401, ws_close=WS_POLICY_VIOLATION),
    # 403: a browser page's WebSocket from an origin not in cors_origins (app.api.cors), refused at the handshake.
    "origin_not_allowed": ErrorKind(403, ws_close=WS_POLICY_VIOLATION),
    # 404 / 405
    "session_not_found": ErrorKind(404, ws_close=WS_POLICY_VIOLATION),
    "not_found": ErrorKind(404),
    "method_not_allowed": ErrorKind(405),
    # 409
    "seq_conflict": ErrorKind(409),
    "stream_closed": ErrorKind(409),
    "stream_in_use": ErrorKind(409),
    # PUT /v1/sessions/{id}: a session of that id exists with another config.
    "session_exists": ErrorKind(409),
    # A reattaching stream asked for frames the session no longer keeps; it may reconnect from the first kept.
    "resume_unavailable": ErrorKind(409, ws_close=WS_POLICY_VIOLATION),
    # 410
    "session_evicted": ErrorKind(410, ws_close=WS_POLICY_VIOLATION),
    # 413: the WebSocket closes, as RFC 6455 prescribes for a message the endpoint will not take.
    "payload_too_large": ErrorKind(413, ws_close=WS_MESSAGE_TOO_BIG),
    "too_many_frames": ErrorKind(413),
    "prompt_too_long": ErrorKind(413),
    # 415
    "unsupported_media_type": ErrorKind(415),
    # Answered by the HTTP layer (app.api.guards) before any route, the connection then closed: headers or a body not
    # sent within request_header_timeout_s / request_body_timeout_s, a head over max_header_bytes.
    "request_timeout": ErrorKind(408),
    "headers_too_large": ErrorKind(431),
    # 422
    "invalid_input": ErrorKind(422),
    "invalid_config": ErrorKind(422),
    "invalid_request": ErrorKind(422),
    # 503: always with Retry-After. A draining server closes streams; a busy engine only fails that message.
    "not_ready": ErrorKind(503, ws_close=WS_TRY_AGAIN_LATER, retry_after=True),
    "draining": ErrorKind(503, ws_close=WS_GOING_AWAY, retry_after=True),
    "too_many_sessions": ErrorKind(503, retry_after=True),
    "engine_busy": ErrorKind(503, retry_after=True),
    # Request bodies in flight over max_inflight_body_bytes (app.api.guards).
    "server_busy": ErrorKind(503, retry_after=True),
    # The session is another replica's (it holds the session's lease: app.persistence.leases), or this replica just lost it to
    # one; the stream closes with 1012 and the client retries, through the router, to the session's owner.
    "session_moved": ErrorKind(503, ws_close=WS_SERVICE_RESTART, retry_after=True),
    # A session's bytes (known at its first chunk) do not fit device_memory_budget, even after idle sessions were
    # parked (app.sessions.parking); refused before anything of it was allocated.
    "insufficient_memory": ErrorKind(503, retry_after=True),
    # A new realtime session the engine's measured cost says it cannot keep up with (admission: realtime).
    "over_capacity": ErrorKind(503, retry_after=True),
    # 500: a bug or a device failure; the session was restored, but the stream is closed to be safe.
    "internal_error": ErrorKind(500, ws_close=WS_INTERNAL_ERROR),
}

# models' error codes -> the kinds above.
_REFINER_CODES = {
    "invalid_config": "invalid_config",
    "invalid_input": "invalid_input",
    "missing_input": "missing_input",
    "stream_closed": "stream_closed",
}


class KindedError(Exception):
    """An error a lower layer raises in its own terms (no HTTP, no WebSocket) that names the kind (``error_kind``) it is
    reported as: the engine's (``app.engine.engine_errors``). Its message is written for the client already (it says
    what to do), so that reporting it only picks the code: the engine names a kind, never a status or close code."""

    error_kind: str = "internal_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ApiError(Exception):
    def __init__(self, kind: str, message: str, retry_after_s: int | None = None,
                 fields: dict[str, Any] | None = None, headers: dict[str, str] | None = None):
        if kind not in ERRORS:
            raise KeyError(f"unknown error kind {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s  # when known for this error: the Retry-After instead of the setting's
        # Figures a client acts on (api.md 1.2: insufficient_memory's bytes_needed and bytes_free), as JSON fields
        # of the envelope's "error" beside the message, so that nobody parses them out of its prose.
        self.fields = dict(fields or {})
        self.extra_headers = dict(headers or {})  # what the answer's headers say besides (415's Accept-Encoding)

    @property
    def spec(self) -> ErrorKind:
        return ERRORS[self.kind]

    @property
    def status(self) -> int:
        return self.spec.status

    def envelope(self) -> dict[str, Any]:
        body = envelope(self.kind, self.message)
        body["error"].update(self.fields)
        return body

    def headers(self, retry_after_s: int) -> dict[str, str]:
        if not self.spec.retry_after:
            return dict(self.extra_headers)
        return {**self.extra_headers,
                "Retry-After": str(self.retry_after_s if self.retry_after_s is not None else retry_after_s)}


def envelope(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def from_exception(exc: BaseException) -> ApiError:
    """Any exception as the ApiError it is reported as."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, KindedError):
        return ApiError(exc.error_kind, exc.message)
    if isinstance(exc, RefinerError) and exc.code in _REFINER_CODES:
        return ApiError(_REFINER_CODES[exc.code], str(exc))
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return ApiError(
            "internal_error",
            "the device ran out of memory refining this request; the session is unchanged, retry later or "
            "send smaller chunks",
        )
    return ApiError("internal_error", f"internal error ({type(exc).__name__}); the session is unchanged")
