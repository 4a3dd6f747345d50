"""Fixtures for the compute layer: tiny random refiners and their inputs."""

from __future__ import annotations

import pytest
import torch

from models import from_model
from models.checkpoints import build_model, write_checkpoint


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
