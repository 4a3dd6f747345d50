"""A session's KV cache, laid out as the attention window it feeds, in buffers allocated once.

Shape letters: Y layers, B batch, T tokens per frame, N tokens, D inner dim.

Every forward of a block attends to ``[sink | history | block]``. Instead of concatenating that window per
forward (a copy of the whole cache, per layer, per forward), the cache *is* the window: one preallocated
tensor per session holds, for every layer, K and V in that order, with room for one block at the end:

    window (Y, 2, B, (S + Hmax + block_size) * T, D)      [0] = K, RoPE applied; [1] = V
            |<- sink S ->|<- history h <= Hmax ->|<- block f ->|

- Each forward writes its block's K/V into the block slot and attends to ``window[:, :, :end]``: no copy.
- The sink's K is kept pre-RoPE (``sink_key``) and rotated into the sink slot once per block, at the position
  the block needs (the sink slides to sit just before the oldest history frame).
- Committing a block keeps what its last forward (the commit forward) wrote: while the history has room that
  is only a counter; once it is full, the history moves left by the frames it drops, in place.
- With rebased positions the history is re-rotated every block, so its keys are also kept pre-RoPE
  (``history_key``, same offsets as the history and block slots) and rotated into the window per block.

Key order inside the window is the reference's (sink, oldest history first, block), so attention sums in the
same order and stays bit-identical to diffusers' concatenation.

A session may be rolled back to a checkpoint (an HTTP chunk is all or nothing). Commits only append or drop
the oldest history frames, so a ``Checkpoint`` remembers the counters and, when a commit overwrites history
frames that existed at the checkpoint, a copy of those frames (never more than the history itself); rolling
back moves the surviving frames back and writes the saved ones in front. Checkpoints nest (a block whose finite
verdict is read late, inside an HTTP chunk): rolling back an inner one also takes back what the outer ones saved
since it was taken, since those frames are in the window again.

Bookkeeping (``WindowLayout``) is plain Python; tensors live in ``SessionKV``. Not thread-safe: the engine
thread owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .transfer import pinned_empty

RopeFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class WindowLayout:
    """Where each part of the window sits, in tokens. Frames are ``tokens_per_frame`` tokens each."""

    sink_frames: int
    max_history_frames: int
    block_frames: int  # the largest block (block_size): the slot reserved after the history
    tokens_per_frame: int

    @property
    def capacity_frames(self) -> int:
        return self.sink_frames + self.max_history_frames + self.block_frames

    @property
    def capacity(self) -> int:
        return self.capacity_frames * self.tokens_per_frame

    @property
    def sink_tokens(self) -> int:
        return self.sink_frames * self.tokens_per_frame

    def history(self, history_frames: int) -> tuple[int, int]:
        """Token range of the history in the window."""
        return self.sink_tokens, self.sink_tokens + history_frames * self.tokens_per_frame

    def block(self, history_frames: int, frames: int) -> tuple[int, int]:
        """Token range of a ``frames``-frame block written after ``history_frames`` of history."""
        if frames > self.block_frames or history_frames > self.max_history_frames:
            raise ValueError(
                f"a {frames}-frame block after {history_frames} history frames does not fit a window of "
                f"{self.block_frames}-frame blocks and {self.max_history_frames} history frames"
            )
        start = self.sink_tokens + history_frames * self.tokens_per_frame
        return start, start + frames * self.tokens_per_frame

    def after_commit(self, history_frames: int, frames: int) -> tuple[int, int]:
        """(history frames after committing a ``frames``-frame block, oldest frames dropped to make room)."""
        grown = history_frames + frames
        dropped = max(grown - self.max_history_frames, 0)
        return grown - dropped, dropped


@dataclass(eq=False)
class Checkpoint:
    """What ``SessionKV.rollback`` needs to return to the moment ``checkpoint`` was called. Compared by identity:
    two open checkpoints (an HTTP chunk's and, around a commit whose verdict is read later, the block's) may hold
    equal counters, and their saved tensors have no truth value."""

    had_sink: bool
    history_frames: int
    # Copies of the history frames that existed at the checkpoint and were overwritten since, oldest first:
    # window pieces (Y, 2, B, n*T, D) and, with rebased positions, pre-RoPE key pieces (Y, B, n*T, D).
    saved: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    saved_frames: int = 0
    # Each checkpoint open when this one was taken, with how many pieces and frames it had saved then: rolling back
    # to this one also takes back what they saved since (those frames are in the window again).
    outer: list[tuple[Checkpoint, int, int]] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return sum(w.nbytes + (0 if k is None else k.nbytes) for w, k in self.saved)


class SessionKV:
    """The KV cache of one session, for every layer, in preallocated window buffers."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        layout: WindowLayout,
        inner_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        rebased: bool,
        pin: bool = False,
    ):
        """``pin``: in page-locked host memory (``device`` the CPU), for a cache built on the host that goes to a
        CUDA device next without a host wait (an adopted session, ``app.persistence.records.host_session``)."""
        if pin and torch.device(device).type != "cpu":
            raise ValueError(f"pin=True builds the cache in host memory, not on {device}")
        self.layout = layout
        self.num_layers = num_layers
        self.batch = batch
        self.rebased = rebased

        def zeros(*shape: int) -> torch.Tensor:
            if pin:
                return pinned_empty(shape, dtype).zero_()
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.window = zeros(num_layers, 2, batch, layout.capacity, inner_dim)  # (Y, 2, B, N_window, D)
        self.sink_key = zeros(num_layers, batch, layout.sink_tokens, inner_dim)  # (Y, B, S*T, D), pre-RoPE
        # Rebased only: pre-RoPE keys of the history and the block slot, at window offsets minus the sink.
        self.history_key = (
            zeros(num_layers, batch, layout.capacity - layout.sink_tokens, inner_dim) if rebased else None
        )  # (Y, B, (Hmax + block)*T, D)
        self.has_sink = False
        self.history_frames = 0
        self._checkpoints: list[Checkpoint] = []

    # --- what forwards read and write ---------------------------------------------------------------------
    def key(self, layer: int) -> torch.Tensor:
        return self.window[layer, 0]  # (B, N_window, D)

    def value(self, layer: int) -> torch.Tensor:
        return self.window[layer, 1]

    def prepare_block(self, rotate_sink: Callable[[int, torch.Tensor], torch.Tensor],
                      rotate_history: Callable[[int, torch.Tensor], torch.Tensor] | None) -> None:
        """Rotate the sink (and, rebased, the history) keys into the window for the next block's positions.
        ``rotate_*(layer, pre_rope_keys)`` returns the rotated keys. Touches only derived data, so a block that
        later fails leaves nothing to undo."""
        if not self.has_sink:
            raise RuntimeError("the sink was not captured yet; capture it before refining a block")
        layout = self.layout
        start, end = layout.history(self.history_frames)
        for layer in range(self.num_layers):
            keys = self.window[layer, 0]
            keys[:, : layout.sink_tokens] = rotate_sink(layer, self.sink_key[layer])
            if self.rebased and rotate_history is not None and end > start:
                keys[:, start:end] = rotate_history(layer, self.history_key[layer, :, : end - start])

    def commit_sink(self) -> None:
        """The sink forward wrote ``sink_key`` and the sink's V; the session has its sink now."""
        self.has_sink = True
        self.history_frames = 0

    def commit_block(self, frames: int) -> None:
        """Keep the block the last forward wrote into the block slot as the newest history frames."""
        layout = self.layout
        kept, dropped = layout.after_commit(self.history_frames, frames)
        if dropped:
            if self._checkpoints:
                self._save_for_rollback(dropped)
            tokens = layout.tokens_per_frame
            begin = layout.sink_tokens
            keep = kept * tokens
            _shift_left(self.window, 3, begin, keep, dropped * tokens)
            if self.history_key is not None:
                _shift_left(self.history_key, 2, 0, keep, dropped * tokens)
        self.history_frames = kept

    # --- rollback ------------------------------------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        """Remember this moment; commits from now on keep what ``rollback`` needs. End with ``rollback`` or
        ``release``."""
        mark = Checkpoint(self.has_sink, self.history_frames,
                          outer=[(c, len(c.saved), c.saved_frames) for c in self._checkpoints])
        self._checkpoints.append(mark)
        return mark

    def release(self, mark: Checkpoint) -> None:
        """Forget ``mark`` (the work it guarded succeeded)."""
        self._checkpoints = [c for c in self._checkpoints if c is not mark]

    def rollback(self, mark: Checkpoint) -> None:
        """Return the cache to the moment ``mark`` was taken (and forget every later checkpoint)."""
        if mark not in self._checkpoints:
            raise RuntimeError("rollback to a checkpoint that was released or already rolled back")
        index = self._checkpoints.index(mark)
        self._checkpoints = self._checkpoints[:index]
        for outer, pieces, frames in mark.outer:  # the window is as at ``mark`` again: so are their copies
            del outer.saved[pieces:]
            outer.saved_frames = frames
        if not mark.had_sink:
            self.has_sink = False
            self.history_frames = 0
            return
        layout, tokens = self.layout, self.layout.tokens_per_frame
        saved = mark.saved_frames
        if saved:
            begin = layout.sink_tokens
            survivors = (mark.history_frames - saved) * tokens
            _shift_right(self.window, 3, begin, survivors, saved * tokens)
            if self.history_key is not None:
                _shift_right(self.history_key, 2, 0, survivors, saved * tokens)
            offset = 0
            for window_piece, key_piece in mark.saved:
                width = window_piece.shape[3]
                self.window[:, :, :, begin + offset : begin + offset + width] = window_piece
                if key_piece is not None:
                    self.history_key[:, :, offset : offset + width] = key_piece
                offset += width
        self.has_sink = True
        self.history_frames = mark.history_frames

    def _save_for_rollback(self, dropped: int) -> None:
        """Before ``dropped`` oldest history frames are overwritten, copy those that an open checkpoint still
        needs (frames that existed when it was taken and were not saved yet)."""
        tokens = self.layout.tokens_per_frame
        begin = self.layout.sink_tokens
        for mark in self._checkpoints:
            if not mark.had_sink:
                continue  # rolling back to it discards the whole cache
            # The checkpoint's frames that are still here sit at the front of the history, oldest first.
            still_here = mark.history_frames - mark.saved_frames
            count = min(dropped, still_here)
            if count <= 0:
                continue
            window_piece = self.window[:, :, :, begin : begin + count * tokens].clone()  # (Y, 2, B, n*T, D)
            key_piece = None
            if self.history_key is not None:
                key_piece = self.history_key[:, :, : count * tokens].clone()  # (Y, B, n*T, D)
            mark.saved.append((window_piece, key_piece))
            mark.saved_frames += count

    # --- accounting and snapshots -------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes allocated for this cache (the window with its block slot, the pre-RoPE keys)."""
        total = self.window.nbytes + self.sink_key.nbytes
        return total + (0 if self.history_key is None else self.history_key.nbytes)

    @property
    def live_bytes(self) -> int:
        """Bytes of the cache proper: sink K/V and history K/V over every layer (what a snapshot stores)."""
        if not self.has_sink:
            return 0
        frames = self.layout.sink_frames + self.history_frames
        element = self.window.element_size()
        per_frame = 2 * self.num_layers * self.batch * self.layout.tokens_per_frame * self.window.shape[-1] * element
        return frames * per_frame

    @property
    def checkpoint_bytes(self) -> int:
        return sum(mark.saved_bytes for mark in self._checkpoints)

    @property
    def rollback_open(self) -> bool:
        """Whether a rollback point is open (a chunk is being refined): the cache must not move meanwhile."""
        return bool(self._checkpoints)

    def rollback_tensors(self) -> list[torch.Tensor]:
        """The copies open rollback points hold (the history frames pushed out since; K and V, and with rebased
        positions the pre-RoPE key): what they add to the session's bytes."""
        return [t for mark in self._checkpoints for pieces in mark.saved for t in pieces if t is not None]

    def export(self) -> dict[str, list[torch.Tensor]]:
        """Per layer: ``sink_key`` (pre-RoPE), ``sink_value``, ``history_key`` (rotated with absolute positions,
        pre-RoPE with rebased ones), ``history_value``; each (B, n, D), views into the buffers."""
        start, end = self.layout.history(self.history_frames)
        sink = self.layout.sink_tokens
        out: dict[str, list[torch.Tensor]] = {"sink_key": [], "sink_value": [], "history_key": [], "history_value": []}
        for layer in range(self.num_layers):
            out["sink_key"].append(self.sink_key[layer])
            out["sink_value"].append(self.window[layer, 1, :, :sink])
            if self.history_key is not None:
                out["history_key"].append(self.history_key[layer, :, : end - start])
            else:
                out["history_key"].append(self.window[layer, 0, :, start:end])
            out["history_value"].append(self.window[layer, 1, :, start:end])
        return out

    def load(self, sink_key, sink_value, history_key, history_value, history_frames: int) -> None:
        """Fill the cache from per-layer tensors laid out as ``export`` returns them."""
        start, end = self.layout.history(history_frames)
        sink = self.layout.sink_tokens
        for layer in range(self.num_layers):
            self.sink_key[layer].copy_(sink_key[layer])
            self.window[layer, 1, :, :sink] = sink_value[layer]
            if end == start:
                continue
            if self.history_key is not None:
                self.history_key[layer, :, : end - start] = history_key[layer]
            else:
                self.window[layer, 0, :, start:end] = history_key[layer]
            self.window[layer, 1, :, start:end] = history_value[layer]
        self.has_sink = True
        self.history_frames = history_frames


def _shift_left(buffer: torch.Tensor, dim: int, begin: int, keep: int, by: int) -> None:
    """Move ``buffer``'s tokens ``[begin + by, begin + by + keep)`` along ``dim`` to ``[begin, begin + keep)``, in
    place, in pieces no longer than ``by`` so that no piece overlaps its source."""
    for offset in range(0, keep, by):
        width = min(by, keep - offset)
        target = buffer.narrow(dim, begin + offset, width)
        target.copy_(buffer.narrow(dim, begin + offset + by, width))


def _shift_right(buffer: torch.Tensor, dim: int, begin: int, keep: int, by: int) -> None:
    """The inverse of ``_shift_left``: tokens ``[begin, begin + keep)`` move to ``[begin + by, begin + by + keep)``,
    back to front."""
    offset = keep
    while offset > 0:
        width = min(by, offset)
        offset -= width
        target = buffer.narrow(dim, begin + by + offset, width)
        target.copy_(buffer.narrow(dim, begin + offset, width))
