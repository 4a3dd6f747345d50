"""RoPE for the streaming window: which positions each forward uses, and the (cos, sin) tables.

Shape letters: B batch, N tokens, D inner dim (heads * head dim), A attention heads, R rotary pairs per head.

Positions are latent-frame indices. ``absolute`` uses each frame's index in the stream, like the reference.
``rebased`` subtracts a per-block shift so the window ``[sink | history | block]`` always starts at frame 1
(or at 0 while the sink is still frame 0 of the stream): attention logits depend only on position
differences for frames >= 1, so the result is the same in exact arithmetic, but the angles stay small
however long the stream runs.

Tables are built as diffusers' ``build_rotary_emb_for_absolute_positions`` builds them (fp32, the reference's
own op sequence and numbers) unless the model runs in float64, where fp32 tables would dominate the error; then
the same formula is evaluated in float64 here. Either way they are built on the device from ``arange`` and
scalars: diffusers' function makes three ``torch.tensor(list, device=...)`` per table, each a pageable
host-to-device copy that waits for the stream, three tables a block. A table is not kept between blocks: at
480p one is tens of MB per session, and building it is a few elementwise kernels; what stalled was the copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from diffusers.models.transformers.transformer_sana_wm_refiner import (
    apply_interleaved_rotary_emb,
    apply_split_rotary_emb,
)

from .transfer import host_values

RopeTables = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class WindowPositions:
    """RoPE frame positions of one block's window. Plain Python, no tensors.

    ``sink_offset`` is where the sink sits in absolute frames: just before the oldest history frame.
    ``shift`` is subtracted from every absolute position (0 in absolute mode).
    """

    block_start: int
    block_end: int
    history_frames: int
    sink_frames: int
    shift: int

    @classmethod
    def plan(cls, block_start: int, block_end: int, history_frames: int, sink_frames: int, rebased: bool):
        sink_offset = block_start - history_frames - sink_frames
        if sink_offset < 0:
            raise ValueError(f"window does not fit: block at {block_start} with {history_frames} history frames")
        # Frame 0 is clamped by the causal offset, so only windows that do not contain it may move, and they
        # move to start at 1, never at 0.
        shift = sink_offset - 1 if rebased and sink_offset >= 1 else 0
        return cls(block_start, block_end, history_frames, sink_frames, shift)

    @property
    def sink_offset(self) -> int:
        return self.block_start - self.history_frames - self.sink_frames

    @property
    def sink(self) -> list[int]:
        start = self.sink_offset - self.shift
        return list(range(start, start + self.sink_frames))

    @property
    def history(self) -> list[int]:
        return list(range(self.block_start - self.history_frames - self.shift, self.block_start - self.shift))

    @property
    def block(self) -> list[int]:
        return list(range(self.block_start - self.shift, self.block_end - self.shift))


def rope_tables(
    model: torch.nn.Module,
    frame_positions: Sequence[int],
    batch_size: int,
    height: int,
    width: int,
    fps: float,
    device: torch.device,
    dtype: torch.dtype,
) -> RopeTables:
    """(cos, sin) for the tokens of ``frame_positions`` (frame-major, then h, then w)."""
    if dtype != torch.float64:
        return _rope_tables_float32(model, frame_positions, batch_size, height, width, fps, device)
    return _rope_tables_float64(model, frame_positions, batch_size, height, width, fps, device)


def frame_positions_tensor(frame_positions: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``frame_positions`` as a tensor on ``device``: an ``arange`` (no copy) for a contiguous run, which is what
    every window part is; otherwise staged through ``to_device``."""
    positions = list(frame_positions)
    if positions and positions == list(range(positions[0], positions[0] + len(positions))):
        return torch.arange(positions[0], positions[0] + len(positions), dtype=dtype, device=device)
    return host_values(positions, device, dtype)


def _rope_tables_float32(model, frame_positions, batch_size, height, width, fps, device) -> RopeTables:
    """diffusers' ``build_rotary_emb_for_absolute_positions``, op for op (so the same bits), with its three
    host-built tensors replaced: the positions by ``frame_positions_tensor``, the patch ends by adding the
    patch sizes as scalars, the VAE scale factors by one multiply per axis (float32 times an integer equals
    float32 times its float32 value, which is what the reference's int64 ``scale_tensor`` promotes to)."""
    rope = model.rope
    patch_size_t, patch_size = int(rope.patch_size_t), int(rope.patch_size)
    f_positions = frame_positions_tensor(frame_positions, torch.float32, device)
    if patch_size_t > 1:
        f_positions = f_positions[::patch_size_t]  # each patch covers patch_size_t latent frames: its start
    grid_h = torch.arange(start=0, end=height, step=patch_size, dtype=torch.float32, device=device)
    grid_w = torch.arange(start=0, end=width, step=patch_size, dtype=torch.float32, device=device)
    grid = torch.stack(torch.meshgrid(f_positions, grid_h, grid_w, indexing="ij"), dim=0)  # (3, F, H, W)
    ends = torch.stack([grid[0] + patch_size_t, grid[1] + patch_size, grid[2] + patch_size], dim=0)  # (3, F, H, W)
    latent_coords = torch.stack([grid, ends], dim=-1)  # (3, F, H, W, 2)
    latent_coords = latent_coords.flatten(1, 3).unsqueeze(0).repeat(batch_size, 1, 1, 1)  # (B, 3, N, 2)
    scales = [float(s) for s in rope.scale_factors]
    pixel_coords = torch.stack([latent_coords[:, axis] * scales[axis] for axis in range(3)], dim=1)  # (B, 3, N, 2)
    pixel_coords[:, 0, ...] = (pixel_coords[:, 0, ...] + rope.causal_offset - rope.scale_factors[0]).clamp(min=0)
    pixel_coords[:, 0, ...] = pixel_coords[:, 0, ...] / float(fps)
    return rope(pixel_coords, device=device)


