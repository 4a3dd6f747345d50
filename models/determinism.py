"""Batch invariance: a session's bytes must not depend on which other sessions shared its forwards.

What breaks it on a CPU, found by bisecting a forward module by module with forward hooks (docs/benchmarks.md,
"Batch invariance"): MKL's sgemm splits the reduction (K) dimension across threads when the output is small
relative to K, and how it splits depends on M, the number of rows in the call. The feed-forward's down
projection (K = 4 x dim) of a 64-token block therefore gives a row different bits (~2e-6) alone than stacked
with neighbours, as soon as more than one intra-op thread runs. With one thread, or with MKL's Conditional
Numerical Reproducibility in strict mode, every row's result depends only on that row: ``MKL_CBWR=AUTO,STRICT``
(Intel's documented switch; it keeps the CPU's own code path and costs under 5% on the step's shapes here,
see docs/benchmarks.md).

MKL reads the variable when it runs its first routine, not when the library loads, so ``models`` sets it on
import unless the user set it already; ``gemm_batch_invariant`` checks, at run time, that it took effect.

The rest of the forward is invariant by construction: attention, RoPE and the output gates run per session on
the shapes of a solo forward, everything else is per token, and the time embedding is computed once per row. For widths that are
a multiple of the vector length, as every real refiner's are, a row's elements then never fall in the scalar
tail that CPU kernels use for the last elements of a tensor, where ``exp`` and ``tanh`` round differently. On CUDA, cuBLAS chooses GEMM kernels by shape, so rows may differ with
the batch size there: ``forward_batch_invariant`` measures it for the loaded model, and the service reports it
(``/v1/info``) and logs a warning when it does not hold.
"""

from __future__ import annotations

import os

MKL_CBWR = "MKL_CBWR"
STRICT_CBWR = "AUTO,STRICT"


def request_reproducible_gemm() -> str:
    """Ask MKL for thread-count-independent GEMMs, unless the user chose a setting. Returns the value in force."""
    return os.environ.setdefault(MKL_CBWR, STRICT_CBWR)


def gemm_batch_invariant(device, dtype, inner: int = 1536, outer: int = 384, tokens: int = 64) -> bool:
    """Whether a linear layer gives a row the same bits alone and stacked with others, here and now (the
    current intra-op thread count, device and dtype). Shapes default to the medium refiner's FF down
    projection, the shape that showed the problem."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(outer, inner, generator=generator).to(device=device, dtype=dtype)
    bias = torch.randn(outer, generator=generator).to(device=device, dtype=dtype)
    rows = torch.randn(8, tokens, inner, generator=generator).to(device=device, dtype=dtype)  # (R, N, K)
    with torch.no_grad():
        alone = F.linear(rows[:1], weight, bias)
        for count in (2, 3, 5, 8):
            stacked = F.linear(rows[:count], weight, bias)
            if not torch.equal(alone[0], stacked[0]):
                return False
            if not torch.equal(F.linear(rows[count - 1 : count], weight, bias)[0], stacked[count - 1]):
                return False
    return True


def forward_batch_invariant(refiner, height: int, width: int, prompt_tokens: int, runner=None) -> bool:
    """Whether the loaded refiner, as it runs here (device, dtype, intra-op threads, ``runner``: the compiled step
    if one is used), gives a session the same velocity alone and stacked with another session in one model call.
    Two small sessions with different content, prompt lengths and window lengths are refined to their second
    block; the next forward of each is then run alone and together."""
    import torch

    from .config import SessionConfig
    from .session import RefinerSession
    from .step import run_batch

    info = refiner.info
    forwards = []
    for seed, blocks in ((1, 1), (2, 2)):
        config = SessionConfig(seed=seed)
        generator = torch.Generator().manual_seed(seed)
        frames = config.sink_frames + (blocks + 1) * config.block_size
        latents = torch.randn(1, info.in_channels, frames, height, width, generator=generator)
        embeds = torch.randn(1, prompt_tokens + seed, info.caption_channels, generator=generator)
        session = RefinerSession(refiner, config)
        session.push(latents[:, :, : frames - config.block_size], embeds)
        session.append(session.check(latents[:, :, frames - config.block_size :]))
        forwards.append(session.next_forward(session.start(session.plan())))
    runner = runner or run_batch
    alone = [runner(refiner.model, [forward])[0] for forward in forwards]
    together = runner(refiner.model, forwards)
    return all(torch.equal(a, b) for a, b in zip(alone, together))
