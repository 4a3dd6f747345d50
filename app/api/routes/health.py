"""Liveness and readiness probes (no authentication: orchestrators call them)."""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse

from app.api.deps import ServicesDep
from app.api.openapi import NotReady
from app.core.error_kinds import ApiError

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict[str, Literal["ok"]]:
    """The process answers. Never touches the model."""
    return {"status": "ok"}


# HEAD answers like GET without a body (load balancers and uptime checks use it); left out of the schema, which
# documents the GET.
router.head("/health", include_in_schema=False)(health)


class Ready(BaseModel):
    status: Literal["ready"]
    ready_for_s: float = Field(
        description="seconds since the server became ready (its monotonic clock). A browser page sees a refused "
                    "WebSocket handshake only as close code 1006: a handshake sent less than this long ago may have "
                    "been refused as 503 not_ready (the JS module reports it so, and a retry opens)")


@router.get(
    "/ready",
    response_model=Ready,
    responses={
        503: {
            "model": NotReady,
            "description": "not ready (loading, warming up, draining); the envelope's message says why",
            "headers": {"Retry-After": {"schema": {"type": "integer"}}},
        }
    },
)
async def ready(services: ServicesDep) -> JSONResponse:
    """200 once the model is loaded and warmed up and sessions can be admitted; 503 with the reason otherwise."""
    try:
        services.require_ready()
    except ApiError as error:
        return JSONResponse(
            {**error.envelope(), "status": "not ready"},
            status_code=error.status,
            headers=error.headers(services.settings.retry_after_s),
        )
    return JSONResponse({"status": "ready", "ready_for_s": round(time.monotonic() - services.ready_since, 3)})


router.head("/ready", include_in_schema=False)(ready)
