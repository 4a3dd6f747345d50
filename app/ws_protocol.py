"""uvicorn's WebSocket protocol (websockets, sans-I/O) with three protocol details fixed for the server we run.

- A handshake the app refuses with an HTTP response (``websocket.http.response.*``: a 401 from app.auth, a 404, a
  503 from the stream route's ``deny``) is a complete handshake: uvicorn 0.54 still logs "ASGI callable returned
  without completing handshake" at ERROR for every one, so a scan for API keys filled the log with false alarms.
- A text message that is not valid UTF-8 is closed with 1007 (RFC 6455 section 8.1), as uvicorn does, but logged
  as one INFO line: it is the client's fault, and uvicorn's ERROR with a traceback looked like a server bug.
- A handshake that websockets' own parser refuses (a header line over 8192 bytes, more than 128 headers: its
  limits, below ``max_header_bytes`` which httptools already checked) gets the 431/414 response websockets built;
  uvicorn logged it as sent but never wrote it, and the client waited for an answer that never came.
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

# RFC 6455 7.4.1: "received data within a message that was not consistent with the type of the message".
WS_INVALID_PAYLOAD = 1007


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
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
