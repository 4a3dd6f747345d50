"""What /openapi.json tells clients (and the schema fuzzer in tests/app/api/test_fuzz.py): the error envelope on every
route, the statuses each route can answer with, the session config's fields (from ``wm_refiner_client.spec``),
and the API key.

FastAPI documents only what it can see in a route's signature; the bodies here are read by hand (bounded reads,
safetensors), and the errors are raised from anywhere, so each route lists them with ``errors(...)``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Callable, Iterable, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, create_model

from wm_refiner_client import spec

# --- the session config -----------------------------------------------------------------------------------
# Declared once in wm_refiner_client.spec; the bounds are re-exported for the routes and tests/app/api/test_fuzz.py
# (which checks that SessionConfig accepts each bound and refuses the value just past it). Rules across fields
# (kv_max_frames >= sink_frames + block_size; sigmas strictly decreasing to 0.0) cannot be written in a JSON schema:
# they stay the model's, answered with 422 invalid_config.
SEED_MAX = spec.SEED_MAX
FPS_MIN = spec.FPS_MIN
FPS_MAX = spec.FPS_MAX
FRAMES_MAX = spec.FRAMES_MAX
KV_MAX_FRAMES_MIN = spec.KV_MAX_FRAMES_MIN
SIGMAS_MIN_ITEMS = spec.SIGMAS_MIN_ITEMS


def value_annotation(field: spec.SessionField, bounds: bool = True) -> Any:
    """The pydantic type of a field's JSON value, with the bounds the spec states (``bounds``: a request's; a
    response states the types only)."""
    lower = {"gt" if field.exclusive_minimum else "ge": field.minimum} if bounds and field.minimum is not None else {}
    upper = {"le": field.maximum} if bounds and field.maximum is not None else {}
    if not bounds and field.kind in (spec.NUMBERS, spec.CHOICES):
        return list[float] if field.kind == spec.NUMBERS else list[Literal[field.choices]]
    if field.kind == spec.INTEGER:
        return Annotated[int, Field(**lower, **upper)]
    if field.kind == spec.NUMBER:
        return Annotated[float, Field(**lower, **upper)]
    if field.kind == spec.CHOICE:
        return Literal[field.choices]
    if field.kind == spec.NUMBERS:
        return Annotated[list[Annotated[float, Field(**lower, **upper)]],
                         Field(min_length=field.min_items, max_length=field.max_items)]
    if field.kind == spec.CHOICES:
        return Annotated[list[Literal[field.choices]], Field(min_length=field.min_items, max_length=field.max_items)]
    if field.kind == spec.LOOKAHEAD:
        return Literal[field.word] | Annotated[int, Field(**lower, **upper)]
    if field.kind == spec.BOOLEAN:
        return bool
    raise AssertionError(f"no pydantic type for field kind {field.kind!r}")


def _session_create() -> type[BaseModel]:
    fields = {
        f.name: (Annotated[value_annotation(f) | None, Field(description=f.doc)], None) for f in spec.FIELDS
    }
    # strict: JSON false is not seed 0, nor "3" a block size; a client sending those has a bug worth hearing of.
    return create_model(
        "SessionCreate",
        __config__=ConfigDict(extra="forbid", strict=True),
        __doc__="Every field optional; unset fields take the server's defaults (GET /v1/info).",
        **fields,
    )


# The JSON body of POST and PUT /v1/sessions.
SessionCreate = _session_create()


# --- the envelope ------------------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    # extra="allow": some kinds add figures a client acts on (insufficient_memory: bytes_needed, bytes_free).
    model_config = ConfigDict(extra="allow")

    code: str = Field(description="the error kind, stable: app.core.error_kinds.ERRORS")
    message: str = Field(description="what was wrong and what to send instead")
    bytes_needed: int | None = Field(default=None, description="insufficient_memory: device bytes the request needs")
    bytes_free: int | None = Field(default=None, description="insufficient_memory: device bytes of the budget free now")


class ErrorEnvelope(BaseModel):
    """Every error, on every route: ``{"error": {"code": ..., "message": ...}}``."""

    error: ErrorBody


class NotReady(ErrorEnvelope):
    status: Literal["not ready"]


# Why each status happens, worded for the route list in /docs.
_WHEN = {
    400: "the body is not a safetensors file (or not JSON), or a required tensor is missing",
    401: "an API key is configured and the Authorization: Bearer header is missing or wrong",
    404: "unknown (or deleted) session",
    409: "seq out of order, or a chunk after the stream was flushed",
    410: "the session was evicted after session_idle_timeout_s without activity",
    413: "the body, the frames per chunk or the prompt length is over its limit (GET /v1/info, limits)",
    415: "wrong Content-Type, or a Content-Encoding other than identity (send the body uncompressed)",
    422: "wrong rank, dtype, channel count or H/W; NaN or Inf; an invalid config or query parameter",
    500: "the forward failed (a bug, or the device ran out of memory); the session is unchanged",
    503: "not ready, draining, or out of capacity (sessions or queue); retry after Retry-After seconds",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}


def errors(*statuses: int, when: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of a route that can fail with ``statuses``, each with the envelope. ``when``:
    the route's own words for a status whose causes differ by route (the 400s and 409s: exactly when each
    happens there)."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorEnvelope, "description": (when or {}).get(status, _WHEN[status])}
        if status == 503:
            entry["headers"] = _RETRY_AFTER
        responses[status] = entry
    return responses


# Each route's own causes of a 400 and a 409 (``errors(..., when=...)``): what the generic words would blur.
CONFIG_400 = "invalid_payload: the body is not JSON, or nests it too deeply (an empty body takes every default)"
# A session saved in snapshot_dir is taken (its lease) before it is read or ended: the folder's or its owner's 503s.
GET_503 = ("session_moved: another replica holds the session's lease; server_busy: snapshot_dir cannot take its lease "
           "or be read now (the file stays); retry after Retry-After seconds")
DELETE_503 = ("session_moved: another replica holds the session's lease; server_busy: snapshot_dir cannot take its "
              "lease, be read, or be written to end the session now (it goes on unchanged); retry after "
              "Retry-After seconds")
PUT_409 = ("session_exists: a session with this id exists with another config (the same config again answers 200 "
           "with the session); PUT it with that config, or choose another id")
CHUNK_400 = ("invalid_payload: the body is not a safetensors file, holds a tensor name other than latents, "
             "prompt_embeds, prompt_attention_mask, or is empty while flush is not true (an empty body with "
             "flush=true is a flush without new frames); missing_input: no latents tensor, or the session's first "
             "chunk has no prompt_embeds and the server no default_prompt")
CHUNK_409 = ("seq_conflict: seq is neither the next one nor the last accepted one (the message names the expected "
             "seq), or it is the last accepted one with another body or flush, which is not a retry of it (the "
             "message says what differs); stream_closed: the session was flushed and takes no more chunks")
REFINE_400 = ("invalid_payload: the body is empty, not a safetensors file, or holds a tensor name other than "
              "latents, prompt_embeds, prompt_attention_mask; missing_input: no latents tensor, or no prompt_embeds "
              "while the server has no default_prompt")


# --- the binary 200 bodies ----------------------------------------------------------------------------------
# What /openapi.json says a refined payload holds: OpenAPI cannot describe the inside of a binary body, so the
# tensors and metadata are listed in ``x-safetensors`` (the shape the AsyncAPI document's units use) and in words.
_STRING_INTEGER = {"type": "string", "pattern": "^[0-9]+$"}
UNIT_TENSORS = {
    "latents": "(B, C, n, H, W), n >= 0: the refined latent frames [frame_start, frame_end); float32 (the model's "
               "dtype with response_dtype: model); absent when the outputs exclude latents",
    "video": "with video outputs: uint8 (B, F, H_px, W_px, 3) RGB, float32 (B, F, 3, H_px, W_px) in [0, 1], or for "
             "video_format jpeg/h264 uint8 (N,), the encoded bytes (api.md, Encoded video)",
    "video_sizes": "int64, jpeg/h264 only: the bytes of each encoded piece",
    "video_init_sizes": "int64 (B,), h264 only: the init segment's bytes at the start of each row",
}


def _unit_metadata(seq: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["frame_start", "frame_end", "seq", "latency_ms"],
        "properties": {
            "frame_start": {**_STRING_INTEGER, "description": "first latent frame (absolute index) in this payload"},
            "frame_end": {**_STRING_INTEGER, "description": "end, exclusive: frame_start + n"},
            "seq": {**_STRING_INTEGER, "description": seq},
            "latency_ms": {"type": "string", "pattern": "^[0-9]+[.][0-9]{3}$",
                           "description": "milliseconds on the server's clock from the request's body having been "
                                          "read to this payload being ready (checks, queue, forwards, output "
                                          "stages); api.md defines it"},
            "video_frame_start": {**_STRING_INTEGER, "description": "with video: first pixel frame of the session's "
                                                                    "video in this payload"},
            "video_frame_end": {**_STRING_INTEGER, "description": "with video: end, exclusive"},
            "durable_frames": {**_STRING_INTEGER, "description": "with crash checkpoints: the input frames the "
                                                                 "session's last checkpoint covers"},
            "video_format": {"type": "string", "description": "with an encoded video_format: the format the video "
                                                              "is in (uint8 when encoding it failed)"},
            "video_codec": {"type": "string"},
            "video_quality": _STRING_INTEGER,
            "video_error": {"type": "string", "description": "why the video could not be encoded as asked"},
        },
    }


def _refined_payload(what: str, seq: str, example: dict[str, Any]) -> dict[int | str, dict[str, Any]]:
    header = json.dumps(example, separators=(",", ":"))
    return {200: {
        "description": (
            f"{what} A safetensors file: 8 bytes, the header's length N as an unsigned 64-bit little-endian "
            "integer; N bytes of JSON, the header; the tensors' bytes. Tensors (x-safetensors.tensors): "
            + "; ".join(f"{name} {doc}" for name, doc in UNIT_TENSORS.items())
            + ". The header's __metadata__ (every value a string, x-safetensors.metadata): frame_start, frame_end, "
            f"seq ({seq}), latency_ms, and with video video_frame_start, video_frame_end. Example header (latents "
            f"only, frames [0, 4) at 4x4): {header}"
        ),
        "content": {"application/octet-stream": {
            "schema": {"type": "string", "format": "binary"},
            "x-safetensors": {"tensors": UNIT_TENSORS, "metadata": _unit_metadata(seq), "example_header": example},
        }},
    }}


def _example_header(seq: str, latency: str) -> dict[str, Any]:
    # (1, 128, 4, 4, 4) float32: 8192 values of 4 bytes.
    return {"latents": {"dtype": "F32", "shape": [1, 128, 4, 4, 4], "data_offsets": [0, 32768]},
            "__metadata__": {"frame_start": "0", "frame_end": "4", "latency_ms": latency, "seq": seq}}


CHUNK_RESPONSE = _refined_payload(
    "The frames this chunk finalized (possibly none: n = 0), in the session's outputs; a repeated seq with the "
    "same body and flush gets the stored bytes again (header X-Replayed: true), metadata included.",
    "this chunk's index among the session's accepted chunks, HTTP and WebSocket, from 0: the query's seq when "
    "given",
    _example_header("0", "412.337"),
)
REFINE_RESPONSE = _refined_payload(
    "The whole refined clip, every frame, in the outputs asked for.",
    "always 0: the clip is its throwaway session's only chunk",
    _example_header("0", "1893.054"),
)


# --- response bodies ---------------------------------------------------------------------------------------
# extra="allow": the routes return more fields over time; the schema promises these, not only these.
SessionConfigOut = create_model(
    "SessionConfigOut",
    __config__=ConfigDict(extra="allow"),
    **{f.name: (Annotated[value_annotation(f, bounds=False), Field(description=f.doc)], ...) for f in spec.FIELDS},
)


class SessionBytes(BaseModel):
    model_config = ConfigDict(extra="allow")

    device: int = Field(description="bytes on the device the model computes from (the GPU; on a CPU server its RAM)")
    host: int = Field(description="bytes in host memory: retained units, the last response; parked: the KV cache too")
    disk: int = Field(description="bytes of a spilled session's file in snapshot_dir")


class SessionSummary(BaseModel):
    model_config = ConfigDict(extra="allow")

    session_id: str
    created_at: str
    last_active_at: str
    frames_received: int
    frames_returned: int
    flushed: bool
    streaming: bool
    state: Literal["active", "parked", "spilled"] = Field(description="where its tensors are (api.md)")
    bytes: SessionBytes


class SessionList(BaseModel):
    sessions: list[SessionSummary]
    next: str | None = Field(description="pass as ?after= for the next page; null on the last one")
    after_created_at: str | None = Field(None, description="with ?after= and scope=local: when that session was "
                                         "created, where the page starts (a replica asks its peers for it)")


class SessionCreated(BaseModel):
    session_id: str
    config: SessionConfigOut


class SessionDescription(BaseModel):
    model_config = ConfigDict(extra="allow")

    session_id: str
    config: SessionConfigOut
    frames_received: int
    frames_returned: int
    pending_frames: int
    history_frames: int
    next_seq: int
    kv_cache_bytes: int
    late_blocks: int | None = Field(
        default=None, description="realtime sessions: blocks committed after their deadline (the arrival of their "
        "last input frame + their playback time); null for other sessions")
    paced_blocks: int | None = Field(default=None, description="realtime sessions: blocks whose deadline was tracked")
    last_lateness_s: float | None = Field(
        default=None, description="realtime sessions: seconds the last block was past its deadline (< 0: early)")
    worst_lateness_s: float | None = Field(default=None, description="realtime sessions: the most, so far")
    created_at: str
    last_active_at: str
    state: Literal["active", "parked", "spilled"] = Field(description="where its tensors are (api.md)")
    bytes: SessionBytes = Field(description="what it holds where, and by part (parts)")


# --- the API key -------------------------------------------------------------------------------------------
def document_api_key(app: FastAPI, public_paths: Iterable[str]) -> None:
    """Declare the bearer key on every operation but the public probes (which declare none), so clients and
    the fuzzer's auth checks know which routes need it. Only called when a key is configured: a server
    without one must not claim to need it."""
    public = frozenset(public_paths)
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["api_key"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "the configured api_key, as 'Authorization: Bearer <key>' (never in the query string)",
        }
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                if isinstance(operation, dict):
                    operation["security"] = [] if path in public else [{"api_key": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

