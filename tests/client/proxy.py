"""A TCP proxy on loopback that a test can break: ``cut()`` resets every connection through it (a network drop, as
both ends see it); ``swallow_responses(n)`` forwards the next ``n`` requests to the server but drops the connection
as soon as the server starts answering (the server did the work, the client never hears of it), or answers with
``reply`` in its place (a router whose replica died mid-request: HAProxy's 502); ``answer_next(n, reply)`` answers
the next ``n`` connections itself without reaching the server (a router sending the request to a replica that does
not hold the session yet)."""

from __future__ import annotations

import socket
import threading


class Proxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._swallow = 0
        self._swallow_reply: bytes | None = None
        self.swallowed = 0
        self._answers: list[bytes] = []
        self.answered = 0
        self.cuts = 0
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._thread.start()

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.cut(count=False)

    def cut(self, count: bool = True) -> int:
        """Reset every open connection; how many there were."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            if count:
                self.cuts += 1
        for pair in pairs:
            for sock in pair:
                _close(sock)
        return len(pairs)

    def swallow_responses(self, n: int = 1, reply: bytes | None = None) -> None:
        with self._lock:
            self._swallow += n
            self._swallow_reply = reply

    def answer_next(self, n: int, reply: bytes) -> None:
        """Answer the next ``n`` connections with ``reply`` (a whole HTTP response) after reading their request.
        Connections already open keep going to the server: ``cut()`` them first."""
        with self._lock:
            self._answers.extend([reply] * n)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                answer = self._answers.pop(0) if self._answers else None
                if answer is not None:
                    self.answered += 1
            if answer is not None:
                threading.Thread(target=self._answer, args=(client, answer), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, from_server: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if from_server:
                    with self._lock:
                        swallow = self._swallow > 0
                        if swallow:
                            self._swallow -= 1
                            self.swallowed += 1
                        reply = self._swallow_reply
                    if swallow:
                        if reply is not None:
                            target.sendall(reply)
                        break
                target.sendall(data)
        except OSError:
            pass
        finally:
            _close(source)
            _close(target)


    def _answer(self, client: socket.socket, reply: bytes) -> None:
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    return
                head += data
            header, _, body = head.partition(b"\r\n\r\n")
            length = 0
            for line in header.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            while len(body) < length:
                data = client.recv(65536)
                if not data:
                    return
                body += data
            client.sendall(reply)
        except OSError:
            pass
        finally:
            _close(client)


def http_response(status: int, reason: str, body: bytes, content_type: str, **headers: str) -> bytes:
    """A whole HTTP/1.1 response that closes its connection."""
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
             "Connection: close", *(f"{name.replace('_', '-')}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
