"""The live view: ``GET /view``, a browser page that lists the sessions, watches one over
``WS /v1/sessions/{id}/watch`` and plays its video as it is refined, with a per-block latency chart; and
``GET /static/wm-refiner.js``, the ES module that speaks the protocol (the page imports it; so may any web app), and
``GET /static/wm-refiner.d.ts``, its TypeScript declarations.

All are files of app/static (no build step, nothing fetched from another origin, so the page works offline and
behind any firewall), shipped as package data and read through ``importlib.resources``. The page itself holds no
data, so it is public (``PUBLIC_PATHS``, which app.api.factory adds to its own); when the server has an API key the page asks
for it and sends it with its own requests. Both are left out of the OpenAPI schema: a page for people and a file,
not operations for clients.

The module (and its declarations) is public for the same reason: it is code, no data, and a browser fetches a module script (``import``,
``<script type="module">``) without an ``Authorization`` header, so a key-protected module could not be imported by
the very pages that hold the key. Only the files named in ``STATIC_FILES`` are served: no directory is exposed
(app/static also holds asyncapi.yaml, served at ``/asyncapi.yaml`` behind the key like the rest of the API).
"""

from __future__ import annotations

import functools
from importlib.resources import files

from fastapi import APIRouter
from starlette.responses import HTMLResponse, Response

router = APIRouter(tags=["view"])

# What the page may load: its own inline script and style, and requests to this origin; nothing else (a
# regression that pulls a script or font from a CDN fails in the browser test instead of silently needing a network).
# media-src blob: is the page's own MediaSource (H.264 segments from the watch), never a remote medium.
# script-src 'self': the page's module imports ./static/wm-refiner.js from this origin (beside the page, so under the
# same path prefix when a reverse proxy serves this server under one; docs/api.md "Behind a reverse proxy").
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; media-src blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


# URL path -> (file in app/static, content type, headers of its own). JavaScript is text/javascript (RFC 9239);
# browsers refuse a module served as anything but a JavaScript type. The module's TypeScript declarations sit beside
# it, for pages written in TypeScript (docs/api.md, "TypeScript"); TypeScript has no registered media type,
# application/typescript is the one its tools (Deno) read as TypeScript. The module names them in X-TypeScript-Types,
# where Deno looks for the types of a module imported by URL; relative, as Deno resolves it against the module's URL,
# so it names the file beside the module whatever path a proxy serves this server under (the server does not know it).
STATIC_FILES = {
    "/static/wm-refiner.js": ("wm-refiner.js", "text/javascript; charset=utf-8",
                              {"x-typescript-types": "./wm-refiner.d.ts"}),
    "/static/wm-refiner.d.ts": ("wm-refiner.d.ts", "application/typescript; charset=utf-8", {}),
}
# Served without the API key (app.api.factory adds them to its PUBLIC_PATHS).
PUBLIC_PATHS = frozenset({"/view", *STATIC_FILES})


@functools.cache
def static_text(name: str) -> str:
    return files("app").joinpath("static", name).read_text(encoding="utf-8")


def page() -> str:
    return static_text("view.html")


@router.get("/view", response_class=HTMLResponse, include_in_schema=False)
async def view() -> HTMLResponse:
    """The live view page."""
    return HTMLResponse(
        page(), headers={"content-security-policy": CONTENT_SECURITY_POLICY, "cache-control": "no-cache"}
    )


def _serve_static(path: str, name: str, media_type: str, headers: dict[str, str]) -> None:
    async def serve() -> Response:
        # no-cache: revalidated on each load, so a page never runs a module older than the server it talks to.
        return Response(static_text(name), media_type=media_type,
                        headers={"cache-control": "no-cache", "x-content-type-options": "nosniff", **headers})

    serve.__doc__ = f"app/static/{name}"
    router.add_api_route(path, serve, methods=["GET"], include_in_schema=False, name=f"static:{name}")


for _path, (_name, _media_type, _headers) in STATIC_FILES.items():
    _serve_static(_path, _name, _media_type, _headers)
