"""POST /v1/sessions/{id}/chunks: frames in, the frames they finalize out; all or nothing. An empty body with
``flush=true`` flushes without new frames (the stream's ``{"type": "flush"}``); the response's metadata carries
the chunk's ``seq`` and its ``latency_ms`` (api.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import Response

from app.api.deps import OCTET_BODY, PlainInteger, ServicesDep, read_body, require_content_type
from app.api.openapi import CHUNK_400, CHUNK_409, CHUNK_RESPONSE, errors
from app.core.codec import OCTET_STREAM

router = APIRouter(tags=["sessions"])
# The body may be empty with flush=true: a flush without new frames.
CHUNK_BODY = {"requestBody": {**OCTET_BODY["requestBody"], "required": False,
                              "description": OCTET_BODY["requestBody"]["description"] + "; or empty with flush=true: "
                              "refine the pending frames as the final block without new frames"}}


@router.post(
    "/v1/sessions/{session_id}/chunks",
    openapi_extra=CHUNK_BODY,
    response_class=Response,  # not FastAPI's default JSON: /openapi.json then lists only the octet-stream 200
    responses={**CHUNK_RESPONSE,
               **errors(400, 401, 404, 409, 410, 413, 415, 422, 500, 503, when={400: CHUNK_400, 409: CHUNK_409})},
)
async def post_chunk(
    session_id: str,
    request: Request,
    services: ServicesDep,
    seq: Annotated[
        int | None,
        Query(ge=0, description="counts accepted chunks from 0; repeat the last, with the same body and flush, to retry"),
        PlainInteger,
    ] = None,
    flush: Annotated[bool, Query(description="also refine the pending frames as a final block and end the stream; "
                                             "the body may then be empty")] = False,
) -> Response:
    async def read_payload() -> bytes:
        require_content_type(request, OCTET_STREAM)
        return await read_body(request, services.settings.max_body_bytes)

    payload, replayed = await services.sessions.submit_chunk(session_id, seq, flush, read_payload)
    return Response(payload, media_type=OCTET_STREAM, headers={"X-Replayed": "true"} if replayed else {})
