"""One forward of the refiner over a block's tokens, with the window built for that forward.

Shape letters: B batch, C channels, T frames, H height, W width, N = T*H*W tokens, L prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import ForwardWindow, LayerKV, check_processors, processor_names


@dataclass(frozen=True)
class Prompt:
    """Prompt conditioning, already on the model's device and dtype: embeds (B, L, caption_channels), mask (B, L)."""

    embeds: torch.Tensor
    mask: torch.Tensor | None = None


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, T*H*W, C): frame-major, then h, then w, channels last (patch size 1)."""
    return latents.permute(0, 2, 3, 4, 1).flatten(1, 3)  # (B, N, C)


def unpack(tokens: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """(B, T*H*W, C) -> (B, C, T, H, W)."""
    batch = tokens.shape[0]
    return tokens.reshape(batch, frames, height, width, -1).permute(0, 4, 1, 2, 3)  # (B, C, T, H, W)


def run_forward(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    sigma: float,
    rope: tuple[torch.Tensor, torch.Tensor],
    prompt: Prompt,
    window: ForwardWindow,
) -> tuple[torch.Tensor, list[LayerKV] | None]:
    """Velocity (B, N, C) for ``tokens`` (B, N, C) at noise level ``sigma``, and the K/V the window captured.

    The capture is read here, once, right after the forward that filled it: callers never pair an enable with a
    later collect.
    """
    check_processors(model, window.mode)
    batch, num_tokens, _ = tokens.shape
    timestep = torch.full(
        (batch, num_tokens),
        sigma * float(model.config.timestep_scale_multiplier),
        dtype=torch.float32,
        device=tokens.device,
    )
    with torch.no_grad():
        velocity = model(
            hidden_states=tokens,
            encoder_hidden_states=prompt.embeds,
            timestep=timestep,
            video_rotary_emb=rope,
            encoder_attention_mask=prompt.mask,
            kv_cache=window,
            kv_cache_mode=window.kv_cache_mode,
            return_dict=False,
        )[0]
    captured = window.capture.take(processor_names(model)) if window.capture is not None else None
    return velocity, captured
