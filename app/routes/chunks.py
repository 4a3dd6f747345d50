"""POST /v1/sessions/{id}/chunks: frames in, the frames they finalize out; all or nothing."""

from __future__ import annotations

import asyncio
import time
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
)
from ..engine import Work
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
    handle = await services.lookup(session_id)
    require_content_type(request, OCTET_STREAM)
    handle.requests_in_flight += 1
    try:
        received = time.perf_counter()
        body = await read_body(request, settings.max_body_bytes)
        tensors = decode(body)
        latents = check_payload(tensors, settings, settings.max_frames_per_chunk, "max_frames_per_chunk",
                                services.require_model().info.in_channels)
        # Once the chunk is handed over it runs to the end and is counted even if this request goes away, so a
        # retry of its seq gets the stored response instead of appending the frames twice.
        chunk = asyncio.ensure_future(_chunk(services, handle, seq, flush, tensors, latents, received))
        payload, replayed = await asyncio.shield(chunk)
    finally:
        handle.requests_in_flight -= 1
        registry.touch(handle)
    return Response(payload, media_type=OCTET_STREAM, headers={"X-Replayed": "true"} if replayed else {})


async def _chunk(services, handle, seq, flush, tensors, latents, received) -> tuple[bytes, bool]:
    chunks = handle.chunks
    async with chunks.turn(services.settings.session_queue_depth):
        if chunks.is_repeat(seq):
            return await services.encoder.run(chunks.stored_response), True
        work = Work(
            handle.engine_session,
            latents,
            tensors.get(PROMPT_EMBEDS),
            tensors.get(PROMPT_MASK),
            flush=flush,
            atomic=True,
        )
        result = await services.engine.run(work)
        # Counted before anything else runs on the loop: a drain must never find the session advanced and the
        # chunk uncounted. Until it is encoded, the response is kept (for a repeated seq) as what builds it.
        build = services.encoder.response(result.units, result.state, tuple(latents.shape), {"seq": chunks.next_seq},
                                          outputs=handle.outputs, positions=result.positions)
        index = chunks.accept_request(seq, build)
        # A chunk accepted over HTTP means the client is back: a detached session's grace period ends (a stream
        # message of the dropped connection, still finishing, does not count).
        services.registry.attach(handle)
        services.metrics.frames_in.inc(result.frames_in)
        services.count_out(result.units, handle, received)
        services.watch(handle, result.units, received, done=result.state.flushed)
        payload = await services.encoder.run(build)
        chunks.store(index, payload)
        await services.checkpoint(handle)  # still within the turn: no other chunk of this session runs
        return payload, False
