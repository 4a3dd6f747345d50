"""Refining a whole clip in one call: the library form of ``python -m app refine`` and ``POST /v1/refine``."""

from __future__ import annotations

import torch

from .config import SessionConfig
from .errors import InvalidInputError
from .loading import Refiner
from .session import RefinerSession


def check_clip_length(latents, config: SessionConfig) -> None:
    """A one-shot clip must have more frames than ``sink_frames`` (the reference pipeline refuses it too)."""
    frames = int(latents.shape[2]) if isinstance(latents, torch.Tensor) and latents.ndim == 5 else None
    if frames is not None and frames <= config.sink_frames:
        raise InvalidInputError(
            f"the clip has {frames} frame{'' if frames == 1 else 's'} but sink_frames={config.sink_frames}; send more "
            "than sink_frames frames (the sink is never refined, so such a clip has nothing to refine)"
        )


def refine_clip(
    refiner: Refiner,
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_attention_mask: torch.Tensor | None = None,
    config: SessionConfig | None = None,
    noise_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The refined clip (B, C, T, H, W) in the model's dtype: the sink frames unchanged, then every block.

    Like the reference pipeline, a clip must have more frames than ``sink_frames``. ``noise_dtype``:
    ``RefinerSession.noise_dtype`` (a float32 twin of a bfloat16 run passes bfloat16).
    """
    config = config or SessionConfig()
    check_clip_length(latents, config)
    session = RefinerSession(refiner, config)
    session.noise_dtype = noise_dtype
    units = session.push(latents, prompt_embeds, prompt_attention_mask, flush=True)
    return torch.cat([unit.latents for unit in units], dim=2)  # (B, C, T, H, W)
