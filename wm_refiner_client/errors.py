"""Typed errors: one class per error code of the service's error table (docs/api.md "Errors", ``app.core.error_kinds.ERRORS``).

Every error the server answers with is ``{"error": {"code": ..., "message": ...}}``; the client raises the class
registered for its code, a subclass of the class for its HTTP status, a subclass of ``APIError``. Catch as narrowly
as you need::

    try:
        session.send(latents, prompt=prompt)
    except wm.SeqConflictError as exc:     # one code
        ...
    except wm.ConflictError:               # any 409
        ...
    except wm.APIError as exc:             # anything the server refused: exc.status, exc.code, exc.message
        ...

Failures that are not the server's answer are ``TransportError`` (the server could not be reached, or kept
dropping the connection, after the retries) and ``ProtocolError`` (the server said something this client cannot
reconcile with what it sent).
"""

from __future__ import annotations

from typing import Any


class WmRefinerError(Exception):
    """Base of every error this package raises."""


class TransportError(WmRefinerError):
    """The server could not be reached, or the connection kept failing, after every retry. ``final``: no retry can
    change it (an unknown host, https:// to a plain-HTTP server, an untrusted certificate): the address or the
    client's set-up is wrong, and the message says how."""

    final: bool = False
    tries: int | None = None  # at most this many tries of the same step are worth it (a first contact's refusal)
    close_code: int | None = None  # a watch's WebSocket closed before the flush: the code the server sent (1012...)

    def __init__(self, message: str, *, final: bool = False, tries: int | None = None,
                 close_code: int | None = None):
        super().__init__(message)
        self.final = final
        self.tries = tries
        self.close_code = close_code


class ProtocolError(WmRefinerError):
    """The server's messages contradict what this client sent or received (a gap in the frames, an unexpected
    event): a bug on one side, never retried."""


class APIError(WmRefinerError):
    """The server refused a request. ``status``: HTTP status; ``code``: the stable error code; ``message``: what
    was wrong and what to send instead; ``retry_after``: seconds, for 503s; ``replica``: the replica that
    answered (its ``X-Replica`` header), when the client knows it."""

    status: int = 0
    code: str = ""
    replica: str | None = None

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 retry_after: float | None = None, body: Any = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.body = body

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


# --- by HTTP status -------------------------------------------------------------------------------------------
class BadRequestError(APIError):
    status = 400


class AuthenticationError(APIError):
    status = 401


class ForbiddenError(APIError):
    status = 403


class NotFoundError(APIError):
    status = 404


class MethodNotAllowedError(APIError):
    status = 405
    code = "method_not_allowed"


class ConflictError(APIError):
    status = 409


class GoneError(APIError):
    status = 410


class PayloadTooLargeError(APIError):
    status = 413


class UnsupportedMediaTypeError(APIError):
    status = 415
    code = "unsupported_media_type"


class UnprocessableError(APIError):
    status = 422


class InternalServerError(APIError):
    status = 500


class BadGatewayError(APIError):
    """502 from a router in front of the replicas: the replica died or dropped the connection mid-request."""

    status = 502


class GatewayTimeoutError(APIError):
    """504 from a router in front of the replicas: the replica did not answer in time."""

    status = 504


class ServiceUnavailableError(APIError):
    """503: retried by the client on its own (after ``Retry-After``); raised once the retries are spent."""

    status = 503


# --- by code (the error table) --------------------------------------------------------------------------------
class InvalidPayloadError(BadRequestError):
    code = "invalid_payload"


class MissingInputError(BadRequestError):
    code = "missing_input"


class UnauthorizedError(AuthenticationError):
    code = "unauthorized"


class OriginNotAllowedError(ForbiddenError):
    """A WebSocket from a browser page whose origin is not in the server's ``cors_origins``."""

    code = "origin_not_allowed"


class SessionNotFoundError(NotFoundError):
    code = "session_not_found"


class RouteNotFoundError(NotFoundError):
    code = "not_found"


class SeqConflictError(ConflictError):
    code = "seq_conflict"


class StreamClosedError(ConflictError):
    """The session was flushed: it takes no more frames."""

    code = "stream_closed"


class StreamInUseError(ConflictError):
    """Another connection streams this session (or took it over)."""

    code = "stream_in_use"


class SessionExistsError(ConflictError):
    """``PUT /v1/sessions/{id}``: a session of that id exists with another config."""

    code = "session_exists"


class ResumeUnavailableError(ConflictError):
    """A reconnect asked for frames the session no longer keeps (the message names the first kept frame)."""

    code = "resume_unavailable"


