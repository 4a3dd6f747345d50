"""The compiled step: bucketed batch sizes, a warm-up that compiles everything the service meets, and the same
results as the eager step."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from models import RefinerSession, SessionConfig, from_model, run_batch
from models.checkpoints import build_model
from models.compiled import CompiledStep, bucket_sizes, buckets, warmup_forwards


def test_buckets():
    assert buckets(8) == [1, 2, 4, 8] and buckets(6) == [1, 2, 4, 6] and buckets(1) == [1]
    assert bucket_sizes("every", 5) == [1, 2, 3, 4, 5] and bucket_sizes("powers", 6) == [1, 2, 4, 6]
    assert bucket_sizes([3, 1], 8) == [1, 3, 8]  # the largest call always has a size
    assert bucket_sizes([1, 3, 9], 4) == [1, 3, 4] and bucket_sizes([1, 2, 4, 8], 1) == [1]  # none past the largest
    for bad in ([0, 2], [], "all"):
        with pytest.raises(ValueError):
            bucket_sizes(bad, 8)
    refiner = from_model(build_model("tiny"))
    every, powers = CompiledStep(refiner.model, max_rows=8), CompiledStep(refiner.model, max_rows=8, sizes="powers")
    assert [every.bucket(rows) for rows in range(1, 9)] == list(range(1, 9))  # the default never pads a call
    assert [powers.bucket(rows) for rows in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def ready_forwards(refiner, count: int, rng: random.Random):
    """``count`` sessions at 4x4 each with a forward ready: sinks, denoising and commit forwards mixed."""
    forwards = []
    for index in range(count):
        config = SessionConfig(seed=index, positions=rng.choice(["absolute", "rebased"]))
        generator = torch.Generator().manual_seed(index)
        latents = torch.randn(1, 128, 7, 4, 4, generator=generator)
        embeds = torch.randn(1, rng.randint(3, 9), 32, generator=generator)
        session = RefinerSession(refiner, config)
        session.push(latents[:, :, : rng.choice([1, 4])], embeds)
        session.append(session.check(latents[:, :, session.state.frames_received : 7]))
        run = session.start(session.plan())
        for _ in range(rng.randint(0, 3)):
            session.advance(run, run_batch(refiner.model, [session.next_forward(run)])[0])
        forwards.append(session.next_forward(run))
    return forwards


def test_after_the_warm_up_no_mix_of_sessions_compiles_again_and_results_match_the_eager_step():
    """With dynamo's eager backend the compiled path runs exactly the eager ops, so this checks the plumbing
    (buckets, padding rows, the attention kept out of the graphs, guards) bit for bit, in seconds: against the eager
    step over the same rows padded to the same bucket (the same GEMM shapes by construction; a row alone would be
    a batch-invariance question, which the probe answers per machine: tests/models/test_invariance.py)."""
    torch._dynamo.reset()
    refiner = from_model(build_model("tiny"))
    step = CompiledStep(refiner.model, max_rows=4, backend="eager")
    config = SessionConfig()
    # The sink, and a denoising and a commit forward for each block length a flush can leave (3, 2, 1 frames).
    assert step.warm_up(warmup_forwards(refiner, config, 4, 4, 6)) == (1 + 2 * config.block_size) * len(step.buckets)
    frames_compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rng = random.Random(0)
    for trial in range(6):
        forwards = ready_forwards(refiner, rng.randint(1, 4), rng)
        by_group = {}
        for forward in forwards:
            by_group.setdefault(forward.group, []).append(forward)
        for group in by_group.values():
            rows = sum(forward.rows for forward in group)
            eager = run_batch(refiner.model, group, pad_to=step.bucket(rows))
            compiled = step(refiner.model, group)
            assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), f"trial {trial}"
            solo = [run_batch(refiner.model, [forward])[0] for forward in group]
            assert max((a - b).abs().max().item() for a, b in zip(solo, compiled)) <= 1e-5, f"trial {trial}"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames_compiled, "compiled again after warm-up"
    assert step.uncompiled_calls == 0, "a warmed shape ran eagerly"


def test_inductor_compiled_step_stays_within_parity_tolerance():
    """The real compiler (inductor's CPU code): fused kernels round differently, so this is the tolerance, not
    the bits."""
    torch._dynamo.reset()
    refiner = from_model(build_model("tiny"))
    step = CompiledStep(refiner.model, max_rows=2)
    step.warm_up(warmup_forwards(refiner, SessionConfig(), 4, 4, 6))
    forwards = ready_forwards(refiner, 2, random.Random(1))
    eager = run_batch(refiner.model, forwards) if forwards[0].group == forwards[1].group else None
    if eager is None:
        forwards = forwards[:1]
        eager = run_batch(refiner.model, forwards)
    compiled = step(refiner.model, forwards)
    assert max((a - b).abs().max().item() for a, b in zip(eager, compiled)) <= 1e-4


def test_a_whole_flushed_session_compiles_nothing_after_the_warm_up():
    """Every token count a session meets (the sink, full blocks, the short last block of a flush) is compiled by the
    warm-up: refining whole sessions of every length afterwards adds no graph (dynamo's counters)."""
    torch._dynamo.reset()
    refiner = from_model(build_model("tiny"))
    step = CompiledStep(refiner.model, max_rows=2, backend="eager")
    config = SessionConfig()
    step.warm_up(warmup_forwards(refiner, config, 4, 4, 6))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for frames in range(config.sink_frames + 1, config.sink_frames + 2 * config.block_size + 1):
        session = RefinerSession(refiner, config)
        generator = torch.Generator().manual_seed(frames)
        session.append(session.check(torch.randn(1, 128, frames, 4, 4, generator=generator),
                                     torch.randn(1, 6, 32, generator=generator)), flush=True)
        while (plan := session.plan()) is not None:
            run = session.start(plan)
            while (forward := session.next_forward(run)) is not None:
                session.advance(run, step(refiner.model, [forward])[0])
            session.commit(run)
        assert session.state.frames_returned == frames
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a session compiled after the warm-up"
    assert step.uncompiled_calls == 0, "a session's forward ran eagerly"


def refine_whole(step, refiner, config, height: int, width: int, seed: int) -> list[torch.Tensor]:
    """Refine a flushed 7-frame stream at ``height`` x ``width`` through ``step``; its refined blocks."""
    session = RefinerSession(refiner, config)
    generator = torch.Generator().manual_seed(seed)
    session.append(session.check(torch.randn(1, 128, 7, height, width, generator=generator),
                                 torch.randn(1, 6, 32, generator=generator)), flush=True)
    blocks = []
    while (plan := session.plan()) is not None:
        run = session.start(plan)
        while (forward := session.next_forward(run)) is not None:
            session.advance(run, step(refiner.model, [forward])[0])
        blocks.append(session.commit(run))
    return blocks


def test_every_warm_up_geometry_is_compiled_and_any_other_runs_eagerly_without_compiling():
    """The warm-up compiles each listed geometry (the service's warmup_geometries) and then seals the step: a stream
    at a listed size (or another with its tokens per frame) adds no graph; a stream at a size nobody listed adds no
    graph either (compiling on the engine thread would stall every session) but runs eagerly, reported to
    ``on_uncompiled``, with the eager step's bits."""
    torch._dynamo.reset()
    refiner = from_model(build_model("tiny"))
    missed = []
    step = CompiledStep(refiner.model, max_rows=2, backend="eager", on_uncompiled=lambda *shape: missed.append(shape))
    config = SessionConfig()
    geometries = [(4, 4), (2, 6), (1, 5)]
    # 3 geometries x 3 token counts x 2 batch sizes: more entries than dynamo keeps per function by default, past
    # which it would run the pieces eagerly without a word; here that is an error instead.
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256,
                                    fail_on_recompile_limit_hit=True):
        progress = []
        step.warm_up(itertools.chain.from_iterable(warmup_forwards(refiner, config, height, width, 6)
                                                   for height, width in geometries), progress=progress.append)
    assert step.sealed and len(step.compiled) == 3 * 3 * 2 == step.shapes_to_compile(config, geometries)
    assert progress == sorted(progress) and progress[-1] == len(step.compiled)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    refine_whole(step, refiner, config, 2, 6, seed=1)
    refine_whole(step, refiner, config, 6, 2, seed=1)  # the same token counts: the compiled pieces see only those
    assert missed == [] and step.uncompiled_calls == 0
    eager = refine_whole(run_batch, refiner, config, 3, 3, seed=2)
    unlisted = refine_whole(step, refiner, config, 3, 3, seed=2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "compiled after the warm-up"
    assert step.uncompiled_calls == len(missed) > 0 and {rows for rows, _ in missed} == {1}
    assert {tokens for _, tokens in missed} == {9, 27}  # the sink's frame and a 3-frame block, 3 x 3 tokens each
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(eager, unlisted))
    # A listed size, but a session's own block length (the warm-up compiles the server's defaults): eager too.
    missed.clear()
    refine_whole(step, refiner, SessionConfig(block_size=4), 4, 4, seed=3)
    assert {tokens for _, tokens in missed} == {64} and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_the_graphs_compiled_do_not_grow_with_the_model_depth():
    """The released refiner has 48 layers: were a layer's index (or anything else per layer) a constant of a compiled
    piece, each layer would compile its own copy of the same graph, 48 times the compile time and past dynamo's
    cache limit (then silently eager). The warm-up compiles the same number of graphs for 2 layers as for 5."""
    config = SessionConfig()
    compiled = {}
    for layers in (2, 5):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        refiner = from_model(build_model("tiny", num_layers=layers))
        step = CompiledStep(refiner.model, max_rows=2, backend="eager")
        # The sink's, a denoising and a commit forward.
        step.warm_up(itertools.islice(warmup_forwards(refiner, config, 4, 4, 6), 3))
        compiled[layers] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled[2] > 0 and compiled[5] == compiled[2], compiled


def test_a_graphed_steps_velocities_outlive_its_next_call():
    """With CUDA graphs (``reduce-overhead``, ``max-autotune``) a replay writes into the same static output memory
    each time, so a caller holding one call's velocities across the next call (``run_isolated``'s one-forward
    retries, the batch-invariance probe's solo forwards) would read the next call's. The body here stands in for a
    replay (its output lives in one buffer per shape, as a graph's does); what is tested is that a graphed step hands
    out velocities of their own. The real replay: tests/gpu/test_cuda.py."""
    from models.step import forward_body

    refiner = from_model(build_model("tiny"))
    static: dict = {}

    def replay(*args):
        out = forward_body(*args)
        return static.setdefault(tuple(out.shape), torch.empty_like(out)).copy_(out)

    for mode, graphed in (("reduce-overhead", True), ("max-autotune", True), ("max-autotune-no-cudagraphs", False)):
        step = CompiledStep(refiner.model, max_rows=1, mode=mode)
        assert step.graphed is graphed
        step.body = replay
        first, second = ready_forwards(refiner, 2, random.Random(3))
        assert first.group == second.group
        kept = step(refiner.model, [first])[0]
        expected = run_batch(refiner.model, [first])[0]
        step(refiner.model, [second])
        assert torch.equal(kept, expected) is graphed, mode


def test_the_warm_up_holds_one_throwaway_window_at_a_time(monkeypatch):
    """At the released size a 720p window is about 9 GiB: the warm-up's throwaway sessions (one per kind of forward)
    must not pile up. Counted when each is built: no earlier session's window is still alive (the last forward of the
    previous one, which holds its window, was dropped before the next was asked for)."""
    import gc

    from models import session as session_module
    from models.kv import SessionKV

    refiner = from_model(build_model("tiny"))
    alive = []
    build = session_module.RefinerSession.__init__

    def counting(self, *args, **kwargs):
        gc.collect()
        alive.append(sum(1 for thing in gc.get_objects() if isinstance(thing, SessionKV)))
        build(self, *args, **kwargs)

    gc.collect()
    before = sum(1 for thing in gc.get_objects() if isinstance(thing, SessionKV))  # other tests' sessions, if any
    monkeypatch.setattr(session_module.RefinerSession, "__init__", counting)
    step = CompiledStep(refiner.model, max_rows=2, backend="eager")
    step.warm_up(warmup_forwards(refiner, SessionConfig(), 4, 4, 6))
    assert alive == [before] * (1 + SessionConfig().block_size), (before, alive)
