"""POST /v1/refine: a whole clip in, the whole refined clip out, through a throwaway session.

A clip is admitted like a session: while it is refined it holds one of ``max_sessions`` places (503
``too_many_sessions`` when none is free), and its memory is bounded by ``max_clip_frames`` and ``max_body_bytes``.
In the engine it is one more session: its forwards take turns (and share model calls) with the streams', so a long
clip cannot hold the engine. A client that goes away stops its clip at the next block.

The response's metadata has ``seq`` 0 (the clip is its throwaway session's one chunk, so a client reads every
refined payload the same way) and ``latency_ms`` from the body having been read to the clip's payload being ready.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from starlette.requests import Request
from starlette.responses import Response

from wm_refiner_client import spec

from app.api.deps import OCTET_BODY, PlainInteger, ServicesDep, read_body, require_content_type, until_client_leaves
from app.api.openapi import REFINE_400, REFINE_RESPONSE, errors
from app.api.routes.sessions import check_fields
from app.core.codec import OCTET_STREAM
from app.core.error_kinds import ApiError

log = logging.getLogger("app")
router = APIRouter(tags=["refine"])
# Lists and the look-ahead arrive as text (``outputs=latents,video``, ``video_lookahead=2``); these bound the text.
_TEXT_MAX_LENGTH = {spec.CHOICES: 32, spec.LOOKAHEAD: 16}
# A clip whose body is over max_body_bytes (a 720p clip of the released refiner: 450 KB a frame in float32) goes
# as a session's chunks, which have no length limit.
CLIP_ADVICE = ("(max_body_bytes); send a clip this long as a session's chunks instead (POST /v1/sessions, then "
               "its frames in chunks or over its WebSocket stream: any length), or raise max_body_bytes")


def _query_annotation(field: spec.SessionField) -> Any:
    """How /v1/refine declares ``field`` as a query parameter (and so documents it in /openapi.json)."""
    if field.kind == spec.WORD_OR_INTEGER:  # the word or digits: the form stated, so /openapi.json says it
        return Annotated[str | None, Query(max_length=_TEXT_MAX_LENGTH[field.kind], pattern=f"^({field.word}|[0-9]+)$",
                                           description=field.doc)]
    if field.kind in _TEXT_MAX_LENGTH:
        return Annotated[str | None, Query(max_length=_TEXT_MAX_LENGTH[field.kind], description=field.doc)]
    lower = {"gt" if field.exclusive_minimum else "ge": field.minimum} if field.minimum is not None else {}
    query = Query(**lower, le=field.maximum, description=field.doc)
    if field.kind == spec.INTEGER:
        return Annotated[int | None, query, PlainInteger]
    if field.kind == spec.NUMBER:
        return Annotated[float | None, query]
    if field.kind == spec.CHOICE:
        return Annotated[Literal[field.choices] | None, Query(description=field.doc)]
    raise AssertionError(f"/v1/refine cannot take field {field.name} ({field.kind}) as a query parameter")


def session_query(**values: Any) -> dict[str, Any]:
    """The session fields given in the query (lists and the look-ahead still as text)."""
    return {name: value for name, value in values.items() if value is not None}


def query_fields(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` as JSON values: text read by the spec, as the command line's flags are."""
    fields = dict(given)
    for name, value in given.items():
        field = spec.BY_NAME[name]
        if isinstance(value, str) and field.kind in _TEXT_MAX_LENGTH:
            try:
                fields[name] = field.from_text(value)
            except ValueError as exc:
                raise ApiError("invalid_config", str(exc)) from None
    return fields


# FastAPI reads a dependency's parameters from its signature; this one's comes from the spec.
session_query.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_query_annotation(spec.BY_NAME[name]))
    for name in spec.QUERY_NAMES
])


@router.post(
    "/v1/refine",
    openapi_extra=OCTET_BODY,
    response_class=Response,  # not FastAPI's default JSON: /openapi.json then lists only the octet-stream 200
    responses={**REFINE_RESPONSE, **errors(400, 401, 413, 415, 422, 500, 503, when={400: REFINE_400})},
)
async def refine(
    request: Request,
    services: ServicesDep,
    given: Annotated[dict[str, Any], Depends(session_query)],
) -> Response:
    body_read = asyncio.Event()

    async def read_payload() -> bytes:
        require_content_type(request, OCTET_STREAM)
        data = await read_body(request, services.settings.max_body_bytes, CLIP_ADVICE)
        body_read.set()
        return data

    # A client that closes its connection stops its clip (at the engine's next block) and frees its place: nobody
    # is left to take the result.
    payload = await until_client_leaves(
        request, services.sessions.refine_clip(lambda: check_fields(query_fields(given)), read_payload), body_read)
    if payload is None:
        log.info("a /v1/refine client went away before its clip was refined: stopped")
        return Response(status_code=499)  # never sent: the connection is closed (nginx's "client closed request")
    return Response(payload, media_type=OCTET_STREAM)
