"""uvicorn's WebSocket protocol (websockets, sans-I/O) with three protocol details fixed for the server we run.

- A handshake the app refuses with an HTTP response (``websocket.http.response.*``: a 401 from app.api.auth, a 404, a
  503 from the stream route's ``deny``) is a complete handshake: uvicorn 0.54 still logs "ASGI callable returned
  without completing handshake" at ERROR for every one, so a scan for API keys filled the log with false alarms.
- A text message that is not valid UTF-8 is closed with 1007 (RFC 6455 section 8.1), as uvicorn does, but logged
  as one INFO line: it is the client's fault, and uvicorn's ERROR with a traceback looked like a server bug.
- A handshake that websockets' own parser refuses (a header line over 8192 bytes, more than 128 headers: its
  limits, below ``max_header_bytes`` which httptools already checked) gets the 431/414 response websockets built;
  uvicorn logged it as sent but never wrote it, and the client waited for an answer that never came.

And one bound: a client that sends pings and never reads made the server buffer a pong for each (uvicorn writes
them into the transport without back-pressure; 85 MiB of pings grew a server by 120 MiB). Once a connection's
unsent output passes ``ws_max_write_buffer_bytes`` the server stops reading it (TCP pushes back on the client)
until the client has read enough for asyncio to resume writing: whatever the client sends, what is buffered for it
stays within the limit plus one read's worth of pongs. The app's own messages were bounded already (uvicorn's
``send`` waits while the transport's buffer is over its high-water mark).
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

# RFC 6455 7.4.1: "received data within a message that was not consistent with the type of the message".
WS_INVALID_PAYLOAD = 1007


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
    max_write_buffer_bytes = 1024 * 1024  # ``configure`` sets the server's ``ws_max_write_buffer_bytes``
    # Reading is paused for two reasons: uvicorn's (a message waits for the app: ``read_paused``) and ours (the
    # client does not read what it is sent: ``write_backlog``); it resumes when neither holds.
    write_backlog = False

    @classmethod
    def configure(cls, max_write_buffer_bytes: int) -> type:
        return type(cls.__name__, (cls,), dict(max_write_buffer_bytes=max_write_buffer_bytes))

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.handshake_initiated and self.conn.handshake_exc is not None and not self.close_sent:
            # websockets rejected the request head itself: its response (or EOF) is queued, not yet written.
            prefix = "%s:%d - " % self.client if self.client else ""
            self.logger.info("%sWebSocket handshake refused: %s", prefix, self.conn.handshake_exc)
            self.close_sent = True
            self.handshake_complete = True
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.transport.close()
            return
        if not self.write_backlog and self.transport.get_write_buffer_size() > self.max_write_buffer_bytes:
            # Past asyncio's high-water mark too (the limit is at least that), so the transport calls
            # resume_writing once the client has read enough (or the connection is lost, which ends it all).
            self.write_backlog = True
            self.transport.pause_reading()

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

    def send_receive_event_to_app(self) -> None:
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
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            # The denial response is written and the connection closed: the handshake is over.
            self.handshake_complete = True
