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
    from models.move import moved_tensors
    from models.session_bytes import session_bytes

    height, width = list(gpu.SMOKE["geometries"].values())[-1]
    session = gpu._steady_sessions(ctx.refiner, 1, height, width, gpu.SMOKE["prompt_tokens"])[0]
    prepared = session._prepared[1].kv.nbytes  # the forwards that filled the window prepared it
    held = sum(session_bytes(session).values())
    ctx.parked_session = session
    figures = gpu.section_park(ctx)
    assert figures["session_bytes"] == held - prepared == sum(t.nbytes for t in moved_tensors(session))


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


def test_a_later_process_exits_by_its_own_sections_not_the_earlier_ones(tmp_path, monkeypatch):
    """``gpu_check.sh``'s second process (``--only step_modes``) adds to the first's summary.json: its exit status
    (and the script's "step_modes: failed or cut short") follows what it ran, not a section error the first process
    had already reported; a step mode that failed (recorded in ``mode_errors``, the section failing soft) counts."""
    def startup(ctx):
        return {"build_s": 0.0}

    def broken(ctx):
        raise RuntimeError("out of memory")

    modes = {"mode_errors": []}
    monkeypatch.setattr(gpu, "SECTIONS", [("startup", startup), ("decode", broken),
                                          ("step_modes", lambda ctx: dict(modes))])
    monkeypatch.setattr(gpu, "machine", lambda device: {"device": str(device)})
    monkeypatch.setattr(gpu, "render", lambda summary: "")
    assert gpu.main(["--smoke", "--skip", "step_modes", str(tmp_path)]) == 1  # its own section failed
    assert gpu.main(["--smoke", "--only", "step_modes", str(tmp_path)]) == 0  # decode's error is the first's
    assert "decode" in gpu.json.loads((tmp_path / "summary.json").read_text())["errors"]  # still recorded
    modes["mode_errors"] = ["graphed: BackendCompilerFailed: ..."]
    assert gpu.main(["--smoke", "--only", "step_modes", str(tmp_path)]) == 1


def test_without_an_importable_triton_the_compiled_modes_on_cuda_are_skipped_with_the_reason(monkeypatch):
    """On CUDA inductor writes Triton kernels: a triton that does not import (absent, or built for another torch)
    would fail every compiled mode at its first compile. The check names that once, as the reason the compiled modes
    were skipped, and says so in the machine's description; on a CPU (C++ kernels) triton is not needed."""
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ModuleNotFoundError
    reason = gpu.compiler_problem(torch.device("cuda", 0))
    assert reason is not None and reason.startswith("triton does not import (ModuleNotFoundError")
    assert gpu.compiler_problem(torch.device("cpu")) is None
    assert gpu.machine(torch.device("cpu"))["triton"].startswith("does not import (ModuleNotFoundError")


def test_a_compiled_mode_the_compiler_cannot_run_is_skipped_not_failed(ctx, monkeypatch):
    """``step_modes`` with the compiler unavailable (as ``compiler_problem`` finds a CUDA machine without triton): the
    compiled modes are skipped with that reason, eager and the padding are still measured, nothing counts as a
    failure, and eager is what is recommended."""
    monkeypatch.setattr(gpu, "compiler_problem", lambda device: "triton does not import (ImportError: simulated)")
    figures = gpu.section_step_modes(ctx)
    assert "compiled: triton does not import (ImportError: simulated)" in figures["skipped"]
    assert figures["compiled"]["batched_2_sessions_block_s"] is None
    assert figures["eager"]["batched_2_sessions_block_s"] > 0
    assert figures["padding"]["exact_block_s"] > 0
    assert figures["mode_errors"] == [] and figures["recommended_mode"] == "eager"


def test_a_compiled_mode_whose_compile_fails_is_reported_in_one_line_without_a_traceback(ctx, capsys):
    """A compile that fails (the C++ compiler crashing under inductor, ``tests.faults.crashing_compiler``) is recorded
    in ``mode_errors`` as the service logs and ``/v1/info`` shows it (``models.compiled.failure_reason``: the
    compiler's own words, not dynamo's advice or its command line), with no traceback in the run's output; eager and
    the padding are still measured, and eager is recommended."""
    from tests.faults import COMPILER_CRASH, crashing_compiler

    with crashing_compiler():
        figures = gpu.section_step_modes(ctx)
    assert figures["mode_errors"] == [f"compiled: RuntimeError: C++ compile error Output: {COMPILER_CRASH}"]
    assert "Traceback" not in capsys.readouterr().err
    assert figures["eager"]["batched_2_sessions_block_s"] > 0 and figures["padding"]["exact_block_s"] > 0
    assert figures["recommended_mode"] == "eager"