def _rope_tables_float64(model, frame_positions, batch_size, height, width, fps, device) -> RopeTables:
    """The LTX-2 video RoPE formula evaluated in float64 (patch size 1, which ``load_refiner`` enforces)."""
    rope = model.rope
    f64 = torch.float64
    scale_t, scale_h, scale_w = (float(s) for s in rope.scale_factors)
    frames = frame_positions_tensor(frame_positions, f64, device)
    # Temporal patch bounds in pixel frames, shifted by the causal offset and clamped at 0, then in seconds.
    t_start = (frames * scale_t + rope.causal_offset - scale_t).clamp(min=0) / float(fps)
    t_end = ((frames + 1) * scale_t + rope.causal_offset - scale_t).clamp(min=0) / float(fps)
    t_mid = (t_start + t_end) / 2.0
    h_mid = (torch.arange(height, dtype=f64, device=device) + 0.5) * scale_h
    w_mid = (torch.arange(width, dtype=f64, device=device) + 0.5) * scale_w
    grid = torch.stack(torch.meshgrid(t_mid, h_mid, w_mid, indexing="ij"), dim=-1)  # (T, H, W, 3)
    grid = grid.reshape(-1, 3)  # (N, 3)
    grid = grid / host_values([rope.base_num_frames, rope.base_height, rope.base_width], device, f64)

    num_rope_elems = 3 * 2
    steps = rope.dim // num_rope_elems
    freqs = torch.pow(rope.theta, torch.linspace(0.0, 1.0, steps=steps, dtype=f64, device=device)) * math.pi / 2.0
    angles = (grid.unsqueeze(-1) * 2 - 1) * freqs  # (N, 3, F)
    angles = angles.transpose(-1, -2).flatten(1)  # (N, F*3), frequency-major like the reference
    angles = angles.unsqueeze(0).expand(batch_size, -1, -1)  # (B, N, F*3)

    if rope.rope_type == "interleaved":
        cos = angles.cos().repeat_interleave(2, dim=-1)  # (B, N, 2*F*3)
        sin = angles.sin().repeat_interleave(2, dim=-1)
        pad = rope.dim % num_rope_elems
        if pad:
            cos = torch.cat([torch.ones_like(cos[..., :pad]), cos], dim=-1)  # (B, N, D)
            sin = torch.cat([torch.zeros_like(sin[..., :pad]), sin], dim=-1)
        return cos, sin
    pad = rope.dim // 2 - angles.shape[-1]
    cos, sin = angles.cos(), angles.sin()
    if pad:
        cos = torch.cat([torch.ones_like(cos[..., :pad]), cos], dim=-1)  # (B, N, D/2)
        sin = torch.cat([torch.zeros_like(sin[..., :pad]), sin], dim=-1)
    heads = rope.num_attention_heads
    cos = cos.reshape(batch_size, -1, heads, cos.shape[-1] // heads).transpose(1, 2)  # (B, A, N, R)
    sin = sin.reshape(batch_size, -1, heads, sin.shape[-1] // heads).transpose(1, 2)
    return cos, sin


def apply_rope(x: torch.Tensor, tables: RopeTables, rope_type: str) -> torch.Tensor:
    """Rotate ``x`` (B, N, D). Below float64 this is diffusers' own function (fp32 math, bit-exact with the
    reference); in float64 the same rotation runs in float64."""
    if x.dtype != torch.float64:
        if rope_type == "interleaved":
            return apply_interleaved_rotary_emb(x, tables)
        return apply_split_rotary_emb(x, tables)
    cos, sin = (t.to(torch.float64) for t in tables)
    if rope_type == "interleaved":
        pairs = x.unflatten(-1, (-1, 2))  # (B, N, D/2, 2)
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (B, N, D)
        return x * cos + rotated * sin
    batch, heads, tokens, half = cos.shape
    per_head = x.reshape(batch, tokens, heads, 2, half).transpose(1, 2)  # (B, A, N, 2, R)
    first, second = per_head[..., 0, :], per_head[..., 1, :]
    out = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-2)  # (B, A, N, 2, R)
    return out.transpose(1, 2).reshape(batch, tokens, heads * 2 * half)  # (B, N, D)
