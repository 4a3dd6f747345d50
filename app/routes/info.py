"""What is being served: the model, the default session config, the limits."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..deps import ServicesDep
from ..openapi import errors

router = APIRouter(tags=["info"])


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
        "default_session_config": services.settings.session_defaults().to_dict(),
        "default_prompt": services.default_prompt is not None,
        "limits": services.settings.limits(),
        "ready": services.not_ready_reason is None,
    }
