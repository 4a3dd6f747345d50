"""Liveness and readiness probes (no authentication: orchestrators call them)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse

from ..deps import ServicesDep
from ..errors import ApiError

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict[str, str]:
    """The process answers. Never touches the model."""
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "not ready; the envelope's message says why"}})
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
    return JSONResponse({"status": "ready"})
