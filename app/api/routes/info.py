"""What is being served: the model, the default session config, the limits; and the WebSocket protocol's AsyncAPI
document (``GET /asyncapi.yaml``, beside FastAPI's ``/openapi.json`` for the HTTP routes)."""

from __future__ import annotations

import functools
from importlib.resources import files
from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from app.api.deps import ServicesDep
from wm_refiner_client import spec

from app.api.openapi import errors

router = APIRouter(tags=["info"])

# What one session may ask for (422 beyond): reported beside the per-request limits of Settings.limits(). The
# settings that cap a session field come from the spec; the payload's caps (frame size, batch) from here.
SESSION_CAPS = tuple(dict.fromkeys([*(name for f in spec.FIELDS for name in f.limited_by), "max_frame_tokens", "max_batch"]))


def session_fields(settings) -> dict[str, Any]:
    """Each session field as this server takes it: its JSON schema, its default here, the settings that cap it
    (with their values) and its doc text, in the spec's order."""
    defaults = settings.session_default_values()
    return {
        f.name: {
            "schema": f.json_schema(),
            "default": defaults[f.name],
            "limits": {name: getattr(settings, name) for name in f.limited_by},
            "query": f.in_query,
            "doc": f.doc,
        }
        for f in spec.FIELDS
    }


@router.get("/v1/info", responses=errors(401, 503))
async def info(services: ServicesDep) -> dict[str, Any]:
    model = services.require_model().info
    return {
        "model": {
            "class": model.class_name,
            "layers": model.num_layers,
            "channels": model.in_channels,
            "caption_channels": model.caption_channels,
            "dtype": model.dtype,
            "device": model.device,
            "details": model.to_dict(),
        },
        "vae": None if services.decoder is None else {
            "class": services.decoder.info.class_name,
            **{k: v for k, v in services.decoder.info.to_dict().items() if k != "class_name"},
        },
        "default_session_config": services.settings.session_default_values(),
        "session_fields": session_fields(services.settings),
        "default_prompt": services.default_prompt is not None,
        "engine": {
            "batching": services.settings.batching,  # the setting: auto, true or false
            "batched": services.engine.batching,  # whether model calls hold several sessions now
            "max_batch_rows": services.settings.max_batch_rows,
            "compile_step": services.settings.compile_step,
            # What runs the model calls now (eager, compiling, compiled, none) and why: a failed compile shows here.
            "step": services.step,
            # With compile_step: the batch sizes and latent sizes compiled before /ready (others run eagerly).
            "compiled": None if services.engine.runner is None else {
                "batch_sizes": services.engine.runner.buckets,
                "latent_sizes": [f"{h}x{w}" for h, w in services.settings.compile_geometries()],
                "mode": services.settings.compile_mode,
            },
            # Measured, per class of model call (tokens per row, dtype, device): whether a session's bytes do not
            # depend on the sessions sharing its forwards (app.engine.batching). batch_invariant: every class probed passed;
            # batch_probe: the first (warm-up) class's finding; batch_classes: each class, probed or pending.
            "batch_invariant": services.batch_invariant,
            "batch_probe": services.batch_probe,
            "batch_classes": services.engine.policy.describe(),
            # Real-time admission: the setting, the measured seconds per row, the load of the realtime sessions.
            "realtime": services.store.realtime.figures(),
        },
        "limits": {
            **services.settings.limits(),
            **{name: getattr(services.settings, name) for name in SESSION_CAPS},
        },
        # Device bytes: the sessions' budget (device_memory_budget; None: none), what they hold or reserved, what is
        # free of it; host and disk bytes of parked and spilled sessions; sessions by state (app.sessions.parking).
        "memory": services.store.parking.report(),
        "ready": services.not_ready_reason is None,
    }


@functools.cache
def asyncapi_document() -> str:
    return files("app").joinpath("static", "asyncapi.yaml").read_text(encoding="utf-8")


@router.get("/asyncapi.yaml", include_in_schema=False)
async def asyncapi() -> Response:
    """The AsyncAPI 3 document of WS /v1/sessions/{id}/stream and /watch (app/static/asyncapi.yaml)."""
    return Response(asyncapi_document(), media_type="application/yaml")
