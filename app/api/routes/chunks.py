"""POST /v1/sessions/{id}/chunks: frames in, the frames they finalize out; all or nothing."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import Response

from app.api.deps import OCTET_BODY, OCTET_RESPONSE, PlainInteger, ServicesDep, read_body, require_content_type
from app.api.openapi import errors
from app.core.codec import OCTET_STREAM

router = APIRouter(tags=["sessions"])


@router.post(
    "/v1/sessions/{session_id}/chunks",
    openapi_extra=OCTET_BODY,
    responses={**OCTET_RESPONSE, **errors(400, 401, 404, 409, 410, 413, 415, 422, 500, 503)},
)
async def post_chunk(
    session_id: str,
    request: Request,
    services: ServicesDep,
    seq: Annotated[
        int | None, Query(ge=0, description="counts accepted chunks from 0; repeat the last to retry"), PlainInteger
    ] = None,
    flush: Annotated[bool, Query(description="also refine the pending frames as a final block and end the stream")] = False,
) -> Response:
    async def read_payload() -> bytes:
        require_content_type(request, OCTET_STREAM)
        return await read_body(request, services.settings.max_body_bytes)

    payload, replayed = await services.sessions.submit_chunk(session_id, seq, flush, read_payload)
    return Response(payload, media_type=OCTET_STREAM, headers={"X-Replayed": "true"} if replayed else {})
