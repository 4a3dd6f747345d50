"""A TCP proxy on loopback that a test can break: ``cut()`` resets every connection through it (a network drop, as
both ends see it); ``swallow_responses(n)`` forwards the next ``n`` requests to the server but drops the connection
as soon as the server starts answering (the server did the work, the client never hears of it)."""

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
        self.swallowed = 0
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

    def swallow_responses(self, n: int = 1) -> None:
        with self._lock:
            self._swallow += n

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
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
                    if swallow:
                        break
                target.sendall(data)
        except OSError:
            pass
        finally:
            _close(source)
            _close(target)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
