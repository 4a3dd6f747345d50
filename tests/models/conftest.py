"""Fixtures for the compute layer: tiny random refiners and diffusers' reference pipeline."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from models import from_model
from models.checkpoints import build_model, write_checkpoint


def reference_refine(model, latents, prompt_embeds, prompt_mask=None, *, seed=42, fps=16.0, sink=1, block=3,
                     kv_max=11, sigmas=None):
    """diffusers' ``SanaWMLTX2Refiner.__call__`` with its text encoder replaced by fixed embeddings."""
    from diffusers.pipelines.sana_wm.refiner import STAGE_2_DISTILLED_SIGMA_VALUES, SanaWMLTX2Refiner

    pipe = SanaWMLTX2Refiner(
        transformer=model,
        connectors=None,
        tokenizer=None,
        text_encoder=None,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
    )
    pipe.set_progress_bar_config(disable=True)
    batch, length = prompt_embeds.shape[:2]
    mask = torch.ones(batch, length) if prompt_mask is None else prompt_mask
    pipe._encode_prompt = lambda prompt, device, dtype: (prompt_embeds.to(device, dtype), mask.to(device))
    return pipe(
        latents,
        "unused: the prompt embeddings are fixed",
        fps=fps,
        sink_size=sink,
        block_size=block,
        kv_max_frames=kv_max,
        sigmas=tuple(sigmas) if sigmas is not None else STAGE_2_DISTILLED_SIGMA_VALUES,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="latent",
    )


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP workers spinning against each
    # other make a millisecond forward take seconds.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny")


@pytest.fixture(scope="session")
def tiny_refiner():
    return from_model(build_model("tiny"))


def make_inputs(batch=1, frames=10, height=4, width=3, prompt_len=7, seed=0, caption_channels=32):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 128, frames, height, width, generator=generator)
    embeds = torch.randn(batch, prompt_len, caption_channels, generator=generator)
    return latents, embeds
