"""What a client can make the process hold before any route sees its request, bounded by settings:

- ``BodyBudget`` (ASGI): request-body bytes in flight across every connection (``max_inflight_body_bytes``). A body
  whose declared length does not fit is refused with 503 + Retry-After before a byte of it is read; a chunked body
  is refused the moment it would overflow. A body's bytes count until it is complete, its request ends or its
  client goes away.
- ``GuardedHttpToolsProtocol`` (uvicorn's HTTP/1.1 protocol on httptools): the size of a request's head
  (``max_header_bytes``: 431, and the connection closed, once it is exceeded without waiting for the rest) and the
  time a client may take to send it (``request_header_timeout_s``) and then its body
  (``request_body_timeout_s``): 408 and closed. httptools has no such limits and buffers whatever it is sent, and
  uvicorn times out idle keep-alive connections only.
"""

from __future__ import annotations

import json
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.core.error_kinds import ApiError

log = logging.getLogger(__name__)


class BodyBudget:
    """ASGI middleware: the sum of request-body bytes held across all connections stays under ``limit``."""

    def __init__(self, app, limit: int, max_body_bytes: int, retry_after_s: int, gauge=None):
        self.app = app
        self.limit = limit
        self.max_body_bytes = max_body_bytes  # a body declared larger is the route's to refuse (413), unread
        self.retry_after_s = retry_after_s
        self.gauge = gauge  # what is held, on /metrics (refiner_request_body_bytes_in_flight)
        self._held = 0  # the event loop's only: no lock needed

    @property
    def held(self) -> int:
        return self._held

    @held.setter
    def held(self, value: int) -> None:
        self._held = value
        if self.gauge is not None:
            self.gauge.set(value)

    def __getattr__(self, name: str):
        # The app's own attributes (state, routes) stay reachable through the server's config.app.
        return getattr(self.app, name)

    def _refusal(self, wanted: int) -> ApiError:
        return ApiError(
            "server_busy",
            f"the server holds {self.held} bytes of request bodies in flight and this one ({wanted} bytes) would pass "
            f"its limit of {self.limit} (max_inflight_body_bytes); retry after the Retry-After seconds",
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None  # the route says what is wrong with it
                break
        mine = 0  # what this request added to self.held
        if declared is not None and 0 < declared <= self.max_body_bytes:
            if self.held + declared > self.limit:
                await self._refuse(send, self._refusal(declared))
                return
            # Taken at once: a body sent slowly must not let others past the limit meanwhile.
            mine = declared
            self.held += mine
        received = 0
        done = False

        def release() -> None:
            nonlocal mine, done
            self.held -= mine
            mine, done = 0, True

        async def guarded_receive():
            nonlocal received, mine
            message = await receive()
            if done:
                return message
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                extra = received - mine  # a chunked body, or one longer than it declared
                if extra > 0:
                    if self.held + extra > self.limit:
                        release()
                        raise self._refusal(received)
                    self.held += extra
                    mine += extra
                if not message.get("more_body", False):
                    release()
            elif message["type"] == "http.disconnect":
                release()
            return message

        try:
            await self.app(scope, guarded_receive, send)
        finally:
            if not done:
                release()

    async def _refuse(self, send, error: ApiError) -> None:
        body = json.dumps(error.envelope()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        headers += [(k.lower().encode(), v.encode()) for k, v in error.headers(self.retry_after_s).items()]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def error_head(status: int, reason: str, code: str, message: str) -> bytes:
    """A whole HTTP response carrying the error envelope, for a connection answered before any route (then closed)."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


# The longest URL httptools parses (its parse_url keeps offsets in 16 bits): a longer one made uvicorn answer 400,
# which this protocol's envelope then blamed on Content-Length and the like.
MAX_URL_BYTES = 65535


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on a request head's size and on the time to send head and body.
    The limits come from the ``Settings`` given to ``configure`` (uvicorn builds one protocol per connection)."""

    max_header_bytes = 64 * 1024
    header_timeout_s = 10.0
    body_timeout_s = 120.0

    @classmethod
    def configure(cls, max_header_bytes: int, header_timeout_s: float, body_timeout_s: float) -> type:
        return type(cls.__name__, (cls,), dict(max_header_bytes=max_header_bytes, header_timeout_s=header_timeout_s,
                                              body_timeout_s=body_timeout_s))

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes = 0
        self._in_head = True
        self._refused = False
        self._timer = self.loop.call_later(self.header_timeout_s, self._too_slow, "head")

    def connection_lost(self, exc) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _stop_timer(self) -> None:
        timer, self._timer = getattr(self, "_timer", None), None
        if timer is not None:
            timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # Checked after parsing: one read may hold a small head and the start of a large body.
        if self._in_head and self._head_bytes > self.max_header_bytes and not self._refused:
            self._refuse(431, "Request Header Fields Too Large", "headers_too_large",
                         f"the request line and headers are over {self.max_header_bytes} bytes (max_header_bytes); "
                         "send shorter headers")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # the next request on a kept-alive connection
            self._in_head, self._head_bytes = True, 0
            self._stop_timer()
            self._timer = self.loop.call_later(self.header_timeout_s, self._too_slow, "head")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_timer()
        super().on_headers_complete()
        if self.transport.get_protocol() is self and self.cycle is not None and self.cycle.more_body:
            self._timer = self.loop.call_later(self.body_timeout_s, self._too_slow, "body")

    def on_message_complete(self) -> None:
        self._stop_timer()
        super().on_message_complete()

    def _too_slow(self, part: str) -> None:
        self._timer = None
        if self._refused or self.transport.is_closing():
            return
        if part == "head":
            limit, setting = self.header_timeout_s, "request_header_timeout_s"
        else:
            limit, setting = self.body_timeout_s, "request_body_timeout_s"
        self._refuse(408, "Request Timeout", "request_timeout",
                     f"the request's {'headers' if part == 'head' else 'body'} did not arrive within {limit:g} s "
                     f"({setting}); send the whole request at once")

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse (Content-Length and Transfer-Encoding together, two Content-Lengths, a
        negative one, a malformed chunk size or header line): the error envelope every other error has, instead of
        uvicorn's plain-text "Invalid HTTP request received." (uvicorn has logged it already). As the other refusals:
        once, and never into a response already under way (a malformed chunk while the route answers)."""
        if self._refused:
            return
        url = len(getattr(self, "url", b""))
        if url > MAX_URL_BYTES:  # httptools.parse_url's own limit, whatever max_header_bytes allows
            self._refuse(431, "Request Header Fields Too Large", "headers_too_large",
                         f"the request line's URL is {url} bytes, more than the {MAX_URL_BYTES} the server's HTTP "
                         "parser takes; send a shorter URL (a session id is at most 64 characters, query values are "
                         "short)", logged=True)
            return
        self._refuse(400, "Bad Request", "invalid_payload",
                     "the request is not valid HTTP/1.1 (the server's parser refused it: e.g. Content-Length and "
                     "Transfer-Encoding together, two or a negative Content-Length, a malformed chunk size, header "
                     "line or line ending); send one well-formed request (any HTTP client library does)", logged=True)

    def _refuse(self, status: int, reason: str, code: str, message: str, logged: bool = False) -> None:
        self._refused = True
        self._stop_timer()
        prefix = "%s:%d - " % self.client if self.client else ""
        if not logged:
            log.warning("%s%d: %s", prefix, status, message)
        response_started = self.cycle is not None and self.cycle.response_started
        if not response_started:
            self.transport.write(error_head(status, reason, code, message))
        if self.cycle is not None:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()
