"""POST /v1/refine: a whole clip in, the whole refined clip out, through a throwaway session.

A clip is admitted like a session: while it is refined it holds one of ``max_sessions`` places (503
``too_many_sessions`` when none is free), and its memory is bounded by ``max_clip_frames`` and ``max_body_bytes``.
In the engine it is one more session: its forwards take turns (and share model calls) with the streams', so a long
clip cannot hold the engine. A client that goes away stops its clip at the next block.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import Response

from models import RefinerSession, SessionConfig

from ..codec import OCTET_STREAM, PROMPT_EMBEDS, PROMPT_MASK, decode
from ..deps import (
    OCTET_BODY,
    OCTET_RESPONSE,
    PlainInteger,
    ServicesDep,
    check_config_limits,
    check_payload,
    read_body,
    reject_unknown_query,
    require_content_type,
)
from ..engine import EngineSession, Work
from ..errors import ApiError
from ..openapi import FPS_MAX, FRAMES_MAX, KV_MAX_FRAMES_MIN, SEED_MAX, errors

router = APIRouter(tags=["refine"])
REFINE_QUERY = frozenset({"seed", "fps", "sink_frames", "block_size", "kv_max_frames", "positions", "outputs",
                          "video_format", "video_lookahead"})


@router.post(
    "/v1/refine",
    openapi_extra=OCTET_BODY,
    responses={**OCTET_RESPONSE, **errors(400, 401, 413, 415, 422, 500, 503)},
)
async def refine(
    request: Request,
    services: ServicesDep,
    seed: Annotated[int | None, Query(ge=0, le=SEED_MAX), PlainInteger] = None,
    fps: Annotated[float | None, Query(gt=0, le=FPS_MAX)] = None,
    sink_frames: Annotated[int | None, Query(ge=1, le=FRAMES_MAX), PlainInteger] = None,
    block_size: Annotated[int | None, Query(ge=1, le=FRAMES_MAX), PlainInteger] = None,
    kv_max_frames: Annotated[
        int | None,
        Query(ge=KV_MAX_FRAMES_MIN, le=FRAMES_MAX, description="at least sink_frames + block_size"),
        PlainInteger,
    ] = None,
    positions: Annotated[Literal["absolute", "rebased"] | None, Query()] = None,
    outputs: Annotated[
        str | None, Query(max_length=32, description="latents (default), video, or latents,video; video needs a vae")
    ] = None,
    video_format: Annotated[Literal["uint8", "float32"] | None, Query()] = None,
    video_lookahead: Annotated[
        str | None, Query(max_length=16, description="exact (default) or N latent frames")
    ] = None,
) -> Response:
    reject_unknown_query(request, REFINE_QUERY)
    services.require_ready()
    settings = services.settings
    asked = dict(
        seed=seed, fps=fps, sink_frames=sink_frames, block_size=block_size, kv_max_frames=kv_max_frames,
        positions=positions,
    )
    wanted = services.outputs({"outputs": outputs, "video_format": video_format,
                               "video_lookahead": video_lookahead or "exact"})
    defaults = settings.session_defaults().to_dict()
    config = SessionConfig.from_dict({**defaults, **{k: v for k, v in asked.items() if v is not None}})
    check_config_limits(config, settings)
    require_content_type(request, OCTET_STREAM)
    body = await read_body(request, settings.max_body_bytes)
    tensors = decode(body)
    latents = check_payload(tensors, settings, settings.max_clip_frames, "max_clip_frames",
                            services.require_model().info.in_channels)
    if PROMPT_EMBEDS not in tensors and services.default_prompt is None:
        raise ApiError(
            "missing_input",
            "the payload has no 'prompt_embeds' tensor; a clip needs prompt_embeds (B, L, caption_channels) and "
            "optionally prompt_attention_mask (B, L) (this server has no default_prompt)",
        )
    with services.registry.clip():
        session = RefinerSession(services.require_model(), config, services.default_prompt)
        target = EngineSession(session=session, name="one-shot clip", stages=services.session_stages(wanted, config))
        work = Work(target, latents, tensors.get(PROMPT_EMBEDS), tensors.get(PROMPT_MASK), flush=True, one_shot=True)
        try:
            result = await services.engine.run(work)
        except asyncio.CancelledError:
            target.closed = ApiError("invalid_request", "the client went away before its clip was refined")
            raise
    services.count_out(result.units)
    payload = await services.encoder.run(services.encoder.response(
        result.units, result.state, tuple(latents.shape), outputs=wanted, positions=result.positions))
    return Response(payload, media_type=OCTET_STREAM)
