"""Operator routes: ``POST /v1/admin/drain``.

A drain is what SIGTERM does before the process exits (``Services.drain``): stop admitting, finish in-flight
blocks, save every live session to ``snapshot_dir``, close the streams with 1012. Exposed as a route so an
orchestrator can drain first and stop the process once the answer says the sessions are saved. The server stays
up afterwards, answering 503 ``draining`` to new work; a later SIGTERM (or a second call) only repeats the report.

Guarded like every non-probe route by the API key (``app.api.auth``). Left out of the OpenAPI schema: it is not part
of the client API, and a schema-driven client or fuzzer must not stumble into draining the server.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.api.deps import ServicesDep

router = APIRouter(tags=["admin"])


@router.post("/v1/admin/drain", include_in_schema=False)
async def drain(services: ServicesDep) -> dict[str, Any]:
    return await services.drain()
