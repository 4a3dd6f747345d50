"""An optional compiled batched step: ``torch.compile`` over a few fixed batch sizes, warmed up before serving.

Shape letters: R rows, N tokens per row.

``models.step.forward_body`` is compiled with static shapes. The per-session attention functions are kept out
of the graph (``torch.compiler.disable``), so the compiled pieces are the per-token work between them
(projections, norms, modulation, the feed-forward) and see only tensors: the same graphs serve every mix of
sessions. A call of R rows runs at the smallest *bucket* >= R, the rows past R zero. The buckets (``bucket_sizes``):
``every`` batch size from 1 to ``max_rows`` (the default: a call never pads, each size costs one more compile at
start-up), ``powers`` (1, 2, 4, ... and ``max_rows``: half the compiles, but 3 rows run as 4, +33% GEMM work), or a
list. Which is cheaper is a measurement (padding's cost per block against a bucket's compile time): the GPU check
reports both (``bench/gpu.py``, ``step_modes.padding``).

``warm_up`` compiles every (bucket, token count) the service will meet (each forward kind of each warm-up
geometry: the sink, full blocks, every short last block a flush can leave) before it reports ready, so no client
pays for compilation; then it *seals* the step: a call at a shape it did not compile (a stream of a geometry the
warm-up did not list, a single session wider than the largest bucket) runs eagerly instead of compiling on the
engine thread while every other session waits, and is reported (``on_uncompiled``: the service counts and logs
it, naming the setting that would compile it).

``mode="reduce-overhead"`` adds CUDA graphs on a GPU (``torch.compile``'s CUDA-graph trees capture each compiled
piece; the attention between them runs eagerly and reads the sessions' own window buffers). On a CPU this path
is slower than eager (measured: docs/benchmarks.md), so the service leaves it off there by default.

The whole step can also compile as one graph (``fullgraph=True``, no break): under ``models.attention.fullgraph()``
the attention kernel is a custom op (``models.attention_op``) and the per-session functions are traced (tested on
the CPU:
``tests/models/test_attention_op.py``, ``forward_body`` as ``run_batch`` calls it). Decision: this step does not
use it. Traced, the per-session loop turns each session's shapes and window slots into guards: measured there,
the same mix of sessions reuses its graph, but another session count, another prompt length or a history that is
still growing each compile a new graph. Serving meets a combinatorial number of such mixes (prompt lengths are
the clients', every session's history grows over its first blocks, sessions come and go), which no warm-up can
enumerate, so the engine thread would compile while others wait, and past ``cache_size_limit`` fall back to eager.
The pieces between disabled attention functions see only tensors of the bucketed shapes: a known set, all compiled
before ``/ready``. What would lift this: a guard-free form of the window and prompts (slot offsets and lengths as
tensors, prompts in length buckets), measured against the pieces on a GPU.

A compile that fails (no working triton on CUDA, an inductor error, the C++ compiler crashing in its subprocess)
raises out of ``warm_up``; ``failure_reason`` turns it into the one line the service and the GPU check report (the
backend's own error and, for a compiler, what it printed; not dynamo's advice or the compiler's command line).
``compiler_problem`` names the one such failure that can be seen before tracing anything.

Numerics: compiled kernels fuse differently from eager ones, so outputs differ from the reference in the last
bits (the parity tolerance, not bit-exactness) and rows may differ between buckets; ``models.determinism``'s
probe runs through this path when it is on, and the service reports what it finds.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

import torch

from .step import RowForward, forward_body, run_batch


GRAPHED_MODES = ("reduce-overhead", "max-autotune")
# How much of a failure's text ``failure_reason`` keeps: a C++ compiler's output can run to pages.
REASON_CHARS = 500


def compiler_problem(device: torch.device, backend: str = "inductor") -> str | None:
    """Why ``torch.compile``'s ``backend`` cannot compile for ``device`` on this machine, or None. On CUDA inductor
    writes Triton kernels: with a triton that does not import (absent, or built for another torch; a CUDA torch wheel
    brings its own) every compile fails at its first kernel, after tracing the model to reach it. On a CPU inductor
    writes C++ and needs no triton; the other backends generate no code."""
    if device.type != "cuda" or backend != "inductor":
        return None
    try:
        import triton  # noqa: F401 -- whether it imports is the question
    except Exception as exc:  # noqa: BLE001 -- an ImportError, or a broken build's any error at import
        return f"triton does not import ({type(exc).__name__}: {exc}): inductor needs it to compile for CUDA"
    return None


def failure_reason(exc: BaseException) -> str:
    """A failed compile in one line: the backend's own error (dynamo wraps it: ``BackendCompilerFailed``) with its
    message, less dynamo's advice on verbose logging and a compiler's command line, whitespace folded, at most
    ``REASON_CHARS`` characters. A C++ compiler's crash keeps what the compiler printed (its ``Output:``)."""
    inner = getattr(exc, "inner_exception", None) or exc
    lines, skip = [], False
    for line in str(inner).splitlines():
        line = line.strip()
        if skip:  # the line after "Command:" is the command itself
            skip = False
            continue
        if line == "Command:":
            skip = True
        elif line and not line.startswith("Set TORCHDYNAMO_VERBOSE"):
            lines.append(line)
    text = f"{type(inner).__name__}: {' '.join(lines)}" if lines else type(inner).__name__
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... and ``max_rows`` itself (the ``powers`` choice)."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    sizes.append(max_rows)
    return sizes


