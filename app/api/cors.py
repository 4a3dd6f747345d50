"""Cross-origin access for browser pages served from another origin (``cors_origins``).

One allow-list, two mechanisms, because browsers treat the two protocols differently:

- HTTP: the browser enforces CORS. Starlette's ``CORSMiddleware`` answers the preflight ``OPTIONS`` and adds
  ``Access-Control-Allow-Origin`` to every answer for an allowed origin. It wraps every other middleware, so a
  preflight never reaches the API-key check (a browser never sends credentials on a preflight: refusing it with
  401 would fail every authenticated cross-origin call), and the error answers (401, 404, 422, 503...) carry the
  headers too: without them the page could not read the JSON error, only "network error". CORS only keeps a
  foreign page from *reading* an answer: a request a browser sends without a preflight (a ``POST`` with no body
  or no ``Content-Type``, which this API accepts) still runs. So a request that changes something (any method but
  ``GET``, ``HEAD`` and ``OPTIONS``) whose ``Origin`` is neither listed nor this server's own is refused with 403
  ``origin_not_allowed`` before it reaches a route, as a WebSocket handshake is: a page on another origin could
  otherwise create sessions until ``max_sessions``, flush or delete one, or drain the server (``POST
  /v1/admin/drain`` without a key). Its preflights get the same 403 and JSON error (not Starlette's plain-text 400),
  so the developer who reads the answer in devtools or curl learns which setting to change.
- WebSocket: browsers apply no CORS at all to a WebSocket; they only send ``Origin`` on the handshake, and it is
  the server's to check. With ``cors_origins`` set, a handshake whose ``Origin`` is neither on the list nor this
  server's own (the view page at ``/view``) is refused with 403 ``origin_not_allowed`` before it reaches auth or
  a route. A handshake without ``Origin`` comes from a program, not a browser page, and is allowed: ``Origin`` is
  what a browser sends, never a credential.

Decisions: the default is no list: no CORS headers are sent, and WebSocket handshakes are not checked (the API key
is the protection; the key is a header or a subprotocol the page must know, never a cookie that a foreign page's
browser would send along). ``*`` allows every origin. Credentials (cookies) are never allowed: the key travels in
``Authorization``, which the preflight allows explicitly.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable
from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware

from app.core.error_kinds import WS_POLICY_VIOLATION, ApiError

# What a cross-origin page may send beyond the CORS-safelisted headers: the key, and Content-Type for JSON and
# application/octet-stream bodies (Starlette always allows Content-Type; named here for the reader).
ALLOW_HEADERS = ("Authorization", "Content-Type")
# Response headers a page may read besides the safelisted ones.
EXPOSE_HEADERS = ("Retry-After", "X-Replica", "X-Replayed", "WWW-Authenticate")
# What a browser may send cross-origin and the API answers without changing anything (a request of any other
# method from an unlisted origin is refused: see the module's docstring).
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
ALLOW_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS")


class CrossOrigin:
    """The ``cors_origins`` policy for HTTP (CORS) and WebSocket handshakes (the ``Origin`` check)."""

    def __init__(self, app, origins: Iterable[str], on_reject: Callable[[ApiError], None] | None = None):
        self.app = app
        self.origins = frozenset(origins)
        self.any_origin = "*" in self.origins
        self.on_reject = on_reject
        self.http = CORSMiddleware(
            app,
            allow_origins=sorted(self.origins),
            allow_methods=ALLOW_METHODS,
            allow_headers=ALLOW_HEADERS,
            expose_headers=EXPOSE_HEADERS,
        )

    async def __call__(self, scope, receive, send) -> None:
        if not self.origins:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            what = self._refused_http(scope)
            if what is not None:
                await self._refuse_http(scope, send, what)
                return
            await self.http(scope, receive, send)
        elif scope["type"] == "websocket" and not self.origin_allowed(scope):
            await self._refuse(scope, send)
        else:
            await self.app(scope, receive, send)

    def _refused_http(self, scope) -> str | None:
        """What an HTTP request from an unlisted origin is, when it is refused here (``None``: let it through): a
        request that changes something, or a preflight (Starlette's own refusal of one is a plain-text 400 that
        says nothing of the setting; a browser shows neither, but the developer's curl and devtools do)."""
        method = scope.get("method", "GET")
        preflight = method == "OPTIONS" and any(name == b"access-control-request-method"
                                                for name, _ in scope.get("headers", ()))
        if (method in _SAFE_METHODS and not preflight) or self.origin_allowed(scope):
            return None
        if preflight:
            asked = dict(scope["headers"])[b"access-control-request-method"].decode("latin-1")
            return f"a CORS preflight for a {asked}"
        return f"a {method}"

    async def _refuse_http(self, scope, send, what: str) -> None:
        headers, body = self._refusal(scope, what, "send it")
        await send({"type": "http.response.start", "status": 403, "headers": [*headers, (b"vary", b"Origin")]})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope, what: str, fix: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """The 403 ``origin_not_allowed`` answer's headers and body (``on_reject`` told) for ``what`` came from an
        unlisted page."""
        origin = dict(scope.get("headers", ())).get(b"origin", b"").decode("latin-1")
        error = ApiError(
            "origin_not_allowed",
            f"{what} from a page on origin {origin!r}, which is not in this server's cors_origins; add it to "
            f"cors_origins (WM_REFINER_CORS_ORIGINS), or {fix} from an allowed origin",
        )
        if self.on_reject is not None:
            self.on_reject(error)
        body = json.dumps(error.envelope()).encode()
        return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body

    def origin_allowed(self, scope) -> bool:
        """No `Origin` (a program), an allowed one, or this server's own (its /view page)."""
        headers = dict(scope.get("headers", ()))
        origin = headers.get(b"origin")
        if origin is None or self.any_origin:
            return True
        origin_text = origin.decode("latin-1").lower()
        if origin_text in self.origins:
            return True
        # This server's own pages (the view page): the Origin's host:port is the Host the browser connected to.
        host = headers.get(b"host")
        return host is not None and urlsplit(origin_text).netloc == host.decode("latin-1").lower()

    async def _refuse(self, scope, send) -> None:
        headers, body = self._refusal(scope, "WebSocket", "connect")
        if "websocket.http.response" in scope.get("extensions", {}):
            await send({"type": "websocket.http.response.start", "status": 403, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:  # a server without the denial-response extension: refuse the handshake the only way left
            await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION, "reason": "origin_not_allowed"})
