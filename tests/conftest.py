"""Fixtures shared by every test package."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

# torch.compile's kernel cache (by default shared by every process of the user) keys its entries without the ISA that
# ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA select: a run under an emulated AVX2-only CPU then loads kernels built for
# AVX-512 (or the other way round) and gets NaNs or a crash (seen here). Each test run compiles into a folder of its
# own; servers the tests start inherit it.
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="wm-refiner-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE


def pytest_unconfigure(config):
    shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP workers spinning against each
    # other make a millisecond forward take seconds.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