class SessionEvictedError(GoneError):
    code = "session_evicted"


class PayloadTooLargeCodeError(PayloadTooLargeError):
    code = "payload_too_large"


class TooManyFramesError(PayloadTooLargeError):
    code = "too_many_frames"


class PromptTooLongError(PayloadTooLargeError):
    code = "prompt_too_long"


class InvalidInputError(UnprocessableError):
    code = "invalid_input"


class InvalidConfigError(UnprocessableError):
    code = "invalid_config"


class InvalidRequestError(UnprocessableError):
    code = "invalid_request"


class InternalError(InternalServerError):
    code = "internal_error"


class NotReadyError(ServiceUnavailableError):
    code = "not_ready"


class DrainingError(ServiceUnavailableError):
    code = "draining"


class TooManySessionsError(ServiceUnavailableError):
    code = "too_many_sessions"


class EngineBusyError(ServiceUnavailableError):
    code = "engine_busy"


class ServerBusyError(ServiceUnavailableError):
    """Request bodies in flight across the server are over its max_inflight_body_bytes; nothing was read."""

    code = "server_busy"


class SessionMovedError(ServiceUnavailableError):
    """The session lives on another replica (it holds the session's lease), or is moving there: retried, and
    behind the router the retry reaches the session's owner."""

    code = "session_moved"


class InsufficientMemoryError(ServiceUnavailableError):
    """The session's bytes (its KV cache at its frame size) do not fit the server's device memory budget; nothing
    was allocated. Retry later, with smaller frames or window, or on another replica."""

    code = "insufficient_memory"


class OverCapacityError(ServiceUnavailableError):
    """A new realtime session was refused: by the server's measured cost it could not keep up with it and the
    realtime sessions it holds (admission: realtime). Retry later, elsewhere, or without realtime."""

    code = "over_capacity"


class RequestTimeoutError(APIError):
    """The server's HTTP layer closed a request whose headers or body came too slowly (408)."""

    status = 408
    code = "request_timeout"


class HeadersTooLargeError(APIError):
    """The request line and headers were over the server's max_header_bytes (431)."""

    status = 431
    code = "headers_too_large"


ERROR_CLASSES: dict[str, type[APIError]] = {
    cls.code: cls
    for cls in (
        InvalidPayloadError, MissingInputError, UnauthorizedError, OriginNotAllowedError, SessionNotFoundError,
        RouteNotFoundError, MethodNotAllowedError, SeqConflictError, StreamClosedError, StreamInUseError, SessionExistsError,
        ResumeUnavailableError, SessionEvictedError, PayloadTooLargeCodeError, TooManyFramesError,
        PromptTooLongError, UnsupportedMediaTypeError, InvalidInputError, InvalidConfigError, InvalidRequestError,
        InternalError, NotReadyError, DrainingError, TooManySessionsError, EngineBusyError, ServerBusyError,
        SessionMovedError, InsufficientMemoryError, OverCapacityError, RequestTimeoutError, HeadersTooLargeError,
    )
}
_BY_STATUS: dict[int, type[APIError]] = {
    cls.status: cls
    for cls in (
        BadRequestError, AuthenticationError, ForbiddenError, NotFoundError, MethodNotAllowedError, ConflictError, GoneError,
        PayloadTooLargeError, UnsupportedMediaTypeError, UnprocessableError, InternalServerError,
        BadGatewayError, ServiceUnavailableError, GatewayTimeoutError,
    )
}

# Codes after which the server will take the same request again (the request changed nothing).
RETRYABLE_CODES = frozenset({"not_ready", "draining", "too_many_sessions", "engine_busy", "server_busy",
                             "session_moved", "insufficient_memory",
                             "over_capacity"})


def error_from(status: int, body: Any, retry_after: float | None = None) -> APIError:
    """The typed error for a response: by its code when the body is the service's envelope, else by status."""
    code, message = None, None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        message = body["error"].get("message")
    cls = ERROR_CLASSES.get(code or "") or _BY_STATUS.get(status) or APIError
    if message is None:
        message = body if isinstance(body, str) and body else f"HTTP {status}"
    return cls(str(message), status=status, code=code or cls.code or f"http_{status}", retry_after=retry_after,
               body=body)

__all__ = [
    name for name, value in list(globals().items())
    if isinstance(value, type) and issubclass(value, WmRefinerError)
] + ["ERROR_CLASSES", "RETRYABLE_CODES", "error_from"]
