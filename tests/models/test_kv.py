"""The in-place window cache: bookkeeping without tensors, then the buffers against a plain list-of-frames model,
including rollback to checkpoints across shifts."""

from __future__ import annotations

import random

import pytest
import torch

from models.kv import SessionKV, WindowLayout

LAYOUT = WindowLayout(sink_frames=1, max_history_frames=10, block_frames=3, tokens_per_frame=2)


def test_layout_offsets():
    assert LAYOUT.capacity_frames == 14 and LAYOUT.capacity == 28
    assert LAYOUT.history(0) == (2, 2) and LAYOUT.history(10) == (2, 22)
    assert LAYOUT.block(0, 3) == (2, 8) and LAYOUT.block(10, 3) == (22, 28) and LAYOUT.block(9, 2) == (20, 24)
    with pytest.raises(ValueError, match="does not fit"):
        LAYOUT.block(10, 4)
    # history grows by the block until full, then drops the oldest frames
    assert [LAYOUT.after_commit(h, 3) for h in (0, 3, 6, 9, 10)] == [(3, 0), (6, 0), (9, 0), (10, 2), (10, 3)]
    assert LAYOUT.after_commit(10, 1) == (10, 1)


class FrameModel:
    """What the cache should hold, frame by frame: each frame is a distinct number."""

    def __init__(self):
        self.sink = None
        self.history: list[float] = []

    def commit_block(self, frames: list[float]) -> None:
        self.history = (self.history + frames)[-LAYOUT.max_history_frames :]


def make_kv(rebased: bool) -> SessionKV:
    return SessionKV(num_layers=3, batch=2, layout=LAYOUT, inner_dim=4, dtype=torch.float32,
                     device=torch.device("cpu"), rebased=rebased)


def write_block(kv: SessionKV, values: list[float]) -> None:
    """What a block's forwards do: write K/V (and rebased pre-RoPE K) into the block slot, frame by frame."""
    tokens = LAYOUT.tokens_per_frame
    start, _ = LAYOUT.block(kv.history_frames, len(values))
    for i, value in enumerate(values):
        span = slice(start + i * tokens, start + (i + 1) * tokens)
        kv.window[:, :, :, span] = value
        if kv.history_key is not None:
            kv.history_key[:, :, span.start - LAYOUT.sink_tokens : span.stop - LAYOUT.sink_tokens] = -value


def held_frames(kv: SessionKV) -> list[float]:
    """The history, one number per frame, checked to be the same in every layer, K/V, batch row and token."""
    parts = kv.export()
    frames = []
    tokens = LAYOUT.tokens_per_frame
    for index in range(kv.history_frames):
        span = slice(index * tokens, (index + 1) * tokens)
        values = {float(v) for layer in range(kv.num_layers)
                  for v in (parts["history_value"][layer][:, span].unique(),)[0]}
        if kv.history_key is None:
            values |= {float(v) for layer in range(kv.num_layers) for v in parts["history_key"][layer][:, span].unique()}
        else:
            values |= {-float(v) for layer in range(kv.num_layers) for v in parts["history_key"][layer][:, span].unique()}
        assert len(values) == 1, f"frame {index} is not one value: {values}"
        frames.append(values.pop())
    return frames


def start_with_sink(kv: SessionKV) -> None:
    kv.sink_key.fill_(-1.0)
    kv.window[:, 1, :, : LAYOUT.sink_tokens] = -1.0
    kv.commit_sink()


@pytest.mark.parametrize("rebased", [False, True])
def test_commits_keep_the_newest_history_in_order(rebased):
    kv, model = make_kv(rebased), FrameModel()
    start_with_sink(kv)
    counter = 0.0
    for size in [3, 3, 3, 3, 2, 3, 1, 3, 3, 3, 3]:
        values = [counter + i for i in range(size)]
        counter += size
        write_block(kv, values)
        kv.commit_block(size)
        model.commit_block(values)
        assert held_frames(kv) == model.history
    assert kv.history_frames == LAYOUT.max_history_frames
    # the sink was never touched by the shifts
    assert bool((kv.window[:, 1, :, : LAYOUT.sink_tokens] == -1.0).all())


