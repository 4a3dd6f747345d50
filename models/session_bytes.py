"""What a session holds on the device, in bytes, by part: estimated before anything is allocated (admission
reserves it; the capacity plan, ``models.plan``, prints it) and counted from the tensors a live session holds
(accounting, and what parking moves: ``models.move``).

The estimate is a pure function of plain values (model shape, session config, frame geometry, dtype), so it needs
no model; tests/models/test_session_bytes.py checks it against what a session really allocates.
"""

from __future__ import annotations

import torch

from .session import Geometry

KV_PARTS = ("kv_window", "kv_sink", "kv_history_keys", "kv_rollback")


def session_bytes_estimate(num_layers: int, inner_dim: int, config, geometry: Geometry,
                           dtype: torch.dtype, *, prompt_tokens: int = 0, caption_channels: int = 0,
                           chunk_frames: int = 0) -> dict[str, int]:
    """What a session of ``config`` on frames of ``geometry`` will hold on the device once its sink is captured, by
    part, computed without allocating: the KV window buffers exactly as ``models.kv.SessionKV`` allocates them (window
    with its block slot, the sink's pre-RoPE keys, with rebased positions the history's pre-RoPE keys), the pending
    frames of one full step (``max(sink_frames, block_size)`` frames: what a session holds between two chunks at most
    when its client sends block-sized chunks) or of one chunk of ``chunk_frames`` frames with what a previous one left
    (``chunk_frames + block_size - 1``), the prompt of ``prompt_tokens`` tokens (its embeds as the session keeps them,
    and what cross-attention reads of them: every layer's keys and values), and the rollback copies
    a chunk of ``chunk_frames`` frames may make (``SessionKV._save_for_rollback``: the history frames it pushes out of
    the window, each layer's K and V and, rebased, its pre-RoPE key). A video decoder's state is not in it: it depends
    on the VAE and is counted once it exists. Every part a session may hold goes here, so admission
    (``app.sessions.parking``) reserves it from this one function."""
    element = torch.empty((), dtype=dtype).element_size()
    tokens = geometry.tokens_per_frame
    capacity = (config.sink_frames + config.max_history_frames + config.block_size) * tokens
    per_token = geometry.batch * inner_dim * element  # one layer's K (or V) for one token
    rebased = config.positions == "rebased"
    pending_frames = max(config.sink_frames, config.block_size, chunk_frames + config.block_size - 1)
    # A chunk pushes out at most its own frames (rounded up to whole blocks) and never more than the history holds.
    pushed_out = min(-(-chunk_frames // config.block_size) * config.block_size, config.max_history_frames)
    return {
        "kv_window": num_layers * 2 * capacity * per_token,
        "kv_sink": num_layers * config.sink_frames * tokens * per_token,
        "kv_history_keys": num_layers * (capacity - config.sink_frames * tokens) * per_token if rebased else 0,
        "kv_rollback": num_layers * (3 if rebased else 2) * pushed_out * tokens * per_token,
        "pending": pending_frames * geometry.batch * geometry.channels * tokens * element,
        # (B, L, caption) embeds + every layer's cross-attention K/V (Y, 2, B, L, D) (models.step.prepare_prompt).
        # A prompt mask that is not all ones adds (B, L) + (B, A, 1, L): left out, under 0.01% of the K/V at the
        # released widths (A = 32 heads against 2 x 48 x 4096).
        "prompt": geometry.batch * prompt_tokens * (caption_channels + 2 * num_layers * inner_dim) * element,
    }


def session_tensors(session) -> dict[str, list[torch.Tensor]]:
    """Every tensor a ``RefinerSession`` holds, by part (what its bytes are and what parking moves). The generator
    state is left out: it is a few KiB of host memory on every device."""
    kv, state = session.kv, session.state
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in (*KV_PARTS, "pending", "prompt")}
    if kv is not None:
        parts["kv_window"].append(kv.window)
        parts["kv_sink"].append(kv.sink_key)
        if kv.history_key is not None:
            parts["kv_history_keys"].append(kv.history_key)
        parts["kv_rollback"].extend(kv.rollback_tensors())
    if state.pending is not None:
        parts["pending"].append(state.pending)
    if state.prompt is not None:
        parts["prompt"].extend(t for t in (state.prompt.embeds, state.prompt.mask) if t is not None)
    prepared = session._prepared
    if prepared is not None:
        parts["prompt"].extend(t for t in (prepared[1].kv, prepared[1].mask) if t is not None)
    return parts


def session_bytes(session) -> dict[str, int]:
    """``session_tensors``' bytes by part."""
    return {name: sum(t.nbytes for t in tensors) for name, tensors in session_tensors(session).items()}
