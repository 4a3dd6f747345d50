"""Prompt conditioning and the token layout of a block.

Shape letters: B batch, C channels, T frames, H height, W width, N = T*H*W tokens, L prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
