"""Batched forwards: a session's bytes do not depend on which sessions share its forwards, and batched sessions
still equal diffusers' reference refiner."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from models import RefinerSession, SessionConfig, from_model, run_batch
from models.checkpoints import build_model
from models.determinism import gemm_batch_invariant
from models.step import run_isolated

from tests.reference import REBASED_TOLERANCE, assert_parity, reference_refine


@dataclass
class Stream:
    """One session fed a whole clip at once, refined forward by forward by ``drive``."""

    name: str
    config: SessionConfig
    latents: torch.Tensor
    embeds: torch.Tensor
    mask: torch.Tensor | None
    offset: int = 0  # starts after this many rounds, so that neighbours' histories differ in length
    units: list = field(default_factory=list)

    def output(self) -> torch.Tensor:
        return torch.cat([unit.latents for unit in self.units], dim=2)


def make_stream(name, frames, height, width, prompt_len, seed, batch=1, masked=False, offset=0, **config):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 128, frames, height, width, generator=generator)
    embeds = torch.randn(batch, prompt_len, 32, generator=generator)
    mask = None
    if masked:
        mask = torch.ones(batch, prompt_len, dtype=torch.int64)
        mask[:, : prompt_len // 3] = 0
    return Stream(name, SessionConfig(seed=seed, **config), latents, embeds, mask, offset)


def drive(refiner, streams: list[Stream], rng: random.Random | None) -> None:
    """Every stream's whole clip, one forward per stream per round. With ``rng`` the ready forwards of a round
    are cut into random groups (same token count) in random order and each group is one model call; without,
    every forward runs alone."""
    sessions = {}
    runs = {}
    round_ = 0
    while True:
        ready = []
        for stream in streams:
            if round_ < stream.offset:
                continue
            session = sessions.get(stream.name)
            if session is None:
                session = sessions[stream.name] = RefinerSession(refiner, stream.config)
                session.append(session.check(stream.latents, stream.embeds, stream.mask), flush=True)
            run = runs.get(stream.name)
            while True:
                if run is None:
                    plan = session.plan()
                    if plan is None:
                        break
                    run = runs[stream.name] = session.start(plan)
                forward = session.next_forward(run)
                if forward is not None:
                    ready.append((session, run, forward))
                    break
                stream.units.append(session.commit(run))
                run = runs[stream.name] = None
        if not ready and all(stream.name in sessions and runs.get(stream.name) is None
                             and sessions[stream.name].plan() is None for stream in streams):
            return
        round_ += 1
        if rng is None:
            calls = [[item] for item in ready]
        else:
            rng.shuffle(ready)
            groups: dict = {}
            for item in ready:
                groups.setdefault(item[2].group, []).append(item)
            calls = []
            for members in groups.values():
                while members:
                    size = rng.randint(1, len(members))
                    calls.append(members[:size])
                    members = members[size:]
            rng.shuffle(calls)
        for call in calls:
            velocities = run_batch(refiner.model, [forward for _, _, forward in call])
            for (session, run, _), velocity in zip(call, velocities):
                session.advance(run, velocity)


def mixed_streams():
    """Neighbours that differ in everything a row can differ in: content, seed, prompt length and mask, positions
    mode, batch, history length (offsets), window size, and geometry with the same token count (a 3-frame block
    at 4x4 and a 4-frame block at 4x3 are both 48 tokens; a 1-frame block and a 1-frame sink at 4x4 are both
    16, so sink captures and denoising forwards share calls)."""
    return [
        make_stream("a", 14, 4, 4, 6, seed=1, masked=True),
        make_stream("b", 17, 4, 4, 9, seed=2, offset=3),
        make_stream("c", 13, 4, 4, 6, seed=3, positions="rebased", offset=5),
        make_stream("d", 12, 4, 4, 4, seed=4, batch=2, masked=True, offset=1),
        make_stream("e", 14, 4, 3, 7, seed=5, block_size=4, kv_max_frames=9, offset=2),
        make_stream("f", 9, 4, 4, 5, seed=6, block_size=1, kv_max_frames=4, offset=4),
        make_stream("g", 16, 4, 4, 6, seed=7, sink_frames=2, block_size=2, kv_max_frames=6, positions="rebased"),
    ]


@pytest.fixture(scope="module")
def refiner():
    return from_model(build_model("tiny"))


@pytest.mark.parametrize("threads", [1, 2])
def test_batched_forwards_equal_solo_forwards_bit_for_bit(refiner, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        solo = mixed_streams()
        drive(refiner, solo, rng=None)
        for seed in (0, 1):
            batched = mixed_streams()
            drive(refiner, batched, rng=random.Random(seed))
            for alone, together in zip(solo, batched):
                assert [(u.frame_start, u.frame_end) for u in alone.units] == \
                       [(u.frame_start, u.frame_end) for u in together.units]
                assert torch.equal(alone.output(), together.output()), f"stream {alone.name} depends on its neighbours"
    finally:
        torch.set_num_threads(before)


def test_batched_mixed_config_sessions_equal_the_reference(refiner):
    """Each stream, refined batched with the others, against diffusers' SanaWMLTX2Refiner on its own clip:
    within the parity tolerance for absolute positions, within 1e-4 for rebased ones (which the reference does not have)."""
    streams = mixed_streams()
    drive(refiner, streams, rng=random.Random(7))
    for stream in streams:
        config = stream.config
        expected = reference_refine(build_model("tiny"), stream.latents, stream.embeds, stream.mask, seed=config.seed,
                                    sink=config.sink_frames, block=config.block_size, kv_max=config.kv_max_frames)
        got = stream.output()
        if config.positions == "absolute":
            assert_parity(got, expected, f"stream {stream.name}")
        else:
            assert_parity(got, expected, f"stream {stream.name} (rebased)", REBASED_TOLERANCE)


@pytest.fixture(scope="module")
def medium():
    return from_model(build_model("medium"))


def steady_session(refiner, seed: int, prompt_len: int, positions="absolute"):
    """A medium-model session at 8x8 whose window is full, and the inputs of its next block's first forward."""
    config = SessionConfig(seed=seed, positions=positions)
    generator = torch.Generator().manual_seed(seed)
    frames = config.kv_max_frames + 2 * config.block_size
    latents = torch.randn(1, 128, frames, 8, 8, generator=generator)
    embeds = torch.randn(1, prompt_len, 128, generator=generator)
    session = RefinerSession(refiner, config)
    session.push(latents[:, :, : frames - config.block_size], embeds)
    session.append(session.check(latents[:, :, frames - config.block_size :]))
    run = session.start(session.plan())
    return session, run


