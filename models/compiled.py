"""An optional compiled batched step: ``torch.compile`` over a few fixed batch sizes, warmed up before serving.

Shape letters: R rows, N tokens per row.

``models.step.forward_body`` is compiled with static shapes. The per-session attention functions are kept out
of the graph (``torch.compiler.disable``), so the compiled pieces are the per-token work between them
(projections, norms, modulation, the feed-forward) and see only tensors: the same graphs serve every mix of
sessions. A call of R rows runs at the smallest *bucket* >= R (1, 2, 4, ... up to ``max_batch_rows``), the
rows past R zero, so the number of shapes is small and known; ``warm_up`` compiles every (bucket, token count,
forward kind) the service will meet before it reports ready, so no client pays for compilation.

``mode="reduce-overhead"`` adds CUDA graphs on a GPU (``torch.compile``'s CUDA-graph trees capture each compiled
piece; the attention between them runs eagerly and reads the sessions' own window buffers). On a CPU this path
is slower than eager (measured: docs/benchmarks.md), so the service leaves it off there by default.

The whole step can also compile as one graph (``fullgraph=True``, no break): ``models.attention_op`` makes the
attention kernel a custom op and traces the per-session functions (tested on the CPU:
``tests/models/test_attention_op.py``, ``forward_body`` as ``run_batch`` calls it). Decision: this step does not
use it. Traced, the per-session loop turns each session's shapes and window slots into guards: measured there,
the same mix of sessions reuses its graph, but another session count, another prompt length or a history that is
still growing each compile a new graph. Serving meets a combinatorial number of such mixes (prompt lengths are
the clients', every session's history grows over its first blocks, sessions come and go), which no warm-up can
enumerate, so the engine thread would compile while others wait, and past ``cache_size_limit`` fall back to eager.
The pieces between disabled attention functions see only tensors of the bucketed shapes: a known set, all compiled
before ``/ready``. What would lift this: a guard-free form of the window and prompts (slot offsets and lengths as
tensors, prompts in length buckets), measured against the pieces on a GPU.

Numerics: compiled kernels fuse differently from eager ones, so outputs differ from the reference in the last
bits (the parity tolerance, not bit-exactness) and rows may differ between buckets; ``models.determinism``'s
probe runs through this path when it is on, and the service reports what it finds.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .step import RowForward, forward_body, run_batch


GRAPHED_MODES = ("reduce-overhead", "max-autotune")


def buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... and ``max_rows`` itself."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    sizes.append(max_rows)
    return sizes


class CompiledStep:
    """``run_batch`` through a compiled ``forward_body`` at bucketed batch sizes."""

    def __init__(self, model: torch.nn.Module, max_rows: int, mode: str = "default", backend: str = "inductor"):
        self.model = model
        self.buckets = buckets(max_rows)
        self.mode = mode
        # One compiled entry per (bucket, tokens per row, forward kind) of forward_body and of each piece between
        # attention functions; the default cap (8) would silently fall back to eager past it.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16 * len(self.buckets))
        self.body = torch.compile(forward_body, dynamic=False, mode=None if mode == "default" else mode,
                                  backend=backend)
        # The modes that capture CUDA graphs on a GPU (max-autotune does too; max-autotune-no-cudagraphs does not).
        self.graphed = mode in GRAPHED_MODES

    def bucket(self, rows: int) -> int:
        for size in self.buckets:
            if rows <= size:
                return size
        return rows  # a single session wider than the largest bucket runs at its own size

    def __call__(self, model: torch.nn.Module, forwards: Sequence[RowForward]) -> list[torch.Tensor]:
        rows = sum(forward.rows for forward in forwards)
        velocities = run_batch(model, forwards, pad_to=self.bucket(rows), body=self.body)
        if self.graphed:
            # CUDA-graph trees replay a graph into the same static output memory: the next call of this bucket
            # overwrites these velocities (and reading them then raises "accessing tensor output of CUDAGraphs
            # that has been overwritten"). Callers that hold several calls' outputs at once (``run_isolated``'s
            # retries one forward at a time, the batch-invariance probe's solo forwards) get copies of their own:
            # (R, N, C), small next to the step. Only a GPU shows the overwrite (tests/gpu/test_cuda.py).
            velocities = [velocity.clone() for velocity in velocities]
        return velocities

    def warm_up(self, forwards_by_kind: Sequence[RowForward]) -> int:
        """Run every bucket for each given forward (one per kind the service meets: a sink capture, a denoising
        forward, a commit forward, at the warm-up geometry), repeating the forward to fill the rows. Returns the
        number of calls made."""
        calls = 0
        for forward in forwards_by_kind:
            for size in self.buckets:
                copies = max(1, size // forward.rows)
                self(self.model, [forward] * copies)
                calls += 1
        return calls


def warmup_forwards(refiner, config, height: int, width: int, prompt_tokens: int) -> list[RowForward]:
    """One forward of each kind a session runs, at this geometry: its sink capture, and a denoising and a commit
    forward of a full block and of every short last block a flush can leave (1 to ``block_size - 1`` frames: other
    token counts, so other graphs), from throwaway sessions refined eagerly. Compiling all of them before ``/ready``
    is what keeps a flushed session from compiling on the engine thread while others wait."""
    from .session import RefinerSession

    info = refiner.info
    generator = torch.Generator().manual_seed(0)
    frames = config.sink_frames + config.block_size
    latents = torch.randn(1, info.in_channels, frames, height, width, generator=generator)  # (1, C, T, H, W)
    embeds = torch.randn(1, prompt_tokens, info.caption_channels, generator=generator)  # (1, L, D)

    fresh = RefinerSession(refiner, config)
    fresh.append(fresh.check(latents[:, :, : config.sink_frames], embeds))
    forwards = [fresh.next_forward(fresh.start(fresh.plan()))]  # the sink's
    for block_frames in range(config.block_size, 0, -1):
        session = RefinerSession(refiner, config)
        session.push(latents[:, :, : config.sink_frames], embeds)
        end = config.sink_frames + block_frames
        session.append(session.check(latents[:, :, config.sink_frames : end]),
                       flush=block_frames < config.block_size)
        run = session.start(session.plan())
        forwards.append(session.next_forward(run))  # denoising
        while (forward := session.next_forward(run)).mode != "commit":
            session.advance(run, run_batch(refiner.model, [forward])[0])
        forwards.append(forward)
    return forwards
