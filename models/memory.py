"""Host memory behaviour that decides whether a batched forward on the CPU pays for page faults.

A batched forward's activations are big (8 sessions x 192 tokens x 1536 = 9 MB per FF tensor for the medium
refiner at 8x8). glibc serves allocations that large with ``mmap`` and returns them to the kernel on ``free``, so
every such tensor of every forward is faulted in again, page by page: measured here, a stacked forward of eight
sessions took 58,000 minor page faults and ~10% of its time; a solo forward's smaller tensors stay in the heap
and take none. PyTorch's CPU tuning guide swaps in jemalloc or tcmalloc for this; glibc's own ``mallopt`` knobs
do the same job without a preloaded library: allocations up to 32 MiB come from the heap, and freed memory stays
there for the next forward (resident memory then stays at its high-water mark instead of breathing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

from .session import Geometry

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit systems
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Make glibc keep large freed blocks for reuse (see the module docstring). True if it took effect; False where
    the C library is not glibc (nothing changes there)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if not ok:
        log.warning("mallopt refused the heap settings; large CPU tensors will be page-faulted in every forward")
    return ok


# --- what a session holds -------------------------------------------------------------------------------------------
# Its bytes, by part, for admission (before anything is allocated), accounting and parking. Kept pure functions of
# plain values (model shape, session config, frame geometry, dtype) so a capacity plan can use them without a model.

KV_PARTS = ("kv_window", "kv_sink", "kv_history_keys", "kv_rollback")


# A session's latent frames (batch, channels, height, width), fixed by its first chunk: the session's own type.
FrameGeometry = Geometry


def session_bytes_estimate(num_layers: int, inner_dim: int, config, geometry: FrameGeometry,
                           dtype: torch.dtype, *, prompt_tokens: int = 0, caption_channels: int = 0,
                           chunk_frames: int = 0) -> dict[str, int]:
    """What a session of ``config`` on frames of ``geometry`` will hold on the device once its sink is captured, by
    part, computed without allocating: the KV window buffers exactly as ``models.kv.SessionKV`` allocates them (window
    with its block slot, the sink's pre-RoPE keys, with rebased positions the history's pre-RoPE keys), the pending
    frames of one full step (``max(sink_frames, block_size)`` frames: what a session holds between two chunks at most
    when its client sends block-sized chunks) or of one chunk of ``chunk_frames`` frames with what a previous one left
    (``chunk_frames + block_size - 1``), the prompt of ``prompt_tokens`` tokens (its embeds and mask as the session
    keeps them, and what cross-attention reads of them: the projection and the mask's bias), and the rollback copies
    a chunk of ``chunk_frames`` frames may make (``SessionKV._save_for_rollback``: the history frames it pushes out of
    the window, each layer's K and V and, rebased, its pre-RoPE key). A video decoder's state is not in it: it depends
    on the VAE and is counted once it exists. Every part a session may hold goes here, so admission
    (``app.parking``) reserves it from this one function."""
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
        # (B, L, caption) embeds + (B, L) mask, (B, L, D) projection + (B, 1, L) bias
        "prompt": geometry.batch * prompt_tokens * (caption_channels + 1 + inner_dim + 1) * element,
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
        for mark in kv._checkpoints:
            for window_piece, key_piece in mark.saved:
                parts["kv_rollback"].extend(t for t in (window_piece, key_piece) if t is not None)
    if state.pending is not None:
        parts["pending"].append(state.pending)
    if state.prompt is not None:
        parts["prompt"].extend(t for t in (state.prompt.embeds, state.prompt.mask) if t is not None)
    prepared = session._prepared
    if prepared is not None:
        parts["prompt"].extend(t for t in (prepared[1].embeds, prepared[1].bias) if t is not None)
    return parts


def session_bytes(session) -> dict[str, int]:
    """``session_tensors``' bytes by part."""
    return {name: sum(t.nbytes for t in tensors) for name, tensors in session_tensors(session).items()}


class Move:
    """Tensors of a session on their way to another device, queued without waiting.

    Device to host (parking, on CUDA): the copies go on a side stream that first waits for everything queued on the
    engine's stream (the last forwards that wrote the cache), into pinned host memory; the source tensors are marked
    as used by that stream, so the caching allocator reuses their memory only once the copies are done, and the
    engine thread never waits. ``ready`` is the event they complete with: whoever reads the host copies waits for it
    (``after`` on the device, ``synchronize`` on the host). Host to device (a page-in): the copies are queued on the
    engine's own stream, from pinned memory, so the forwards that follow are ordered after them. Elsewhere (CPU to
    CPU) nothing is copied unless ``copy`` asks for it (tests do, to prove that no tensor of the moved session is
    shared with the one before)."""

    def __init__(self, device: torch.device, copy: bool = False):
        self.device = torch.device(device)
        self.copy = copy
        self.ready = None
        self._stream = None
        self._context = None

    def __enter__(self) -> Move:
        if self.device.type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized():
            self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            self._context = torch.cuda.stream(self._stream)
            self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._stream is not None:
            self._context.__exit__(*exc)
            self.ready = torch.cuda.Event()
            self.ready.record(self._stream)

    def __call__(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        if tensor.device.type == self.device.type and (self.device.type == "cpu" or tensor.device == self.device):
            return tensor.clone() if self.copy else tensor
        if self.device.type == "cpu":  # from CUDA, on the side stream
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._stream)
            return host
        staged = tensor if tensor.is_pinned() else tensor.pin_memory()
        return staged.to(self.device, non_blocking=True)

    @staticmethod
    def after(ready) -> None:
        """Make the current stream wait for a move's copies (no host wait)."""
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)


def move_session(session, device: torch.device, copy: bool = False):
    """Move every tensor ``session`` holds (its KV cache, pending frames and prompt) to ``device`` in place, without
    a host wait; returns the CUDA event the copies complete with (None elsewhere). The caption projection prepared
    from the prompt is dropped (recomputed from the moved prompt by the next forward, bit for bit: it is the same
    computation on the same values). Only the engine thread may call this, between two of its jobs, and only for a
    session with no run in flight (nothing else reads those tensors then)."""
    import dataclasses

    state = session.state
    if session.kv is not None and session.kv._checkpoints:
        raise RuntimeError("a session is moved between two pieces of work, never with a rollback point open")
    with Move(device, copy) as move:
        kv = session.kv
        if kv is not None:
            kv.window = move(kv.window)
            kv.sink_key = move(kv.sink_key)
            kv.history_key = move(kv.history_key)
        prompt = state.prompt
        if prompt is not None:
            prompt = type(prompt)(embeds=move(prompt.embeds), mask=move(prompt.mask))
        session.load(dataclasses.replace(state, pending=move(state.pending), prompt=prompt), kv)
        session._prepared = None
    return move.ready