@pytest.mark.parametrize("rebased", [False, True])
def test_rollback_restores_every_byte_across_shifts(rebased):
    rng = random.Random(3)
    for trial in range(30):
        kv, model = make_kv(rebased), FrameModel()
        start_with_sink(kv)
        counter = 100.0 * trial
        for _ in range(rng.randint(0, 6)):  # some history before the checkpoint
            size = rng.randint(1, 3)
            values = [counter + i for i in range(size)]
            counter += size
            write_block(kv, values)
            kv.commit_block(size)
            model.commit_block(values)
        before = [t.clone() for t in (kv.window, kv.sink_key)]
        history_before = list(model.history)
        mark = kv.checkpoint()
        for _ in range(rng.randint(1, 12)):  # then a transaction that may drop all of it
            size = rng.randint(1, 3)
            values = [counter + i for i in range(size)]
            counter += size
            write_block(kv, values)
            kv.commit_block(size)
        assert mark.saved_frames <= len(history_before), "never saves more than the history it guards"
        kv.rollback(mark)
        assert kv.history_frames == len(history_before)
        assert held_frames(kv) == history_before
        end = LAYOUT.history(kv.history_frames)[1]
        assert torch.equal(kv.window[:, :, :, :end], before[0][:, :, :, :end]), "live window restored bit for bit"
        assert torch.equal(kv.sink_key, before[1])
        assert kv.checkpoint_bytes == 0


def test_rollback_before_the_sink_forgets_the_cache_and_release_forgets_the_checkpoint():
    kv = make_kv(False)
    mark = kv.checkpoint()
    start_with_sink(kv)
    write_block(kv, [1.0, 2.0, 3.0])
    kv.commit_block(3)
    kv.rollback(mark)
    assert not kv.has_sink and kv.history_frames == 0
    with pytest.raises(RuntimeError, match="released or already rolled back"):
        kv.rollback(mark)
    start_with_sink(kv)
    mark = kv.checkpoint()
    for value in range(6):
        write_block(kv, [float(value)] * 3)
        kv.commit_block(3)
    assert mark.saved_frames == 0, "a checkpoint taken with no history needs no copies"
    kv.release(mark)
    write_block(kv, [9.0, 9.0, 9.0])
    kv.commit_block(3)
    assert kv.checkpoint_bytes == 0, "no checkpoint open: commits save nothing"


def test_prepare_block_rotates_only_derived_regions():
    kv = make_kv(True)
    start_with_sink(kv)
    write_block(kv, [1.0, 2.0])
    kv.commit_block(2)
    before_values = kv.window[:, 1].clone()
    kv.prepare_block(lambda layer, keys: keys * 10 + layer, lambda layer, keys: keys * 100)
    assert torch.equal(kv.window[:, 1], before_values), "values untouched"
    assert float(kv.window[2, 0, 0, 0, 0]) == -10.0 + 2, "the sink slot holds the rotated pre-RoPE sink"
    start, end = LAYOUT.history(2)
    assert kv.window[0, 0, :, start:end].unique().tolist() == [-200.0, -100.0]


@pytest.mark.parametrize("rebased", [False, True])
def test_a_block_checkpoint_inside_a_chunk_checkpoint_rolls_back_alone_then_with_the_chunk(rebased):
    """The engine's late verdict (``app.engine.worker``): a checkpoint around one committed block, opened while a chunk's
    checkpoint is open and both hold saved frames; undoing the block returns exactly to before it, then undoing the
    chunk returns to before the chunk (checkpoints are told apart by identity, not by their equal contents)."""
    kv = make_kv(rebased)
    start_with_sink(kv)
    for values in ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]):  # a full history: commits shift it
        write_block(kv, values)
        kv.commit_block(3)
    chunk = kv.checkpoint()
    before_chunk = (held_frames(kv), kv.window.clone(), kv.history_frames)
    write_block(kv, [10.0, 11.0, 12.0])
    kv.commit_block(3)
    before_block = (held_frames(kv), kv.window.clone(), kv.history_frames)
    block = kv.checkpoint()
    write_block(kv, [13.0, 14.0, 15.0])
    kv.commit_block(3)
    assert chunk.saved_frames and block.saved_frames  # both copied what the last commit pushed out
    for mark, (frames, window, history) in ((block, before_block), (chunk, before_chunk)):
        kv.rollback(mark)
        end = LAYOUT.history(history)[1]
        assert held_frames(kv) == frames and kv.history_frames == history
        assert torch.equal(kv.window[:, :, :, :end], window[:, :, :, :end])
    assert kv.checkpoint_bytes == 0
