"""The FastAPI app factory: ``create_app(settings)``.

Everything the app holds (``app.runtime.services.Services``: engine, registry, metrics, the loaded refiner) is built per
app and reached through ``app.state.services``; nothing is created at import time, so tests can run several
apps in one process. The lifespan starts the services and, on shutdown, drains them.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from typing import Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.routing import iter_route_contexts
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, WebSocketRoute, compile_path
from starlette.websockets import WebSocket

from models.errors import RefinerError

from app.api.auth import ApiKeyMiddleware
from app.api.cors import CrossOrigin
from app.api.deps import QUERY_RULE, declared_query, reject_unknown_query
from app.api.openapi import document_api_key
from app.api.routes import admin, chunks, health, info, prometheus, refine, sessions, stream, view, watch
from app.api.routes.stream import deny
from app.core.error_kinds import ApiError, envelope, from_exception
from app.core.settings import Settings
from app.engine.engine_errors import EngineError
from app.runtime.services import Services

log = logging.getLogger("app")

# Probes and scrapers must work without credentials (orchestrators and Prometheus rarely carry them). The view page
# holds no data; it asks for the key and sends it with the requests it makes; nor does the JS module it imports.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics", *view.PUBLIC_PATHS})
# Pages whose query is read by their own script in the browser (the view's ?session= and ?format=), not by the
# server, and the static files they import (a cache-busting ?v= is the page's business): the query rule
# (QueryRule) leaves them alone.
BROWSER_PAGES = frozenset(view.PUBLIC_PATHS)


# Relative, not "/asyncapi.yaml": resolved against the page that shows it (/docs, /redoc) or against /openapi.json
# itself, it names the document beside them, also behind a proxy that serves this server under a path prefix
# (/refiner/docs -> /refiner/asyncapi.yaml; docs/api.md "Behind a reverse proxy"), where the origin's root is not ours.
ASYNCAPI_LINK = ("The WebSocket routes (`/v1/sessions/{id}/stream`, `/v1/sessions/{id}/watch`) and their messages: "
                 "[asyncapi.yaml](asyncapi.yaml) (AsyncAPI 3.0).")


# --- the app ---------------------------------------------------------------------------------------------
def create_app(settings: Settings | None = None, *, warmup_gate: Callable[[], None] | None = None) -> FastAPI:
    """The service. ``warmup_gate`` (tests) runs on the engine thread before the warm-up and may block it."""
    settings = settings or Settings()
    services = Services(settings, warmup_gate=warmup_gate)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await services.start()
        except BaseException:
            await services.abort_start()  # nothing was served: no drain, no "drain done"
            raise
        try:
            yield
        finally:
            await services.stop()

    app = FastAPI(
        title="wm-refiner",
        version="1",
        summary="Streaming SANA-WM stage-2 refiner: latent chunks in, refined latents out",
        # The WebSocket routes (/stream, /watch) and their messages are described in AsyncAPI, beside this document
        # (a relative link: OpenAPI's externalDocs wants an absolute URL, which a server behind a router cannot know).
        description=f"{QUERY_RULE}\n\n{ASYNCAPI_LINK}",
        lifespan=lifespan,
        docs_url=None, redoc_url=None,  # add_docs_pages serves them, with the schema's URL relative
    )
    app.state.services = services
    for module in (health, prometheus, info, sessions, chunks, refine, stream, watch, admin, view):
        app.include_router(module.router)
    add_docs_pages(app)

    install_error_handlers(app, services)
    if settings.api_key:
        document_api_key(app, PUBLIC_PATHS)
    # Innermost: after the API key (a caller without it learns nothing about the routes), before any route runs.
    app.add_middleware(QueryRule, services=services)
    app.add_middleware(HeadAsGet)
    # Errors raised by the routes, not by the middlewares around them.
    app.add_middleware(AnswerUnexpectedErrors, services=services)
    app.add_middleware(
        ApiKeyMiddleware, api_key=settings.api_key, public_paths=PUBLIC_PATHS, on_reject=services.reject,
        admin_key=settings.admin_api_key,
    )
    app.add_middleware(HttpMetricsMiddleware, services=services)
    # A preflight is answered before the API-key check, and every answer (errors too) gets the CORS headers; a
    # request or WebSocket from a foreign origin is refused before anything else sees it (app.api.cors).
    app.add_middleware(CrossOrigin, origins=settings.cors_origins, on_reject=services.reject)
    # Outermost: every answer says its replica, the CORS refusals and preflights included.
    app.add_middleware(ReplicaHeader, replica_id=settings.replica_id)
    return app


def add_docs_pages(app: FastAPI) -> None:
    """FastAPI's /docs (Swagger UI, with its OAuth2 redirect page) and /redoc, as FastAPI serves them but for the
    schema's URL: relative to the page, ``openapi.json`` (beside /docs and /redoc), where FastAPI writes
    ``/openapi.json``. Behind a proxy that serves this server under a path prefix, /refiner/docs then loads
    /refiner/openapi.json, not the origin's root, which is not this server's (docs/api.md "Behind a reverse proxy")."""

    async def swagger_ui(request: Request) -> Response:
        return get_swagger_ui_html(
            openapi_url="openapi.json", title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=app.swagger_ui_oauth2_redirect_url, init_oauth=app.swagger_ui_init_oauth,
            swagger_ui_parameters=app.swagger_ui_parameters,
        )

    async def swagger_ui_redirect(request: Request) -> Response:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> Response:
        return get_redoc_html(openapi_url="openapi.json", title=f"{app.title} - ReDoc")

    app.add_route("/docs", swagger_ui, include_in_schema=False)
    app.add_route(app.swagger_ui_oauth2_redirect_url, swagger_ui_redirect, include_in_schema=False)
    app.add_route("/redoc", redoc, include_in_schema=False)


class ReplicaHeader:
    """``X-Replica: <replica_id>`` on every HTTP response and WebSocket handshake answer, so that behind a router a
    client (and an operator) sees which replica served it."""

    def __init__(self, app, replica_id: str):
        self.app = app
        self.header = (b"x-replica", replica_id.encode("latin-1", "replace"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        async def tagged(message) -> None:
            if message["type"] in ("http.response.start", "websocket.http.response.start"):
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            elif message["type"] == "websocket.accept":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


def error_response(error: ApiError, services: Services) -> JSONResponse:
    services.reject(error)
    return JSONResponse(
        error.envelope(), status_code=error.status, headers=error.headers(services.settings.retry_after_s)
    )


def methods_at(app, path: str) -> set[str]:
    """The methods the routes at ``path`` declare (several routes may share a path)."""
    methods: set[str] = set()
    for context in iter_route_contexts(app.routes):
        if context.methods and compile_path(context.path)[0].fullmatch(path):
            methods |= context.methods
    return methods


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path. Starlette's 405 names only the first route whose path matches,
    and several routes share a path (``GET`` and ``POST /v1/sessions``). HEAD wherever GET is (``HeadAsGet``)."""
    methods = methods_at(request.app, request.url.path)
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods | {"OPTIONS"})


