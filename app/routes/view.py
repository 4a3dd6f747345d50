"""The live view: ``GET /view``, a browser page that lists the sessions, watches one over
``WS /v1/sessions/{id}/watch`` and plays its video as it is refined, with a per-block latency chart.

One self-contained file (app/static/view.html: no build step, nothing fetched from elsewhere, so it works offline
and behind any firewall), shipped as package data and read through ``importlib.resources``. The page itself holds
no data, so it is public (app.main.PUBLIC_PATHS); when the server has an API key the page asks for it and sends it
with its own requests. It is left out of the OpenAPI schema: a page for people, not an operation for clients.
"""

from __future__ import annotations

import functools
from importlib.resources import files

from fastapi import APIRouter
from starlette.responses import HTMLResponse

router = APIRouter(tags=["view"])

# What the page may load: its own inline script and style, and requests to this origin; nothing else (a
# regression that pulls a script or font from a CDN fails in the browser test instead of silently needing a network).
# media-src blob: is the page's own MediaSource (H.264 segments from the watch), never a remote medium.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; media-src blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@functools.cache
def page() -> str:
    return files("app").joinpath("static", "view.html").read_text(encoding="utf-8")


@router.get("/view", response_class=HTMLResponse, include_in_schema=False)
async def view() -> HTMLResponse:
    """The live view page."""
    return HTMLResponse(
        page(), headers={"content-security-policy": CONTENT_SECURITY_POLICY, "cache-control": "no-cache"}
    )
