"""Rebased RoPE positions: the same function as absolute positions, without the long-stream drift."""

from __future__ import annotations

import torch

from models import RefinerSession, SessionConfig, from_model
from models.checkpoints import build_model
from models.rope import WindowPositions, rope_tables

from .conftest import make_inputs


def run(refiner, latents, embeds, **config) -> torch.Tensor:
    session = RefinerSession(refiner, SessionConfig(**config))
    units = session.push(latents, embeds, flush=True)
    return torch.cat([u.latents for u in units], dim=2).double()


def test_positions_are_bounded_and_preserve_differences():
    sink, block, kv_max = 2, 3, 9
    history = 0
    for start in range(sink, 3000, block):
        absolute = WindowPositions.plan(start, start + block, history, sink, rebased=False)
        rebased = WindowPositions.plan(start, start + block, history, sink, rebased=True)
        window_abs = absolute.sink + absolute.history + absolute.block
        window_reb = rebased.sink + rebased.history + rebased.block
        assert max(window_reb) <= sink + kv_max + block + 1
        if absolute.sink_offset == 0:
            assert window_reb == window_abs  # frame 0 is clamped by the causal offset: never moved
        else:
            assert min(window_reb) == 1
            assert [b - a for a, b in zip(window_abs, window_abs[1:])] == [
                b - a for a, b in zip(window_reb, window_reb[1:])
            ]
        history = min(history + block, kv_max - sink)


def test_float64_rope_tables_match_the_reference_formula():
    """Our float64 evaluation of the LTX-2 RoPE equals diffusers' fp32 one up to fp32 rounding (which refiner.md puts
    at ~1e-4 at 0 s and 2e-3 at 60 s; frame 30 is 15 s at 16 fps)."""
    for rope_type in ("interleaved", "split"):
        model = build_model("tiny", rope_type=rope_type)
        positions = [0, 1, 2, 7, 30]
        ours = rope_tables(model, positions, 2, 3, 4, 16.0, torch.device("cpu"), torch.float64)
        theirs = rope_tables(model, positions, 2, 3, 4, 16.0, torch.device("cpu"), torch.float32)
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape and a.dtype == torch.float64
            assert (a - b.double()).abs().max().item() < 2e-3


def test_rebased_equals_absolute_in_float64():
    for rope_type, sink, block, kv_max, frames in [("interleaved", 1, 2, 5, 20), ("split", 2, 3, 8, 23)]:
        refiner = from_model(build_model("tiny", rope_type=rope_type), dtype="float64")
        latents, embeds = make_inputs(frames=frames, seed=frames)
        config = dict(sink_frames=sink, block_size=block, kv_max_frames=kv_max)
        absolute = run(refiner, latents, embeds, positions="absolute", **config)
        rebased = run(refiner, latents, embeds, positions="rebased", **config)
        relative = ((rebased - absolute).abs().max() / absolute.abs().max()).item()
        print(f"{rope_type}: float64 rebased vs absolute, max relative difference {relative:.2e}")
        assert relative <= 1e-9
        # The windows really moved: in float32 the two modes round differently once trimming starts.
        refiner32 = from_model(build_model("tiny", rope_type=rope_type))
        a32 = run(refiner32, latents, embeds, positions="absolute", **config)
        r32 = run(refiner32, latents, embeds, positions="rebased", **config)
        assert not torch.equal(a32, r32)


def test_rebased_does_not_drift_past_one_hour_in_float32():
    """fps=0.5 makes a latent frame 16 s of video, so 262 frames reach 4176 s of stream time; RoPE angles depend
    on time in seconds, so this is the angle regime of an 8350-frame stream at 16 fps."""
    fps, frames = 0.5, 262
    assert (frames - 1) * 8 / fps > 3600
    latents, embeds = make_inputs(frames=frames, height=2, width=2, seed=1)
    truth = run(from_model(build_model("tiny"), dtype="float64"), latents, embeds, fps=fps, positions="rebased")
    refiner = from_model(build_model("tiny"))

    def block_errors(positions):
        out = run(refiner, latents, embeds, fps=fps, positions=positions)
        per_frame = (out - truth).abs().amax(dim=(0, 1, 3, 4)) / truth.abs().amax(dim=(0, 1, 3, 4))
        blocks = per_frame[1:]  # the sink is returned as sent
        blocks = blocks[: len(blocks) // 3 * 3].reshape(-1, 3).amax(dim=1)
        first_hour = int(3600 * fps / 8 / 3)
        return blocks[:3].median().item(), blocks[first_hour:].median().item()

    abs_start, abs_late = block_errors("absolute")
    reb_start, reb_late = block_errors("rebased")
    print(f"float32 vs float64, relative error per block, start of stream -> past 1 h: "
          f"absolute {abs_start:.1e} -> {abs_late:.1e}, rebased {reb_start:.1e} -> {reb_late:.1e}")
    assert reb_late <= 5 * reb_start  # rebased: as close to float64 as at the start (same order of magnitude)
    assert abs_late >= 10 * abs_start  # absolute: drifts
    assert abs_late >= 10 * reb_late
