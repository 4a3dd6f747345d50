"""Request plumbing shared by the routes: the app's services, bounded body reading, payload checks."""

from __future__ import annotations

import re
from typing import Annotated

import torch
from fastapi import Depends
from fastapi.dependencies.models import Dependant
from pydantic import BeforeValidator
from starlette.datastructures import QueryParams
from starlette.requests import ClientDisconnect, HTTPConnection, Request

from models import SessionConfig

from app.core.codec import LATENTS, OCTET_STREAM, PROMPT_EMBEDS
from app.core.error_kinds import ApiError
from app.core.settings import Settings
from app.runtime.services import Services

def get_services(connection: HTTPConnection) -> Services:
    return connection.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]

OCTET_BODY = {
    "requestBody": {
        "required": True,
        "content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}},
        "description": "a safetensors file: latents (B, C, t, H, W)[, prompt_embeds (B, L, D)"
        "[, prompt_attention_mask (B, L)]]",
    }
}
# The 200 bodies (a refined payload) are described in app.api.openapi (CHUNK_RESPONSE, REFINE_RESPONSE).


def _plain_integer(value: object) -> object:
    # Query values arrive as text, and pydantic's lax int takes "1.0", "+0.0" or "1_000" for numbers (found by
    # the schema fuzzer); a seq or a seed written so is a client bug worth a 422, as the schema says integer.
    if isinstance(value, str) and not re.fullmatch(r"-?[0-9]+", value):
        raise ValueError(f"{value!r} is not a plain integer; write it like 3")
    return value


# Goes beside Query(...) on an integer query parameter: decimal digits only.
PlainInteger = BeforeValidator(_plain_integer)


def reject_unknown_query(query: QueryParams, known: frozenset[str] = frozenset()) -> None:
    """422 for a query parameter the route does not take, or one given more than once: a misspelt ``flsuh=true``,
    a config field sent as ``POST /v1/sessions?seed=7`` or ``?seed=1&seed=2`` (of which the framework would keep one)
    would otherwise be ignored without a word, and the client get what it did not ask for. The schema says the same
    (``QUERY_RULE``, in /openapi.json's description). Called for every route by ``app.api.factory.QueryRule``."""
    unknown = sorted(set(query) - known)
    if unknown:
        takes = f"this route takes only {sorted(known)}" if known else "this route takes no query parameters"
        raise ApiError("invalid_request", f"unknown query parameter(s) {unknown}; {takes}")
    repeated = sorted(name for name in set(query) if len(query.getlist(name)) > 1)
    if repeated:
        raise ApiError("invalid_request", f"query parameter(s) {repeated} given more than once; give each at most once")


def declared_query(dependant: Dependant) -> frozenset[str]:
    """The query parameters a route declares: its endpoint's and its dependencies' (``/v1/refine`` takes the session
    fields through one), by the name a client sends. What the route declares is what /openapi.json documents, so
    the rule and the schema cannot disagree."""
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= declared_query(sub)
    return frozenset(names)


QUERY_RULE = ("Query parameters: each route takes only the ones it documents, each at most once; an unknown or repeated "
              "query parameter is refused with 422 invalid_request (never ignored).")


