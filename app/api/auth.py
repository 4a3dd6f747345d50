"""Optional API key, enforced for every HTTP route and WebSocket except the public probes.

A middleware rather than a per-route dependency: it covers every route the app will ever register (including
the OpenAPI docs and paths that do not exist), and it refuses a WebSocket at the handshake, before it is
accepted, with a real HTTP 401. The key is read from the ``Authorization: Bearer`` header, never from the query
string (URLs end up in logs), and compared in constant time.

A browser cannot set headers on a WebSocket, only subprotocols (``new WebSocket(url, protocols)``; the view page,
app/api/routes/view.py, does so): on a WebSocket handshake, a ``Sec-WebSocket-Protocol`` entry
``wm-refiner.bearer.<key as base64url, no padding>`` is the same credential as the header. Base64url because a
subprotocol is an HTTP token (no spaces, no ``=``). A browser fails the connection unless the 101 names one of the
subprotocols it offered, so every WebSocket route accepts with ``select_subprotocol``: the plain ``wm-refiner``
when offered (the key is then never echoed back), else the ``wm-refiner.bearer.*`` entry the client sent (echoing
it tells the client nothing it did not have).
"""

from __future__ import annotations

import base64
import hmac
import json
import re
from typing import Callable, Iterable

from app.core.error_kinds import ApiError, WS_POLICY_VIOLATION

# The subprotocol that carries the key on a browser's WebSocket handshake, followed by the key in base64url.
BEARER_SUBPROTOCOL = b"wm-refiner.bearer."
# The plain subprotocol the view page offers beside the key.
PLAIN_SUBPROTOCOL = "wm-refiner"
# The operator routes (app.api.routes.admin), which admin_api_key guards instead of api_key when it is set.
ADMIN_PREFIX = "/v1/admin/"


def select_subprotocol(offered: Iterable[str]) -> str | None:
    """The subprotocol to accept a WebSocket with, among those the client offered (the handshake's
    ``Sec-WebSocket-Protocol``): ``wm-refiner``, else the first well-formed ``wm-refiner.bearer.*``, else none."""
    offered = list(offered)
    if PLAIN_SUBPROTOCOL in offered:
        return PLAIN_SUBPROTOCOL
    for protocol in offered:
        if _subprotocol_key(protocol.encode("latin-1", "replace")) is not None:
            return protocol
    return None
_BASE64URL = re.compile(rb"[A-Za-z0-9_-]+")


class ApiKeyMiddleware:
    def __init__(
        self,
        app,
        api_key: str | None,
        public_paths: Iterable[str],
        on_reject: Callable[[ApiError], None] | None = None,
        admin_key: str | None = None,
    ):
        self.app = app
        self.expected = api_key.encode() if api_key else None
        # The operator routes' own key, when one is set: there it replaces api_key (a client key drains nothing).
        self.admin_expected = admin_key.encode() if admin_key else None
        self.public_paths = frozenset(public_paths)
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        admin = self.admin_expected is not None and scope.get("path", "").startswith(ADMIN_PREFIX)
        expected = self.admin_expected if admin else self.expected
        if (
            expected is None
            or scope["type"] not in ("http", "websocket")
            or scope["path"] in self.public_paths
            or self._authorized(scope, expected)
        ):
            await self.app(scope, receive, send)
            return
        if admin:
            message = ("missing or wrong admin key: the operator routes (/v1/admin/) take admin_api_key, not the "
                       "clients' api_key; send the header 'Authorization: Bearer <admin key>'")
        else:
            message = ("missing or wrong API key; send the header 'Authorization: Bearer <key>' (query-string keys "
                       "are ignored)")
        if scope["type"] == "websocket":  # a browser cannot set that header on a WebSocket
            message += ("; a browser's WebSocket offers the subprotocol 'wm-refiner.bearer.<key as base64url, "
                        "unpadded>' instead")
        error = ApiError("unauthorized", message)
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

    def _authorized(self, scope, expected: bytes) -> bool:
        # One credential of each kind per request: Authorization is a singleton field (RFC 9110 11.6.2), and a
        # request that carried many (headers, or bearer subprotocols on a WebSocket) tried that many keys at once:
        # 2,000 guesses fit in one request head under max_header_bytes.
        headers: list[bytes] = []
        keys: list[bytes] = []
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                headers.append(value)
            elif name == b"sec-websocket-protocol" and scope["type"] == "websocket":
                for protocol in value.split(b","):
                    if protocol.strip().startswith(BEARER_SUBPROTOCOL):
                        keys.append(protocol.strip())
        if len(headers) > 1 or len(keys) > 1:
            return False
        for value in headers:
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected):
                return True
        for protocol in keys:
            key = _subprotocol_key(protocol)
            if key is not None and hmac.compare_digest(key, expected):
                return True
        return False


def _subprotocol_key(protocol: bytes) -> bytes | None:
    """The key a ``wm-refiner.bearer.<base64url>`` subprotocol carries; None for any other subprotocol."""
    if not protocol.startswith(BEARER_SUBPROTOCOL):
        return None
    encoded = protocol[len(BEARER_SUBPROTOCOL) :]
    if not _BASE64URL.fullmatch(encoded) or len(encoded) % 4 == 1:
        return None
    return base64.urlsafe_b64decode(encoded + b"=" * (-len(encoded) % 4))
