"""The session equals diffusers' reference refiner, whatever the chunking (refiner.md, parity contract)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import RefinerSession, SessionConfig, from_model, refine_clip
from models.checkpoints import build_model

from tests.reference import assert_parity, reference_refine

from .conftest import make_inputs

# (name, model overrides, batch, sink, block, kv_max, frames, padded prompt mask: True pads every stream alike, so
# the session cuts the prompt down to the kept tokens; "ragged" pads the streams differently, so the mask reaches
# attention as the reference's additive bias)
CASES = [
    ("defaults", {}, 1, 1, 3, 11, 10, False),
    ("split-rope", {"rope_type": "split"}, 1, 1, 3, 11, 10, False),
    ("gated-attention", {"gated_attn": True}, 1, 1, 3, 11, 11, False),
    ("batch-2-masked", {}, 2, 1, 3, 11, 9, True),
    ("batch-2-ragged-mask", {"gated_attn": True}, 2, 1, 3, 11, 9, "ragged"),
    ("sink-2-block-2-trimmed", {}, 1, 2, 2, 5, 13, False),
    ("sink-3-block-4", {}, 1, 3, 4, 9, 20, True),
    ("block-1-trimmed", {"rope_type": "split"}, 1, 1, 1, 3, 9, False),
    ("block-4-short-tail", {"gated_attn": True}, 2, 2, 4, 6, 17, True),
]


def chunkings(frames: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    splits, left = [], frames
    while left:
        take = min(left, rng.randint(1, 5))
        splits.append(take)
        left -= take
    return {"frame-by-frame": [1] * frames, "random-splits": splits, "whole-clip": [frames]}


def stream(refiner, config, latents, embeds, mask, sizes) -> torch.Tensor:
    session = RefinerSession(refiner, config)
    units, start = [], 0
    for i, size in enumerate(sizes):
        prompt = (embeds, mask) if i == 0 else (None, None)
        units += session.push(latents[:, :, start : start + size], *prompt)
        start += size
    units += session.flush()
    assert [u.frame_start for u in units] == sorted(u.frame_start for u in units)
    assert all(a.frame_end == b.frame_start for a, b in zip(units, units[1:]))
    return torch.cat([u.latents for u in units], dim=2)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_session_equals_reference_across_chunkings(case):
    name, overrides, batch, sink, block, kv_max, frames, padded = case
    latents, embeds = make_inputs(batch=batch, frames=frames, seed=len(name))
    mask = None
    if padded:
        mask = torch.ones(batch, embeds.shape[1], dtype=torch.int64)
        mask[:, :3] = 0  # left padding, as the Gemma tokenizer produces
        if padded == "ragged":
            mask[1, :3], mask[1, -2:] = 1, 0  # the second stream padded elsewhere: a mask, not a shorter prompt
    expected = reference_refine(build_model("tiny", **overrides), latents, embeds, mask, sink=sink, block=block,
                                kv_max=kv_max)
    refiner = from_model(build_model("tiny", **overrides))
    config = SessionConfig(sink_frames=sink, block_size=block, kv_max_frames=kv_max)
    whole = refine_clip(refiner, latents, embeds, mask, config)
    assert_parity(whole, expected, name)
    for chunking, sizes in chunkings(frames, seed=frames).items():
        got = stream(refiner, config, latents, embeds, mask, sizes)
        # The chunking in transit changes nothing at all: every split gives the one-shot clip's bytes.
        assert torch.equal(got, whole), f"{chunking}: differs from the same clip sent whole"


def test_parity_with_other_seed_fps_and_sigmas(tiny_refiner):
    latents, embeds = make_inputs(frames=8, seed=3)
    sigmas = (0.8, 0.5, 0.0)
    expected = reference_refine(build_model("tiny"), latents, embeds, seed=7, fps=24.0, sigmas=sigmas)
    config = SessionConfig(seed=7, fps=24.0, sigmas=sigmas)
    assert_parity(refine_clip(tiny_refiner, latents, embeds, None, config), expected, "seed 7, 24 fps, 3 sigmas")


def test_sink_frames_are_returned_unchanged(tiny_refiner):
    latents, embeds = make_inputs(frames=7)
    session = RefinerSession(tiny_refiner, SessionConfig(sink_frames=2))
    units = session.push(latents[:, :, :2], embeds)
    assert [(u.kind, u.frame_start, u.frame_end) for u in units] == [("sink", 0, 2)]
    assert torch.equal(units[0].latents, latents[:, :, :2])
    units = session.push(latents[:, :, 2:7])
    assert [(u.kind, u.frame_start, u.frame_end) for u in units] == [("block", 2, 5)]
    assert [(u.frame_start, u.frame_end) for u in session.flush()] == [(5, 7)]


def test_cli_refine_equals_reference(tiny_dir, tmp_path):
    latents, embeds = make_inputs(frames=9, seed=11)
    mask = torch.ones(1, embeds.shape[1], dtype=torch.bool)
    mask[:, :2] = False
    save_file({"latents": latents, "prompt_embeds": embeds, "prompt_attention_mask": mask}, tmp_path / "in.st")
    command = [sys.executable, "-m", "app", "refine", "--model", str(tiny_dir), "--input", str(tmp_path / "in.st"),
               "--output", str(tmp_path / "out.st"), "--seed", "5", "--fps", "12", "--sink-frames", "2",
               "--block-size", "2", "--kv-max-frames", "6"]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    got = load_file(tmp_path / "out.st")["latents"]
    from diffusers import SanaWMLTX2RefinerTransformer3DModel

    reference_model = SanaWMLTX2RefinerTransformer3DModel.from_pretrained(str(tiny_dir), low_cpu_mem_usage=False)
    expected = reference_refine(reference_model, latents, embeds, mask.long(), seed=5, fps=12.0, sink=2, block=2,
                                kv_max=6)
    assert got.dtype == torch.float32
    assert (got - expected).abs().max().item() <= 1e-5
