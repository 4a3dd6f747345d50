"""One model call over the forwards of several sessions: the batched step.

Shape letters: R rows (the sum of the sessions' batches), N tokens per row, C latent channels, D inner dim.

A ``RowForward`` is what one session asks of a forward: its block's tokens at one noise level, the RoPE of
its positions, its window (``models.kv``) and its prompt. ``run_batch`` stacks the rows of forwards whose blocks
have the same token count N and runs the refiner once. It follows diffusers'
``SanaWMLTX2RefinerTransformer3DModel.forward`` step for step (and calls the model's own blocks, so hooks on them
see every forward), with three differences that keep each session's bits independent of its neighbours and
save work:

1. the timestep embedding is computed once per row instead of once per token (every token of a row shares its
   sigma; the per-row values are broadcast), and one row at a time (``time_embedding``: its GEMMs then never see
   the batch);
2. the prompt reaches cross-attention as each layer's K/V (``PreparedPrompt``, computed once per prompt);
3. self- and cross-attention run per session (``models.attention``).

A forward of a single session is the same call with one row, so solo and batched forwards share every line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .attention import (
    ForwardWindow,
    PreparedPrompt,
    PromptBatch,
    RowWindow,
    WindowMode,
    check_processors,
    processor_names,
)
from .kv import SessionKV
from .rope import RopeTables
from .transfer import to_device


@dataclass(frozen=True)
class RowForward:
    """One session's next forward: its block tokens (B, N, C) at noise level ``sigma``."""

    kv: SessionKV
    tokens: torch.Tensor
    sigma: float
    mode: WindowMode
    tables: RopeTables
    history_frames: int
    frames: int
    prompt: PreparedPrompt
    owner: object = None

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def group(self) -> tuple[int, torch.dtype, torch.device]:
        """Forwards that can share one model call: same tokens per row, dtype and device."""
        return int(self.tokens.shape[1]), self.tokens.dtype, self.tokens.device


def prepare_prompt(model: torch.nn.Module, embeds: torch.Tensor, mask: torch.Tensor | None) -> PreparedPrompt:
    """What cross-attention reads of a prompt (B, L, caption_channels): every layer's K/V and the attention mask,
    computed as diffusers' forward computes them per forward (caption projection, then each attn2's ``to_k`` +
    ``norm_k`` and ``to_v``; the mask as ``(1 - mask) * -10000`` through ``prepare_attention_mask``), here once.
    ``mask`` None means attend to every token: no mask then (``check_prompt`` turns an all-ones mask into None)."""
    batch, length = embeds.shape[0], embeds.shape[1]
    blocks = model.transformer_blocks
    with torch.no_grad():
        projected = model.caption_projection(embeds)
        projected = projected.view(batch, -1, projected.shape[-1])  # (B, L, D)
        kv = projected.new_empty(len(blocks), 2, batch, length, projected.shape[-1])  # (Y, 2, B, L, D)
        for index, block in enumerate(blocks):
            attn = block.attn2
            kv[index, 0] = attn.norm_k(attn.to_k(projected))
            kv[index, 1] = attn.to_v(projected)
        attention_mask = None
        if mask is not None:
            attn = blocks[0].attn2  # every layer's attn2 has the same heads
            bias = ((1 - mask.to(embeds.dtype)) * -10000.0).unsqueeze(1)  # (B, 1, L)
            attention_mask = attn.prepare_attention_mask(bias, length, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])  # (B, A, 1, L)
    return PreparedPrompt(kv=kv, mask=attention_mask)


def build_window(forwards: Sequence[RowForward], num_layers: int) -> ForwardWindow:
    """The one-shot cache view of a model call over ``forwards``, their rows stacked in order."""
    windows, start = [], 0
    for forward in forwards:
        windows.append(
            RowWindow(forward.kv, forward.mode, forward.tables, forward.history_frames, forward.frames, start,
                      start + forward.rows, forward.prompt, forward.owner)
        )
        start += forward.rows
    return ForwardWindow(windows, num_layers)