def require_content_type(request: Request, expected: str) -> None:
    """415 unless the body is declared as ``expected`` (an absent header is taken as that)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != expected:
        raise ApiError(
            "unsupported_media_type",
            f"Content-Type {declared!r} is not accepted here; send the body as {expected}",
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit``: from Content-Length before
    reading anything, else while it streams in, so an oversized body is never held in memory."""
    too_large = ApiError(
        "payload_too_large",
        f"the body is larger than the limit of {limit} bytes (max_body_bytes); send fewer frames per chunk",
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError("invalid_payload", f"Content-Length {declared!r} is not a number") from None
        if size > limit:
            raise too_large
    parts: list[bytes] = []
    received = 0
    try:
        async for part in request.stream():
            received += len(part)
            if received > limit:
                raise too_large
            parts.append(part)
    except ClientDisconnect:
        # Nobody is left to answer; end the request without logging it as a server error.
        raise ApiError("invalid_payload", "the client disconnected before the body was complete") from None
    return b"".join(parts)


def check_payload(
    tensors: dict[str, torch.Tensor], settings: Settings, max_frames: int, frames_setting: str,
    channels: int | None = None,
) -> torch.Tensor:
    """The request's latents, after the checks that need no session: presence, the channel axis (``channels``:
    the model's latent channels) and size limits. Shapes, dtypes and values are the session's to check
    (``RefinerSession.check``)."""
    latents = tensors.get(LATENTS)
    if latents is None:
        raise ApiError(
            "missing_input",
            f"the payload has no 'latents' tensor (found {sorted(tensors)}); send latents shaped (B, C, t, H, W)",
        )
    # Before the frame count: latents sent as (B, t, C, H, W) have the channels where the frames belong, and
    # "too many frames" would send the client looking in the wrong place.
    if channels is not None and latents.ndim == 5 and latents.shape[1] != channels:
        shape = tuple(latents.shape)
        swapped = (
            f"; axis 2 holds {channels}, so the time and channel axes look swapped: move the channels to axis 1 "
            "(numpy: latents.transpose(0, 2, 1, 3, 4), torch: latents.permute(0, 2, 1, 3, 4))"
            if latents.shape[2] == channels else ""
        )
        raise ApiError(
            "invalid_input",
            f"latents shaped {shape} have {shape[1]} channels on axis 1 but the model takes {channels}; send "
            f"(B, {channels}, t, H, W){swapped}",
        )
    if latents.ndim == 5 and latents.shape[2] > max_frames:
        raise ApiError(
            "too_many_frames",
            f"the payload holds {latents.shape[2]} frames, more than the limit of {max_frames} ({frames_setting}); "
            "split it into smaller chunks",
        )
    if latents.ndim == 5 and latents.shape[0] > settings.max_batch:
        raise ApiError(
            "invalid_input",
            f"latents have batch {latents.shape[0]}, more than the limit of {settings.max_batch} (max_batch); "
            "split the batch over several sessions",
        )
    if latents.ndim == 5 and latents.shape[3] * latents.shape[4] > settings.max_frame_tokens:
        raise ApiError(
            "invalid_input",
            f"latent frames of {latents.shape[3]}x{latents.shape[4]} = {latents.shape[3] * latents.shape[4]} "
            f"tokens exceed the limit of {settings.max_frame_tokens} (max_frame_tokens); send smaller frames",
        )
    embeds = tensors.get(PROMPT_EMBEDS)
    if embeds is not None and embeds.ndim == 3 and embeds.shape[1] > settings.max_prompt_tokens:
        raise ApiError(
            "prompt_too_long",
            f"prompt_embeds holds {embeds.shape[1]} tokens, more than the limit of {settings.max_prompt_tokens} "
            "(max_prompt_tokens); send a shorter prompt",
        )
    return latents


def check_config_limits(config: SessionConfig, settings: Settings) -> SessionConfig:
    """Refuse a valid config whose window or step count exceeds what this server allows (422, naming the
    setting), so one client cannot claim unbounded memory or compute."""
    window = config.kv_max_frames + config.block_size
    if window > settings.max_window_frames:
        raise ApiError(
            "invalid_config",
            f"kv_max_frames + block_size = {window} exceeds this server's limit of {settings.max_window_frames} "
            "(max_window_frames); ask for a smaller window",
        )
    if config.steps > settings.max_denoise_steps:
        raise ApiError(
            "invalid_config",
            f"{len(config.sigmas)} sigmas make {config.steps} forwards per block, more than this server's limit of "
            f"{settings.max_denoise_steps} (max_denoise_steps); send a shorter schedule",
        )
    return config
