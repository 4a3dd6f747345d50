"""What /openapi.json tells clients (and the schema fuzzer in tests/app/test_fuzz.py): the error envelope on every
route, the statuses each route can answer with, the valid ranges of the session config fields, and the API key.

FastAPI documents only what it can see in a route's signature; the bodies here are read by hand (bounded reads,
safetensors), and the errors are raised from anywhere, so each route lists them with ``errors(...)``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

# --- the session config's per-field bounds -----------------------------------------------------------------
# The ranges models.config enforces, repeated so the schema can state them; test_fuzz checks that SessionConfig
# accepts each bound and rejects the value just past it, so the two cannot drift apart unnoticed. Rules across
# fields (kv_max_frames >= sink_frames + block_size; sigmas strictly decreasing to 0.0) cannot be written in a
# JSON schema: they stay the model's, answered with 422 invalid_config.
SEED_MAX = 2**63 - 1
FPS_MAX = 1000.0
FRAMES_MAX = 1 << 20  # sink_frames, block_size, kv_max_frames
KV_MAX_FRAMES_MIN = 2  # the smallest sink_frames + block_size
SIGMAS_MIN_ITEMS = 2


# --- the envelope ------------------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    code: str = Field(description="the error kind, stable: app.errors.ERRORS")
    message: str = Field(description="what was wrong and what to send instead")


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
    415: "wrong Content-Type",
    422: "wrong rank, dtype, channel count or H/W; NaN or Inf; an invalid config or query parameter",
    500: "the forward failed (a bug, or the device ran out of memory); the session is unchanged",
    503: "not ready, draining, or out of capacity (sessions or queue); retry after Retry-After seconds",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of a route that can fail with ``statuses``, each with the envelope."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorEnvelope, "description": _WHEN[status]}
        if status == 503:
            entry["headers"] = _RETRY_AFTER
        responses[status] = entry
    return responses


# --- response bodies ---------------------------------------------------------------------------------------
# extra="allow": the routes return more fields over time; the schema promises these, not only these.
class SessionConfigOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    seed: int
    fps: float
    sink_frames: int
    block_size: int
    kv_max_frames: int
    sigmas: list[float]
    positions: Literal["absolute", "rebased"]
    outputs: list[Literal["latents", "video"]]
    video_format: Literal["uint8", "float32"]
    video_lookahead: Literal["exact"] | int


class SessionSummary(BaseModel):
    model_config = ConfigDict(extra="allow")

    session_id: str
    created_at: str
    last_active_at: str
    frames_received: int
    frames_returned: int
    flushed: bool
    streaming: bool


class SessionList(BaseModel):
    sessions: list[SessionSummary]
    next: str | None = Field(description="pass as ?after= for the next page; null on the last one")


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
    created_at: str
    last_active_at: str


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