def test_medium_rows_alone_and_stacked_by_1_2_4_8_are_bit_identical(medium):
    """The issue's measurement, redone with the fix: medium refiner, 8x8 latents, full windows, two threads; a
    row's velocity alone equals its velocity stacked with 1, 3 or 7 random neighbours, at any position."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert gemm_batch_invariant("cpu", torch.float32), "MKL_CBWR did not take effect"
        sessions = [steady_session(medium, seed, prompt_len=8 + seed, positions="rebased" if seed % 3 == 0 else
                                   "absolute") for seed in range(8)]
        forwards = [session.next_forward(run) for session, run in sessions]
        alone = [run_batch(medium.model, [forward])[0] for forward in forwards]
        rng = random.Random(0)
        for size in (2, 4, 8):
            order = rng.sample(range(8), size)
            stacked = run_batch(medium.model, [forwards[i] for i in order])
            for index, velocity in zip(order, stacked):
                assert torch.equal(velocity, alone[index]), f"row {index} in a batch of {size} at {order}"
    finally:
        torch.set_num_threads(before)


def test_a_failing_row_is_isolated_and_the_others_keep_their_bytes(refiner):
    """When a batched call fails, each forward runs alone: only the one that fails by itself gets the error."""
    streams = [make_stream(name, 7, 4, 4, 5, seed=seed) for seed, name in enumerate("xyz")]
    sessions = []
    for stream in streams:
        session = RefinerSession(refiner, stream.config)
        session.push(stream.latents[:, :, :4], stream.embeds)
        session.append(session.check(stream.latents[:, :, 4:7]))
        sessions.append((session, session.start(session.plan())))
    forwards = [session.next_forward(run) for session, run in sessions]
    expected = run_batch(refiner.model, forwards)
    broken = sessions[1][0]

    def fail_for_broken(module, args, kwargs):
        if any(row.owner is broken for row in kwargs["kv_cache"].rows):
            raise RuntimeError("CUDA out of memory (injected for one session)")

    handle = refiner.model.transformer_blocks[1].register_forward_pre_hook(fail_for_broken, with_kwargs=True)
    try:
        results = run_isolated(refiner.model, forwards)
    finally:
        handle.remove()
    assert isinstance(results[1], RuntimeError) and "injected" in str(results[1])
    assert torch.equal(results[0], expected[0]) and torch.equal(results[2], expected[2])
