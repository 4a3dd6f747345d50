"""Fixtures for the client's tests: a tiny refiner, real servers on loopback (in this process, or ``python -m app
serve`` subprocesses that SIGTERM drains), clips as numpy arrays, and a proxy that breaks connections."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.core.settings import Settings
from bench.live import ThreadServer
from models.checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("client-tiny-refiner"), preset="tiny")


@pytest.fixture(scope="session")
def make_settings(checkpoint_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("client-cache")

    def make(**overrides) -> Settings:
        values = dict(model=str(checkpoint_dir), device="cpu", dtype="float32", cache_dir=cache)
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture(scope="module")
def server(make_settings):
    """One server for a module's tests that do not change its settings (each test uses sessions of its own)."""
    with ThreadServer(make_settings()) as live:
        yield live


def clip(frames: int = 11, height: int = 4, width: int = 4, prompt_len: int = 6, seed: int = 0):
    """latents (1, 128, T, H, W), prompt_embeds (1, L, 32), prompt_attention_mask (1, L) with two padding tokens
    (so a mask that is dropped changes the result)."""
    generator = np.random.default_rng(seed)
    latents = generator.standard_normal((1, 128, frames, height, width), dtype=np.float32)
    prompt = generator.standard_normal((1, prompt_len, 32), dtype=np.float32)
    mask = np.ones((1, prompt_len), dtype=np.int64)
    mask[:, -2:] = 0
    return latents, prompt, mask


def chunks_of(latents, sizes):
    """``latents`` split along time into chunks of the given sizes (the last one takes the rest)."""
    start, parts = 0, []
    for size in sizes:
        parts.append(latents[:, :, start : start + size])
        start += size
    if start < latents.shape[2]:
        parts.append(latents[:, :, start:])
    return parts
