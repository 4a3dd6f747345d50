"""uvicorn's WebSocket protocol (websockets, sans-I/O) with three protocol details fixed for the server we run.

- A handshake the app refuses with an HTTP response (``websocket.http.response.*``: a 401 from app.api.auth, a 404, a
  503 from the stream route's ``deny``) is a complete handshake: uvicorn 0.54 still logs "ASGI callable returned
  without completing handshake" at ERROR for every one, so a scan for API keys filled the log with false alarms.
- A text message that is not valid UTF-8 is closed with 1007 (RFC 6455 section 8.1), as uvicorn does, but logged
  as one INFO line: it is the client's fault, and uvicorn's ERROR with a traceback looked like a server bug.
- A handshake that websockets' own parser refuses (a request or header line over 8192 bytes, more than 128 headers:
  its limits, below ``max_header_bytes`` which httptools already checked; or a head it cannot read, such as one with
  Transfer-Encoding) is answered with the error envelope, 431 ``headers_too_large`` or 400 ``invalid_payload``, as
  the HTTP layer answers its own refusals: uvicorn logged websockets' plain-text 414/431 as sent but never wrote it,
  and for a head websockets could not read there was no answer at all, only EOF.

And one bound: a client that sends pings and never reads made the server buffer a pong for each (uvicorn writes
them into the transport without back-pressure; 85 MiB of pings grew a server by 120 MiB). Once a connection's
unsent output passes ``ws_max_write_buffer_bytes`` the server stops reading it (TCP pushes back on the client)
until the client has read enough for asyncio to resume writing: whatever the client sends, what is buffered for it
stays within the limit plus one read's worth of pongs. The app's own messages were bounded already (uvicorn's
``send`` waits while the transport's buffer is over its high-water mark).

And a message's fragments are kept in one buffer as they arrive: uvicorn kept each as its own bytes object until the
last, so a message sent a byte per frame (7 bytes on the wire) held about 44 bytes per byte of payload (21 MB sent
grew a server by 133 MB), past what ``max_ws_message_bytes`` and ``max_inflight_body_bytes`` say a message holds, and
empty fragments held memory with no payload at all.

And one more: the bytes of messages still arriving count against the server's ``max_inflight_body_bytes`` together
with HTTP request bodies (``app.api.guards.BodyBudget``, the one budget). Each connection buffers at most one
message (``max_ws_message_bytes``), but connections are not capped, so six clients each holding a 60 MiB message
unfinished held 390 MiB. A connection whose next read would pass the budget while others hold some of it is closed
with 1013 (try again later: a stream reconnects and resends from where the server is); what it held is given back.
A connection the server has sent its close frame on (a refused resume, a finished watch) counts too: it is read
until the client's close frame or the close timeout (10 s), and a message sent meanwhile was held uncounted (four
such connections held 380 KB each past a 300 KB budget, any number of them 64 MiB each by default); past the budget
it is dropped at once, its goodbye said already.
And a message has ``request_body_timeout_s`` from its first byte to its last, as an HTTP body has from its headers:
a message trickled in (the keep-alive pings answered all the while) held its share of the budget for ever; past
the limit the connection is closed with 1013. A connection's count is what it sent since its last whole message
(or control frame between messages), to within one read.
And a peer that is gone without a FIN (a half-open socket: it neither reads nor answers the keep-alive ping) was
never let go: uvicorn's ping timeout, and the close timer after the server's own close frame, call
``transport.close()``, which waits for the write buffer to drain, and the buffer of a peer that reads nothing
never drains, so the connection was never lost, the route never told, and a stream held its session (never
released: it is in use while a stream is attached) and its place in ``max_sessions`` for ever. Those two
deadlines now drop what is still unsent (``transport.abort()``) once the peer is seen reading nothing (its write
buffer did not shrink for ``STUCK_CHECK_S``; a slow peer still reading is let finish): the route sees the
disconnect, the session is detached (``ws_reattach_grace_s``) as for any dropped client; and so does the server's
shutdown, which otherwise waited ``timeout_graceful_shutdown`` more for such a connection after the drain.
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import HeaderLineTooLong, RequestLineTooLong, TooManyHeaders
from websockets.http11 import MAX_LINE_LENGTH, MAX_NUM_HEADERS

from app.api.guards import error_head

# RFC 6455 7.4.1: "received data within a message that was not consistent with the type of the message".
WS_INVALID_PAYLOAD = 1007
WS_TRY_AGAIN_LATER = 1013


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
    max_write_buffer_bytes = 1024 * 1024  # ``configure`` sets the server's ``ws_max_write_buffer_bytes``
    # Reading is paused for two reasons: uvicorn's (a message waits for the app: ``read_paused``) and ours (the
    # client does not read what it is sent: ``write_backlog``); it resumes when neither holds.
    write_backlog = False
    # The server's BodyBudget (``configure``): what unfinished messages hold counts there; None: not counted.
    budget = None
    # Seconds a message may take from its first byte to its last (``request_body_timeout_s``); None: no limit.
    message_timeout_s: float | None = None
    message_bytes = 0  # bytes since this connection's last whole message (what it added to the budget)
    _message_timer = None
    # How long a peer past a missed deadline (ping, close, shutdown) with output still unsent gets to show that it
    # reads (its write buffer shrinks) before that output and the connection are dropped.
    STUCK_CHECK_S = 1.0

    @classmethod
    def configure(cls, max_write_buffer_bytes: int, budget=None, message_timeout_s: float | None = None) -> type:
        return type(cls.__name__, (cls,), dict(max_write_buffer_bytes=max_write_buffer_bytes, budget=budget,
                                              message_timeout_s=message_timeout_s))

    def data_received(self, data: bytes) -> None:
        # Counted after the server's close frame too: the connection is read until the client's close frame or the
        # close timeout, and a message arriving meanwhile is held as any is (then discarded).
        if self.handshake_complete and not self.disconnected and data:
            budget = self.budget
            # Alone, a message always may arrive (max_ws_message_bytes may be over the budget: a setting that
            # predates this bound must not refuse every large message).
            if budget is not None and budget.held + len(data) > budget.limit and budget.held > self.message_bytes:
                self._over_budget(budget)
                return
            if not self.message_bytes and self.message_timeout_s is not None and not self.close_sent:
                self._message_timer = self.loop.call_later(self.message_timeout_s, self._too_slow)
            if budget is not None:
                budget.held += len(data)
            self.message_bytes += len(data)
        super().data_received(data)
        if not self.handshake_initiated and self.conn.handshake_exc is not None and not self.close_sent:
            # websockets rejected the request head itself: its response (or EOF) is queued, not yet written.
            prefix = "%s:%d - " % self.client if self.client else ""
            self.logger.info("%sWebSocket handshake refused: %s", prefix, self.conn.handshake_exc)
            self.close_sent = True
            self.handshake_complete = True
            self.conn.data_to_send()  # websockets' own answer (plain text, or EOF): the envelope instead
            self.transport.write(_refusal(self.conn.handshake_exc))
            self.transport.close()
            return
        if not self.write_backlog and self.transport.get_write_buffer_size() > self.max_write_buffer_bytes:
            # Past asyncio's high-water mark too (the limit is at least that), so the transport calls
            # resume_writing once the client has read enough (or the connection is lost, which ends it all).
            self.write_backlog = True
            self.transport.pause_reading()

    def _over_budget(self, budget) -> None:
        held = budget.held
        self._settled()
        prefix = "%s:%d - " % self.client if self.client else ""
        if self.close_sent:  # the server said goodbye already: nothing it sends now is read, so it goes at once
            self.logger.warning("%sWebSocket dropped after its close frame: request bytes in flight at "
                                "max_inflight_body_bytes (%d of %d held)", prefix, held, budget.limit)
            self.transport.abort()
            return
        self.logger.warning("%sWebSocket closed with 1013: request bytes in flight at max_inflight_body_bytes "
                            "(%d of %d held)", prefix, held, budget.limit)
        self.conn.send_close(WS_TRY_AGAIN_LATER, "the server holds too many request bytes in flight "
                                                 "(max_inflight_body_bytes); reconnect and send again")
        self.handle_parser_exception()  # the close frame written, the app told, the connection closed

    def _too_slow(self) -> None:
        self._message_timer = None
        if self.close_sent or self.disconnected or not self.message_bytes:
            return
        prefix = "%s:%d - " % self.client if self.client else ""
        self.logger.warning("%sWebSocket closed with 1013: a message was not whole %g s after its first byte "
                            "(request_body_timeout_s)", prefix, self.message_timeout_s)
        self._settled()
        self.conn.send_close(WS_TRY_AGAIN_LATER, f"a message did not arrive whole within {self.message_timeout_s:g} "
                                                 "s (request_body_timeout_s); send each message at once")
        self.handle_parser_exception()

    def _settled(self) -> None:
        """No message of this connection is arriving any more: what it counted goes back to the budget, and its
        time limit is off."""
        if self.message_bytes and self.budget is not None:
            self.budget.held -= self.message_bytes
        self.message_bytes = 0
        if self._message_timer is not None:
            self._message_timer.cancel()
            self._message_timer = None

    def connection_lost(self, exc) -> None:
        self._settled()
        super().connection_lost(exc)

    def handle_ping(self) -> None:
        if not self.frames:  # between messages (a control frame may come between a message's fragments)
            self._settled()
        super().handle_ping()

    def handle_pong(self, event) -> None:
        if not self.frames:
            self._settled()
        super().handle_pong(event)

    def keepalive_timeout(self) -> None:
        super().keepalive_timeout()
        self._abort_if_stuck()

    def _close_timed_out(self) -> None:
        # The client did not answer the server's close frame within close_timeout: uvicorn's close, then the same
        # escape as for the ping timeout when the close frame itself is still stuck behind unread output.
        self.close_timer = None
        self.transport.close()
        self._abort_if_stuck()

    def shutdown(self) -> None:
        # The server stops after its drain closed every stream (the close frame queued, not necessarily read):
        # output still stuck behind a peer that reads nothing would hold uvicorn's shutdown until
        # timeout_graceful_shutdown (another drain_timeout_s + 5 s) for nothing; a peer still reading its last units
        # and the 1012 gets them (``_abort_if_stuck``).
        super().shutdown()
        self._abort_if_stuck()

    def _abort_if_stuck(self, before: int | None = None) -> None:
        """Past a deadline the peer missed: ``transport.close()`` (which waits for the write buffer to drain) ends
        nothing while output waits for a peer that does not read; drop that output and the connection. A peer that
        is still reading (the buffer shrank over ``STUCK_CHECK_S``: a slow link, a large unit) is let finish, as
        ``transport.close()`` lets it: only one that reads nothing is cut."""
        transport = self.transport
        if transport is None or self.disconnected:
            return
        left = transport.get_write_buffer_size()
        if left == 0:
            return
        if before is None or left < before:  # not seen stuck yet: look again in a moment
            self.loop.call_later(self.STUCK_CHECK_S, self._abort_if_stuck, left)
            return
        prefix = "%s:%d - " % self.client if self.client else ""
        self.logger.info("%sWebSocket peer neither read %d bytes of output nor answered in time: connection "
                         "dropped", prefix, left)
        transport.abort()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.write_backlog:
            self.write_backlog = False
            if not self.read_paused:
                self.transport.resume_reading()

    async def receive(self):
        # uvicorn's receive, except that reading stays paused while the client does not read what it is sent.
        message = await self.queue.get()
        if self.read_paused and self.queue.empty():
            self.read_paused = False
            if not self.write_backlog:
                self.transport.resume_reading()
        return message

    def handle_cont(self, event) -> None:
        # uvicorn appends each fragment to a list as its own bytes object: ~44 bytes held per 1-byte fragment, and
        # empty ones held memory with no payload at all. One buffer instead: a message holds its payload's bytes.
        held = self.frames[0]
        if not isinstance(held, bytearray):
            self.frames[0] = held = bytearray(held)
        held += event.data
        if event.fin:
            self.send_receive_event_to_app()

    def send_receive_event_to_app(self) -> None:
        self._settled()  # the message is whole: the app holds it now (one at a time: reading pauses until it reads)
        if self.frames and isinstance(self.frames[0], bytearray):
            self.frames = [bytes(self.frames[0])]  # the app gets bytes, as from uvicorn
        if self.curr_msg_data_type == "text" and not self.close_sent:
            try:
                b"".join(self.frames).decode()
            except UnicodeDecodeError as exc:
                self.frames = []
                prefix = "%s:%d - " % self.client if self.client else ""
                self.logger.info("%sWebSocket text message is not valid UTF-8 (%s): closed with 1007", prefix,
                                 exc.reason)
                self.conn.send_close(WS_INVALID_PAYLOAD, "a text message must be valid UTF-8")
                self.handle_parser_exception()
                return
        super().send_receive_event_to_app()

    async def send(self, message) -> None:
        await super().send(message)
        if message["type"] == "websocket.close" and self.close_timer is not None:
            self.close_timer.cancel()
            self.close_timer = self.loop.call_later(self.close_timeout, self._close_timed_out)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            # The denial response is written and the connection closed: the handshake is over.
            self.handshake_complete = True


def _refusal(exc: Exception) -> bytes:
    """The response to a handshake head websockets' parser refused (``exc``: why), in the error envelope."""
    if isinstance(exc, RequestLineTooLong):
        return error_head(431, "Request Header Fields Too Large", "headers_too_large",
                          f"the WebSocket handshake's request line is over {MAX_LINE_LENGTH} bytes; send a shorter "
                          "URL (the query parameters are a few short words)")
    if isinstance(exc, HeaderLineTooLong):
        return error_head(431, "Request Header Fields Too Large", "headers_too_large",
                          f"a header line of the WebSocket handshake is over {MAX_LINE_LENGTH} bytes; send shorter "
                          "headers (cookies, subprotocols)")
    if isinstance(exc, TooManyHeaders):
        return error_head(431, "Request Header Fields Too Large", "headers_too_large",
                          f"the WebSocket handshake has more than {MAX_NUM_HEADERS} headers; send fewer headers")
    return error_head(400, "Bad Request", "invalid_payload",
                      f"the WebSocket handshake is not a valid HTTP/1.1 upgrade request ({exc.__cause__ or exc}); "
                      "send a GET without a body or Transfer-Encoding (any WebSocket client library does)")
