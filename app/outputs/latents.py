"""The latents output: a unit's refined latent frames as they are (B, C, n, H, W). No state, nothing to finish."""

from __future__ import annotations

from typing import Any, Callable

import torch

from models.session import Unit
from models.transfer import HostCopy

from app.outputs.kinds import LATENTS, Outputs
from app.outputs.stage import OutputStage


class LatentsStage(OutputStage):
    kind = LATENTS
    action = "handing on this session's latents"

    def push(self, state: None, unit: Unit, final: bool) -> tuple[None, torch.Tensor]:
        return state, unit.latents

    def to_host(self, payload: torch.Tensor) -> Callable[[], torch.Tensor]:
        return HostCopy(payload).wait

    def wire(self, payloads: list[torch.Tensor], outputs: Outputs, shape: tuple[int, ...], at: int,
             response_dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        batch, channels, _, height, width = shape
        latents = torch.cat(payloads, dim=2) if payloads else torch.zeros(batch, channels, 0, height, width)
        return {LATENTS: latents.float() if response_dtype == "float32" else latents}, {}

