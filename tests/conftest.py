"""Fixtures shared by every test package."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP workers spinning against each
    # other make a millisecond forward take seconds.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
