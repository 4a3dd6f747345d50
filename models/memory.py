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
from .transfer import pinned_copy, pinned_empty

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
    (``chunk_frames + block_size - 1``), the prompt of ``prompt_tokens`` tokens (its embeds as the session keeps them,
    and what cross-attention reads of them: every layer's keys and values), and the rollback copies
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
        for mark in kv._checkpoints:
            for window_piece, key_piece in mark.saved:
                parts["kv_rollback"].extend(t for t in (window_piece, key_piece) if t is not None)
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


class Move:
    """Tensors of a session on their way to another device, queued on a side stream without waiting.

    Both ways the copies run on a side stream of the CUDA device, so neither the engine thread nor the engine's
    (compute) stream waits for them:

    - Device to host (parking): the side stream first waits for everything queued on the compute stream (the last
      forwards that wrote the cache); the copies go into exact-size pinned host buffers
      (``models.transfer.pinned_empty``: the caching host allocator would round a 9 GiB window up to 16 GiB and
      keep it); the source tensors are marked as used by the side stream (``record_stream``), so the caching
      allocator reuses their memory only once the copies are done.
    - Host to device (a page-in): the side stream first waits for ``after`` (the park's own copies); the new device
      tensors are allocated on the side stream and marked as used by the compute stream too (``record_stream``),
      so freeing them later waits for the forwards that read them. The compute stream does *not* wait here: the
      caller makes the session's next forward wait for ``ready`` (``app.engine.wait_for``), so forwards of other
      sessions queued meanwhile run while the window is copied.

    ``ready`` is the event the copies complete with: whoever reads the results waits for it (``after`` on the
    device, ``synchronize`` on the host). The host buffers a page-in reads from are kept alive until ``ready`` has
    passed (``_in_flight``). Elsewhere (CPU to CPU) nothing is copied unless ``copy`` asks for it (tests do, to prove
    that no tensor of the moved session is shared with the one before)."""

    def __init__(self, device: torch.device, copy: bool = False, after=None, cuda_device: torch.device | None = None):
        self.device = torch.device(device)
        self.copy = copy
        self.after = after
        # The CUDA device whose streams carry the copies: the target when it is CUDA, else the tensors' own device
        # (``cuda_device``; the current device when not given).
        self.cuda_device = self.device if self.device.type == "cuda" else cuda_device
        self.ready = None
        self._stream = None
        self._compute = None
        self._context = None
        self._sources: list[torch.Tensor] = []

    def __enter__(self) -> Move:
        cuda = self.device.type == "cuda" or (torch.cuda.is_available() and torch.cuda.is_initialized())
        if cuda:
            release_finished()
            device = self.cuda_device or torch.device("cuda", torch.cuda.current_device())
            self._compute = torch.cuda.current_stream(device)
            self._stream = torch.cuda.Stream(device)
            if self.device.type == "cpu":
                self._stream.wait_stream(self._compute)  # the forwards that wrote what is parked
            elif self.after is not None:
                self._stream.wait_event(self.after)  # the park's copies into the host buffers
            self._context = torch.cuda.stream(self._stream)
            self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._stream is not None:
            self._context.__exit__(*exc)
            self.ready = torch.cuda.Event()
            self.ready.record(self._stream)
            if self._sources:
                _in_flight.append((self.ready, self._sources))

    def __call__(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        if tensor.device.type == self.device.type and (self.device.type == "cpu" or tensor.device == self.device):
            return tensor.clone() if self.copy else tensor
        if self.device.type == "cpu":  # from CUDA, on the side stream
            host = pinned_empty(tensor.shape, tensor.dtype)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._stream)
            return host
        staged = pinned_copy(tensor)  # a spilled session's tensors come back from a file in plain memory
        moved = staged.to(self.device, non_blocking=True)
        moved.record_stream(self._compute)  # allocated on the side stream, read by the compute stream's forwards
        self._sources.append(staged)
        return moved

    @staticmethod
    def after_ready(ready) -> None:
        """Make the current stream wait for a move's copies (no host wait)."""
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)


# Host buffers page-ins read from, with the event their copies complete with: released (and their pinning undone)
# once the event has passed, checked without waiting at the next move and at every engine commit.
_in_flight: list[tuple[object, list[torch.Tensor]]] = []


def release_finished() -> None:
    """Drop the host buffers of page-ins whose copies have completed (never waits)."""
    if _in_flight:
        _in_flight[:] = [(event, tensors) for event, tensors in _in_flight if not event.query()]


def move_session(session, device: torch.device, copy: bool = False, after=None):
    """Move every tensor ``session`` holds (its KV cache, pending frames and prompt) to ``device`` in place, without
    a host wait; returns the CUDA event the copies complete with (None elsewhere): reading the moved tensors on the
    device (or on the host) must wait for it. ``after``: an event the copies must wait for first (a page-in waits
    for the park's copies). The caption projection prepared
    from the prompt is dropped (recomputed from the moved prompt by the next forward, bit for bit: it is the same
    computation on the same values). Only the engine thread may call this, between two of its jobs, and only for a
    session with no run in flight (nothing else reads those tensors then)."""
    import dataclasses

    state = session.state
    if session.kv is not None and session.kv._checkpoints:
        raise RuntimeError("a session is moved between two pieces of work, never with a rollback point open")
    held = session.kv.window if session.kv is not None else state.pending
    source = held.device if held is not None and held.device.type == "cuda" else None
    with Move(device, copy, after=after, cuda_device=source) as move:
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
