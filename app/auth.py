"""Optional API key, enforced for every HTTP route and WebSocket except the public probes.

A middleware rather than a per-route dependency: it covers every route the app will ever register (including
the OpenAPI docs and paths that do not exist), and it refuses a WebSocket at the handshake, before it is
accepted, with a real HTTP 401. The key is read from the ``Authorization: Bearer`` header only, never from
the query string (URLs end up in logs), and compared in constant time.
"""

from __future__ import annotations

import hmac
import json
from typing import Callable, Iterable

from .errors import ApiError, WS_POLICY_VIOLATION


class ApiKeyMiddleware:
    def __init__(
        self,
        app,
        api_key: str | None,
        public_paths: Iterable[str],
        on_reject: Callable[[ApiError], None] | None = None,
    ):
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.public_paths = frozenset(public_paths)
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if (
            self.expected is None
            or scope["type"] not in ("http", "websocket")
            or scope["path"] in self.public_paths
            or self._authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        error = ApiError(
            "unauthorized",
            "missing or wrong API key; send the header 'Authorization: Bearer <key>' (query-string keys are ignored)",
        )
        if self.on_reject is not None:
            self.on_reject(error)
        body = json.dumps(error.envelope()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="wm-refiner"'),
        ]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        elif "websocket.http.response" in scope.get("extensions", {}):
            await send({"type": "websocket.http.response.start", "status": 401, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:  # a server without the denial-response extension: refuse the handshake the only way left
            await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION, "reason": "unauthorized"})

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
                    return True
        return False