def bucket_sizes(choice: str | Sequence[int], max_rows: int) -> list[int]:
    """The batch sizes compiled for calls of up to ``max_rows`` rows: ``every`` (1 .. max_rows), ``powers`` (1, 2,
    4, ... max_rows) or the given sizes (those up to ``max_rows``, and ``max_rows``, so every call fits one)."""
    if choice == "every":
        return list(range(1, max_rows + 1))
    if choice == "powers":
        return buckets(max_rows)
    if isinstance(choice, str):
        raise ValueError(f"buckets: 'every', 'powers' or a list of batch sizes, got {choice!r}")
    sizes = {int(size) for size in choice}
    if not sizes or min(sizes) < 1:
        raise ValueError(f"buckets {list(choice)}: batch sizes of at least 1, e.g. 1,2,4,8")
    # Sizes past max_rows serve no call (with batching off max_rows is 1 whatever the list says): left out.
    return sorted({size for size in sizes if size <= max_rows} | {max_rows})


class CompiledStep:
    """``run_batch`` through a compiled ``forward_body`` at bucketed batch sizes."""

    def __init__(self, model: torch.nn.Module, max_rows: int, mode: str = "default", backend: str = "inductor",
                 sizes: str | Sequence[int] = "every",
                 on_uncompiled: Callable[[int, int], None] | None = None):
        self.model = model
        self.buckets = bucket_sizes(sizes, max_rows)
        self.mode = mode
        self.backend = backend
        self.body = torch.compile(forward_body, dynamic=False, mode=None if mode == "default" else mode,
                                  backend=backend)
        # The modes that capture CUDA graphs on a GPU (max-autotune does too; max-autotune-no-cudagraphs does not).
        self.graphed = mode in GRAPHED_MODES
        # What the warm-up compiled, as (bucket, tokens per row); once sealed, any other shape runs eagerly.
        self.compiled: set[tuple[int, int]] = set()
        self.sealed = False
        self.on_uncompiled = on_uncompiled
        self.uncompiled_calls = 0

    def bucket(self, rows: int) -> int:
        for size in self.buckets:
            if rows <= size:
                return size
        return rows  # a single session wider than the largest bucket runs at its own size

    def __call__(self, model: torch.nn.Module, forwards: Sequence[RowForward]) -> list[torch.Tensor]:
        if not forwards:
            return []
        rows = sum(forward.rows for forward in forwards)
        key = (self.bucket(rows), int(forwards[0].tokens.shape[1]))
        if self.sealed and key not in self.compiled:
            # Compiling here would stall every session for the length of a compile (a minute or more at the
            # released size on a GPU); eager gives the same results within the parity tolerance, unpadded.
            self.uncompiled_calls += 1
            if self.on_uncompiled is not None:
                self.on_uncompiled(rows, key[1])
            return run_batch(model, forwards)
        if key not in self.compiled:
            self.compiled.add(key)
            _make_room(len(self.compiled))
        velocities = run_batch(model, forwards, pad_to=key[0], body=self.body)
        if self.graphed:
            # CUDA-graph trees replay a graph into the same static output memory: the next call of this bucket
            # overwrites these velocities (and reading them then raises "accessing tensor output of CUDAGraphs
            # that has been overwritten"). Callers that hold several calls' outputs at once (``run_isolated``'s
            # retries one forward at a time, the batch-invariance probe's solo forwards) get copies of their own:
            # (R, N, C), small next to the step. Only a GPU shows the overwrite (tests/gpu/test_cuda.py).
            velocities = [velocity.clone() for velocity in velocities]
        return velocities

    def warm_up(self, forwards_by_kind: Iterable[RowForward], progress: Callable[[int], None] | None = None) -> int:
        """Run every bucket for each given forward (one per kind the service meets: a sink capture, a denoising
        forward, a commit forward, at each warm-up geometry: ``warmup_forwards``, consumed one at a time), repeating
        the forward to fill the rows, then seal the step (``__call__``: no compile after this). ``progress`` hears the
        number of shapes compiled so far after each call. Returns the number of calls made. A compiler that cannot
        run here (``compiler_problem``) raises at once, before any tracing."""
        problem = compiler_problem(next(self.model.parameters()).device, self.backend)
        if problem is not None:
            raise RuntimeError(problem)
        self.sealed = False
        calls = 0
        for forward in forwards_by_kind:
            for size in self.buckets:
                copies = max(1, size // forward.rows)
                self(self.model, [forward] * copies)
                calls += 1
                if progress is not None:
                    progress(len(self.compiled))
            # Not held while the generator builds its next throwaway session: this forward's window is freed first.
            del forward
        self.sealed = True
        return calls

    def shapes_to_compile(self, config, geometries: Iterable[tuple[int, int]]) -> int:
        """How many (bucket, tokens per row) shapes ``warm_up`` compiles for sessions of ``config`` at these latent
        sizes: the sink's frames and every block length from 1 to ``block_size`` frames, times the buckets."""
        tokens = {frames * height * width for height, width in geometries
                  for frames in (config.sink_frames, *range(1, config.block_size + 1))}
        return len(tokens) * len(self.buckets)


def _make_room(shapes: int) -> None:
    """Let dynamo keep a compiled entry per shape (bucket, tokens per row) for each function it compiles (diffusers'
    block forward has two per shape: it is entered with and without keyword arguments), with room to spare. Past
    its limits (8 entries per function by default) dynamo runs the function eagerly without a word, which would
    quietly undo the compiled step; raised, never lowered (the setting is process-wide)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 4 * shapes)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 16 * shapes)


def warmup_forwards(refiner, config, height: int, width: int, prompt_tokens: int) -> Iterator[RowForward]:
    """One forward of each kind a session runs, at this geometry: its sink capture, and a denoising and a commit
    forward of a full block and of every short last block a flush can leave (1 to ``block_size - 1`` frames: other
    token counts, so other graphs), from throwaway sessions refined eagerly. Compiling all of them before ``/ready``
    is what keeps a flushed session from compiling on the engine thread while others wait.

    A generator: each throwaway session is built when its forwards are asked for and dropped when the next one is,
    so a warm-up (consuming one forward at a time) holds one session's window at a time (about 9 GiB at 720p at the
    released size), not one per kind."""
    from .session import RefinerSession

    info = refiner.info
    generator = torch.Generator().manual_seed(0)
    frames = config.sink_frames + config.block_size
    latents = torch.randn(1, info.in_channels, frames, height, width, generator=generator)  # (1, C, T, H, W)
    embeds = torch.randn(1, prompt_tokens, info.caption_channels, generator=generator)  # (1, L, D)

    session = RefinerSession(refiner, config)
    session.append(session.check(latents[:, :, : config.sink_frames], embeds))
    yield session.next_forward(session.start(session.plan()))  # the sink's
    for block_frames in range(config.block_size, 0, -1):
        # The previous session's window is freed before the next one is allocated (its last forward is dropped by
        # the caller, CompiledStep.warm_up, before asking for the next).
        session = None
        session = RefinerSession(refiner, config)
        session.push(latents[:, :, : config.sink_frames], embeds)
        end = config.sink_frames + block_frames
        session.append(session.check(latents[:, :, config.sink_frames : end]),
                       flush=block_frames < config.block_size)
        run = session.start(session.plan())
        yield session.next_forward(run)  # denoising
        while (forward := session.next_forward(run)).mode != "commit":
            session.advance(run, run_batch(refiner.model, [forward])[0])
        yield forward
        del forward, run
