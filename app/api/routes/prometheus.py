"""Prometheus exposition of the app's own registry (no authentication: scrapers call it)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from app.api.deps import ServicesDep

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}},
)
async def metrics(services: ServicesDep) -> Response:
    return Response(services.metrics.render(), media_type=services.metrics.content_type)
