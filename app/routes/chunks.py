"""POST /v1/sessions/{id}/chunks: frames in, the frames they finalize out; all or nothing."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import Response

from ..codec import OCTET_STREAM, PROMPT_EMBEDS, PROMPT_MASK, decode
from ..deps import (
    OCTET_BODY,
    OCTET_RESPONSE,
    PlainInteger,
    ServicesDep,
    check_payload,
    read_body,
    reject_unknown_query,
    require_content_type,
    units_payload,
)
from ..engine import ChunkJob
from ..openapi import errors

router = APIRouter(tags=["sessions"])
CHUNK_QUERY = frozenset({"seq", "flush"})


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
    reject_unknown_query(request, CHUNK_QUERY)
    services.require_ready()
    settings = services.settings
    registry = services.registry
    handle = registry.get(session_id)
    require_content_type(request, OCTET_STREAM)
    handle.requests_in_flight += 1
    try:
        body = await read_body(request, settings.max_body_bytes)
        tensors = decode(body)
        latents = check_payload(tensors, settings, settings.max_frames_per_chunk, "max_frames_per_chunk")
        lane = handle.lane
        shape = tuple(latents.shape)

        def finalize(units, state) -> bytes:
            # Runs on the engine thread before the lane's counter moves on: next_seq is this chunk's index.
            return units_payload(units, state, shape, settings.response_dtype, {"seq": lane.next_seq})

        job = ChunkJob(
            lane,
            latents,
            tensors.get(PROMPT_EMBEDS),
            tensors.get(PROMPT_MASK),
            flush=flush,
            seq=seq,
            atomic=True,
            finalize=finalize,
        )
        result = await services.engine.run(job)
    finally:
        handle.requests_in_flight -= 1
        registry.touch(handle)
    headers = {"X-Replayed": "true"} if result.replayed else {}
    return Response(result.value, media_type=OCTET_STREAM, headers=headers)
