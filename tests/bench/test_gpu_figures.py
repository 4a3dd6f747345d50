"""``bench/gpu.py``'s figures against what the service does, on the CPU and in seconds (the smoke,
``tests/bench/test_gpu_check.py``, checks that every section runs; these check what some figures mean)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench import gpu
from models import SessionConfig


@pytest.fixture(scope="module")
def ctx():
    context = gpu.Context(gpu.SMOKE, torch.device("cpu"), torch.float32)
    context.refiner = gpu.random_refiner(gpu.SMOKE["config"], context.device, context.dtype)
    return context


def test_the_sessions_in_the_budget_are_counted_at_what_admission_reserves(ctx):
    """``memory``'s bytes per session are what ``Parking.estimate`` reserves for a session of that geometry sent in
    block-sized chunks with the check's prompt (window, prompt K/V, pending frames, a chunk's rollback copies), not
    the window alone: at the released 720p that left out 2.2 GiB of 11.5 and put 11 sessions in an H200's budget
    where admission takes 9."""
    from app.sessions.parking import Parking

    figures = gpu.section_memory(ctx)
    parking = SimpleNamespace(refiner=lambda: ctx.refiner)
    config = SessionConfig()
    for name, (height, width) in gpu.SMOKE["geometries"].items():
        shape = (1, ctx.refiner.info.in_channels, config.block_size, height, width)
        reserved = Parking.estimate(parking, config, shape, prompt_tokens=gpu.SMOKE["prompt_tokens"])
        assert figures[f"{name}_session_bytes"] == reserved


def test_the_park_rate_counts_the_bytes_the_park_copies(ctx):
    """``park``'s bytes (the GB/s figures' numerator) are the tensors ``move_session`` copies: not the prepared
    prompt K/V that ``session_bytes`` also counts, which the move drops (236 MB of a released 720p session)."""
    from models.move import _held
    from models.session_bytes import session_bytes

    height, width = list(gpu.SMOKE["geometries"].values())[-1]
    session = gpu._steady_sessions(ctx.refiner, 1, height, width, gpu.SMOKE["prompt_tokens"])[0]
    prepared = session._prepared[1].kv.nbytes  # the forwards that filled the window prepared it
    held = sum(session_bytes(session).values())
    ctx.parked_session = session
    figures = gpu.section_park(ctx)
    assert figures["session_bytes"] == held - prepared == sum(t.nbytes for t in _held(session))


def test_flash_ran_is_read_from_the_backend_op_not_from_kernel_names():
    """On CUDA the memory-efficient backend's kernels are ``fmha_cutlassF_...`` and cuDNN's carry ``flash`` in their
    names: neither is the flash backend. The aten op SDPA dispatched to says which backend ran."""
    assert gpu.flash_ran(["aten::_scaled_dot_product_flash_attention", "aten::scaled_dot_product_attention"])
    assert gpu.flash_ran(["aten::_scaled_dot_product_flash_attention_for_cpu"])
    assert not gpu.flash_ran(["aten::_scaled_dot_product_efficient_attention", "aten::scaled_dot_product_attention"])
    assert not gpu.flash_ran(["aten::_scaled_dot_product_cudnn_attention"])
    names = ["aten::_scaled_dot_product_efficient_attention",
             "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)"]
    ops = [n for n in names if n.startswith("aten::")]
    assert not gpu.flash_ran(ops)