class HeadAsGet:
    """HEAD on a path whose routes serve GET but do not declare HEAD: the GET's status and headers without its body
    (RFC 9110, 9.3.2). FastAPI's routes serve only the methods they name, so HEAD was a 405 on every GET route but
    the probes while ``Allow`` named it. Inside the API-key check and the metrics (they see HEAD), outside the
    query rule (it checks the GET route's parameters)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        methods = methods_at(scope["app"], scope["path"])
        if "HEAD" in methods or "GET" not in methods:
            await self.app(scope, receive, send)
            return

        async def headless(message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        # A copy: the server's own scope must still say HEAD (uvicorn then expects no body: told GET, it refused the
        # empty body as shorter than Content-Length). What the router writes into the copy (its route, which the
        # metrics outside label the request with) is carried back.
        inner = {**scope, "method": "GET"}
        try:
            await self.app(inner, receive, headless)
        finally:
            for key in ("route", "endpoint", "path_params"):
                if key in inner:
                    scope[key] = inner[key]


def install_error_handlers(app: FastAPI, services: Services) -> None:
    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(from_exception(exc), services)

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err.get("loc", ()))
            problems.append(f"{where}: {err.get('msg')}")
        message = "invalid request: " + "; ".join(problems) + "; see GET /openapi.json for the accepted values"
        return error_response(ApiError("invalid_request", message), services)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = _no_route(request.url.path)
        elif exc.status_code == 405:
            allowed = allowed_methods(request)
            if request.method == "OPTIONS":  # what may be done here (RFC 9110 9.3.7); a CORS preflight never
                # gets here: app.api.cors answers it when cors_origins is set
                return Response(status_code=204, headers={"Allow": ", ".join(allowed)})
            error = ApiError("method_not_allowed", f"{request.method} is not allowed on {request.url.path}; "
                                                   f"allowed: {', '.join(allowed)}")
            exc.headers = {**(exc.headers or {}), "Allow": ", ".join(allowed)}
        else:
            services.metrics.rejected_requests.labels(reason=f"http_{exc.status_code}").inc()
            return JSONResponse(
                envelope(f"http_{exc.status_code}", str(exc.detail)), status_code=exc.status_code, headers=exc.headers
            )
        response = error_response(error, services)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(from_exception(exc), services)

    http_default = app.router.default

    async def no_route(scope, receive, send) -> None:
        # Starlette refuses a WebSocket handshake on a path no route matches with a bare close, which uvicorn turns
        # into "403 Forbidden" and no body: a client whose base URL is wrong (/v1/v1/..., a typo in the id's path)
        # read it as a refused key or origin. The 404 and envelope an HTTP request gets instead.
        if scope["type"] == "websocket":
            error = _no_route(scope.get("path", ""), websocket=True)
            await deny(WebSocket(scope, receive, send), error, services)
            return
        await http_default(scope, receive, send)

    app.router.default = no_route
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RefinerError, api_error)
    app.add_exception_handler(EngineError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


_WEBSOCKET_PATH = re.compile(r"^/v1/sessions/[^/]+/(stream|watch)$")


def _no_route(path: str, websocket: bool = False) -> ApiError:
    # A client given the API's own path as its base (http://host:8000/v1) asks for /v1/v1/...
    hint = (f"; the client's base URL seems to end in /v1: give it without (this path would be "
            f"{path[3:]})") if path.startswith("/v1/v1/") else ""
    if websocket:
        return ApiError("not_found", f"no WebSocket route {path}{hint}; the WebSockets are "
                                     "/v1/sessions/{id}/stream and /v1/sessions/{id}/watch (docs/api.md)")
    if _WEBSOCKET_PATH.match(path):  # a browser's address bar or curl on a WebSocket route
        return ApiError("not_found", f"{path} is a WebSocket route: open it with a WebSocket client (ws:// or "
                                     "wss://, e.g. the Python client's session.stream(...) or watch()), not an "
                                     "HTTP request (docs/api.md)")
    return ApiError("not_found", f"no route {path}{hint}; /openapi.json lists the routes "
                                 "(docs/api.md describes them)")


class ResponseStart:
    """An ASGI ``send`` that notes the status once the response has started (None before)."""

    def __init__(self, send):
        self.send = send
        self.status: int | None = None

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


class AnswerUnexpectedErrors:
    """A bug or a device failure in a route (say, a forward out of memory) answers 500 with the envelope, like
    every other error, on a connection that stays usable.

    Starlette's catch-all ``Exception`` handler would answer too, but it then re-raises to the server, and
    uvicorn closes the connection right after the response; found by tests/app/api/test_bad_input.py, the client
    could read a connection reset instead of the 500.
    """

    def __init__(self, app, services: Services):
        self.app = app
        self.services = services

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = ResponseStart(send)
        try:
            await self.app(scope, receive, response)
        except Exception as exc:
            if response.status is not None:  # too late for a clean answer; let the server end the connection
                raise
            log.error("unhandled error on %s %s", scope["method"], scope["path"], exc_info=exc)
            await error_response(from_exception(exc), self.services)(scope, receive, send)


class QueryRule:
    """The query rule (``QUERY_RULE``), in one place for every route of the API, HTTP and WebSocket alike: an unknown
    or repeated query parameter is refused with 422 ``invalid_request`` before the route runs
    (``deps.reject_unknown_query``). What a route takes is what it declares (``deps.declared_query``: its signature
    and its dependencies', the same that /openapi.json documents), so a new route or parameter needs no list kept
    by hand. A WebSocket is refused at the handshake like any other refusal of it (``routes.stream.deny``).

    Left alone: FastAPI's own pages (/docs, /redoc, /openapi.json: no ``dependant``), ``BROWSER_PAGES``, and a
    path no route fully matches (404 and 405 are answered as before)."""

    def __init__(self, app, services: Services):
        self.app = app
        self.services = services
        self._routes: list[tuple[object, frozenset[str]]] | None = None

    def routes(self, app: FastAPI) -> list[tuple[object, frozenset[str]]]:
        """(route, the query parameters it takes) for each route the rule covers; read once, on the first request,
        when every router has been included."""
        if self._routes is None:
            self._routes = [
                (context, declared_query(context.original_route.dependant))
                for context in iter_route_contexts(app.routes)
                if getattr(context.original_route, "dependant", None) is not None and context.path not in BROWSER_PAGES
            ]
        return self._routes

    def takes(self, scope) -> frozenset[str] | None:
        """What the route serving ``scope`` takes; None when the rule does not cover it."""
        for route, known in self.routes(scope["app"]):
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return known
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("query_string"):
            known = self.takes(scope)
            if known is not None:
                try:
                    reject_unknown_query(QueryParams(scope["query_string"]), known)
                except ApiError as error:
                    if scope["type"] == "http":
                        await error_response(error, self.services)(scope, receive, send)
                    else:
                        await deny(WebSocket(scope, receive, send), error, self.services)
                    return
        await self.app(scope, receive, send)


class HttpMetricsMiddleware:
    """Request latency by route template (``/v1/sessions/{session_id}``, never the raw path), method, status."""

    def __init__(self, app, services: Services):
        self.app = app
        self.services = services

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        response = ResponseStart(send)
        try:
            await self.app(scope, receive, response)
        finally:
            status = 500 if response.status is None else response.status
            self.services.metrics.http_request_duration.labels(
                route=self._template(scope), method=scope["method"], status=str(status)
            ).observe(time.perf_counter() - started)

    def _template(self, scope) -> str:
        route = scope.get("route")
        if route is not None and getattr(route, "path", None):
            return route.path
        # Requests refused before routing (401) still belong to a route; match it without running it (a HEAD as the
        # GET it is answered as: HeadAsGet).
        app = scope.get("app")
        probe = {**scope, "method": "GET"} if scope.get("method") == "HEAD" else scope
        for candidate in iter_route_contexts(getattr(app, "routes", ())):
            match, _ = candidate.matches(probe)
            if match == Match.FULL:
                return candidate.path
        return "unmatched"


def registered_routes(app: FastAPI) -> list[tuple[str, frozenset[str], bool]]:
    """Every route the app serves, through included routers: (path template, methods, is_websocket)."""
    routes = []
    for context in iter_route_contexts(app.routes):
        websocket = isinstance(context.original_route, WebSocketRoute) or context.methods is None
        routes.append((context.path, frozenset(context.methods or ()), websocket))
    return routes