def run_batch(model: torch.nn.Module, forwards: Sequence[RowForward], pad_to: int | None = None,
              body=None) -> list[torch.Tensor]:
    """The velocity (B, N, C) of each forward, from one model call over all of them.

    ``pad_to``: run the call at this many rows, the ones past the forwards' zeros (a compiled step keeps a few
    fixed batch sizes); ``body``: what runs the model (``forward_body``, or a compiled form of it)."""
    if not forwards:
        return []
    groups = {forward.group for forward in forwards}
    if len(groups) != 1:
        raise ValueError(f"forwards of one model call must share (tokens per row, dtype, device); got {groups}")
    check_processors(model, "+".join(sorted({f.mode for f in forwards})))
    window = build_window(forwards, len(model.transformer_blocks))
    rows = window.rows[-1].row_end
    padding = 0 if pad_to is None else pad_to - rows
    if padding < 0:
        raise ValueError(f"{rows} rows do not fit a call of {pad_to}")

    tokens = forwards[0].tokens if len(forwards) == 1 else torch.cat([f.tokens for f in forwards])  # (R, N, C)
    multiplier = float(model.config.timestep_scale_multiplier)
    sigmas = [f.sigma * multiplier for f in forwards for _ in range(f.rows)] + [0.0] * padding
    timestep = to_device(torch.tensor(sigmas, dtype=torch.float32), tokens.device, torch.float32)  # (R,)
    if padding:
        tokens = torch.cat([tokens, tokens.new_zeros(padding, *tokens.shape[1:])])  # (R + padding, N, C)
    with torch.no_grad():
        velocity = (body or forward_body)(model, tokens, timestep, window, PromptBatch(window.rows),
                                          window.kv_cache_mode)
    window.writes.verify(processor_names(model))
    if len(forwards) == 1 and not padding:
        return [velocity]
    return list(velocity[:rows].split([f.rows for f in forwards]))


def forward_body(model: torch.nn.Module, tokens: torch.Tensor, timestep: torch.Tensor, window: ForwardWindow,
                 prompts: PromptBatch, kv_cache_mode: str) -> torch.Tensor:
    """The model call proper: velocity (R, N, C) for ``tokens`` (R, N, C) at ``timestep`` (R,). Only tensors of
    fixed shapes reach the per-token code; everything that differs from one mix of sessions to another stays in
    ``window`` and ``prompts``, read by the attention functions (kept out of ``torch.compile``)."""
    # 1. Input projection.
    hidden = model.proj_in(tokens)  # (R, N, D)
    # 2. Timestep embedding and modulation, once per row, each at one row.
    temb, embedded = time_embedding(model, timestep, hidden.dtype)  # (R, 1, 6D), (R, 1, D)
    # 3. Transformer blocks; attention per session.
    for index, block in enumerate(model.transformer_blocks):
        hidden = block(
            hidden_states=hidden,
            encoder_hidden_states=prompts,
            temb=temb,
            video_rotary_emb=None,
            encoder_attention_mask=None,
            sink_rotary_emb=None,
            kv_cache=window.get(index),
            kv_cache_mode=kv_cache_mode,
        )
    # 4. Output norm and projection.
    scale_shift = model.scale_shift_table[None, None] + embedded[:, :, None]  # (R, 1, 2, D)
    shift, scale = scale_shift[:, :, 0], scale_shift[:, :, 1]
    hidden = model.norm_out(hidden)
    hidden = hidden * (1 + scale) + shift
    return model.proj_out(hidden)  # (R, N, C)


def time_embedding(model: torch.nn.Module, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The modulation (R, 1, 6D) and embedded timestep (R, 1, D) of each row's ``timestep`` (R,), computed one row
    at a time.

    Why one row at a time: these GEMMs have one output row per batch row (M = R), and a CPU BLAS picks its kernel and
    reduction order by M: MKL rounds ``F.linear(x[:1])[0]`` differently from ``F.linear(x[:R])[0]`` for every R in
    2..8 on AVX2-only CPUs, even in its strict reproducible mode (measured; docs/benchmarks.md). At M = 1 whatever
    the batch, a row's modulation has the same bits alone and stacked, by construction rather than by a CPU's luck.
    The cost is R small GEMMs instead of one per forward (measured: docs/benchmarks.md, "Batch invariance")."""
    temb, embedded = [], []
    for row in range(timestep.shape[0]):
        row_temb, row_embedded = model.time_embed(timestep[row : row + 1], batch_size=1, hidden_dtype=dtype)
        temb.append(row_temb)  # (1, 6D)
        embedded.append(row_embedded)  # (1, D)
    return torch.stack(temb), torch.stack(embedded)  # (R, 1, 6D), (R, 1, D)


def run_isolated(model: torch.nn.Module, forwards: Sequence[RowForward], runner=None) -> list[torch.Tensor | Exception]:
    """``run_batch`` (or ``runner(model, forwards)``), and if the batched call fails, each forward again on its
    own, so that only a forward that fails by itself gets an error (in its place in the list); the others get
    their velocity. Batch invariance makes those the bytes the batched call would have given."""
    runner = runner or run_batch
    try:
        return list(runner(model, forwards))
    except Exception as batch_error:
        if len(forwards) == 1:
            return [batch_error]
    results: list[torch.Tensor | Exception] = []
    for forward in forwards:
        try:
            results.append(runner(model, [forward])[0])
        except Exception as error:  # this forward's own failure, reported to its owner only
            results.append(error)
    return results
