"""Batch invariance: a session's bytes must not depend on which other sessions shared its forwards.

What breaks it on a CPU, found by bisecting a forward module by module with forward hooks (docs/benchmarks.md,
"Batch invariance"):

1. GEMMs whose M is the number of rows (the timestep embedding and its modulation linears: one output row per
   batch row). BLAS picks its kernel and reduction order by M, so a row's product alone (M = 1) and stacked
   (M = R) round differently: on an AMD EPYC (AVX2) for every R in 2..8, and on Xeons for widths that are not a
   multiple of 32, whatever MKL's reproducibility mode. ``models.step.time_embedding`` therefore runs them one row
   at a time: M is 1 whatever the batch, by construction.
2. GEMMs whose M depends on the neighbours' sizes: the prompt's cross-attention keys and values were projected
   for all the call's sessions at once, M being the sum of their prompt lengths (found on an AMD EPYC). Each
   session's prompt is now projected on its own shape (``models.attention``), by construction.
3. GEMMs whose M is tokens x rows (the stacked projections and feed-forward): MKL's sgemm splits the reduction (K)
   dimension across threads when the output is small relative to K, and how it splits depends on M. MKL's
   Conditional Numerical Reproducibility in strict mode (``MKL_CBWR=AUTO,STRICT``, Intel's documented switch; under
   5% on the step's shapes) removes what was seen on Xeons; ``models`` sets it on import unless the user set it
   already, and ``gemm_batch_invariant`` checks that it took effect. It is NOT a guarantee: nothing obliges a BLAS
   (MKL on another CPU, cuBLAS, a compiled step's kernels per bucket) to round a row the same at every M.

So bit-identity under batching is a property of the loaded model on the device it runs on, measured:
``probe_batch_invariance`` runs the model as the service runs it, for one class of model call (tokens per row,
dtype, device), and the service (``app.engine.batching``) batches a class with ``batching: auto`` only once its probe
passed; the rest of the forward (attention, RoPE, gates, the time embedding, the prompt's projections) is per session
on a solo forward's shapes, invariant by construction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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


@dataclass(frozen=True)
class InvarianceProbe:
    """What ``probe_batch_invariance`` found: ``ok`` when every row of every call equalled the same row alone."""

    ok: bool
    calls: int  # model calls compared (solo ones not counted)
    threads: tuple[int, ...]  # intra-op thread counts tried
    failure: str | None = None  # the first row that differed: row count, position, thread count
    group: tuple | None = None  # the class of model call measured: (tokens per row, dtype, device)

    def __str__(self) -> str:
        threads = "/".join(str(t) for t in self.threads)
        if self.ok:
            return f"invariant over {self.calls} batched calls ({threads} threads)"
        return f"NOT invariant: {self.failure}"


def probe_batch_invariance(refiner, height: int, width: int, prompt_tokens: int, runner=None, max_rows: int = 8,
                           threads: tuple[int, ...] | None = None, seed: int = 0,
                           block_frames: int | None = None) -> InvarianceProbe:
    """Whether the loaded refiner, as it runs here (device, dtype, intra-op threads, ``runner``: the compiled step if
    one is used), gives a session the same velocity alone and stacked with others in one model call.

    Built not to pass by luck: up to ``max_rows`` sessions that differ in content, seed, prompt length, window
    length (one or two blocks of history) and positions mode are each brought to their next forward; every row
    count from 2 to ``max_rows`` is then run with rows drawn at random positions, and each row compared with
    ``torch.equal`` to its solo forward, at every intra-op thread count in ``threads`` (default: 1 and the current
    count, on a CPU; the current count is restored).

    The sessions denoise each block in one step (their history's content does not matter, its length does), so
    building them costs a third of what the default schedule would.

    ``block_frames`` (default: the session default's block size) and ``height`` x ``width`` fix the tokens per row,
    and so the class of model call measured (``InvarianceProbe.group``). On a GPU the caller keeps ``max_rows`` small
    (the service uses 2: each session holds a whole KV window, 9 GiB at 720p for the released refiner); the probe's
    sessions are freed, and on CUDA the allocator's cache emptied, before it returns, so that what it allocated is
    not counted as used by whoever reads free memory next."""
    import torch

    from .config import DEFAULT_SIGMAS, SessionConfig
    from .session import RefinerSession
    from .step import run_batch

    info = refiner.info
    runner = runner or run_batch
    sessions = max(2, min(max_rows, 8))
    forwards = []
    try:  # the sessions are freed (and on CUDA the cache emptied) even when building them runs out of memory
        for index in range(sessions):
            # One denoising step per block: the history is built with a third of the default's forwards (the stacked
            # GEMMs' shapes, what the class is, do not depend on the noise levels; the time embedding is per row).
            config = SessionConfig(seed=seed + index, positions="rebased" if index % 3 == 2 else "absolute",
                                   sigmas=(DEFAULT_SIGMAS[0], 0.0),
                                   **({} if block_frames is None else {"block_size": block_frames}))
            generator = torch.Generator().manual_seed(seed + index)
            blocks = 1 + index % 2
            frames = config.sink_frames + (blocks + 1) * config.block_size
            latents = torch.randn(1, info.in_channels, frames, height, width, generator=generator)  # (1, C, T, H, W)
            embeds = torch.randn(1, prompt_tokens + index, info.caption_channels, generator=generator)  # (1, L, D)
            session = RefinerSession(refiner, config)
            session.push(latents[:, :, : frames - config.block_size], embeds)
            session.append(session.check(latents[:, :, frames - config.block_size :]))
            forwards.append(session.next_forward(session.start(session.plan())))
            del session
        return _compare(refiner, forwards, runner, sessions, threads, seed, forwards[0].group)
    finally:
        forwards.clear()
        # Not kept alive by this frame (an exception's traceback holds it). What the frames below it held while
        # the exception passes (a session that failed half-built, an out-of-memory) goes back to the caching
        # allocator only once the caller has handled it, so this empty_cache cannot return it to the device; it
        # stays cached for the sessions that come next (the budget is resolved once, ``app.sessions.parking``).
        session = latents = embeds = None
        if refiner.device.type == "cuda":
            torch.cuda.empty_cache()


def _compare(refiner, forwards, runner, sessions, threads, seed, group) -> InvarianceProbe:
    import random

    import torch

    if threads is None:
        current = torch.get_num_threads()
        threads = (1, current) if refiner.device.type == "cpu" and current > 1 else (current,)
    before = torch.get_num_threads()
    rng = random.Random(seed)
    calls = 0
    try:
        for count in threads:
            torch.set_num_threads(count)
            alone = [runner(refiner.model, [forward])[0] for forward in forwards]
            for rows in range(2, sessions + 1):
                order = rng.sample(range(sessions), rows)
                together = runner(refiner.model, [forwards[i] for i in order])
                calls += 1
                for position, (index, velocity) in enumerate(zip(order, together)):
                    if not torch.equal(velocity, alone[index]):
                        worst = (velocity.double() - alone[index].double()).abs().max().item()
                        return InvarianceProbe(False, calls, tuple(threads), group=group, failure=(
                            f"a row stacked at position {position} of {rows} differs from its solo forward by up to "
                            f"{worst:.3g} with {count} intra-op thread(s) on {refiner.device}"))
    finally:
        torch.set_num_threads(before)
    return InvarianceProbe(True, calls, tuple(threads), group=group)
