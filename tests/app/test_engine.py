"""The engine on its own: fair turns between lanes, order within a lane, bounded queues, failure isolation,
and a warm-up that reaches the steady-state window."""

from __future__ import annotations

import asyncio

import pytest
import torch

from app.engine import ChunkJob, Engine, Lane
from app.errors import ApiError
from app.metrics import Metrics
from app.services import warmup_job
from app.settings import Settings
from models import RefinerSession, SessionConfig

from .conftest import DEADLINE_S, EngineHold, expected_clip, make_clip


def run_with_engine(coroutine_fn, queue_depth=16, lane_depth=4):
    engine = Engine(Metrics(), queue_depth, lane_depth)
    engine.start()
    try:
        return asyncio.run(asyncio.wait_for(coroutine_fn(engine), DEADLINE_S))
    finally:
        engine.stop()


def lane(refiner, name, **config) -> Lane:
    return Lane(session=RefinerSession(refiner, SessionConfig(**config)), name=name)


def test_lanes_take_turns_one_step_each_and_keep_their_own_order(refiner):
    order = []

    async def scenario(engine):
        hold = EngineHold()
        held = asyncio.ensure_future(engine.call(hold))
        await asyncio.to_thread(hold.wait_started)
        lanes = [lane(refiner, "a"), lane(refiner, "b")]
        futures = []
        for name, one in zip("ab", lanes):
            latents, embeds, _ = make_clip(frames=7, seed=ord(name))
            for part in (latents[:, :, :4], latents[:, :, 4:]):
                job = ChunkJob(
                    one,
                    part,
                    embeds if part.shape[2] == 4 else None,
                    atomic=False,
                    on_unit=lambda unit, name=name: order.append((name, unit.frame_start)),
                )
                futures.append(engine.submit(job))
        hold.release.set()
        await held
        await asyncio.gather(*futures)

    run_with_engine(scenario)
    # Both lanes were queued before the engine was released: their steps alternate, each lane in frame order.
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 4), ("b", 4)]


def test_queue_bounds_refuse_at_once(refiner):
    async def scenario(engine):
        hold = EngineHold()
        held = asyncio.ensure_future(engine.call(hold))
        await asyncio.to_thread(hold.wait_started)
        latents, embeds, _ = make_clip(frames=1)
        one, two = lane(refiner, "one"), lane(refiner, "two")
        first = engine.submit(ChunkJob(one, latents, embeds))
        with pytest.raises(ApiError) as lane_full:
            engine.submit(ChunkJob(one, latents, embeds))
        assert lane_full.value.kind == "engine_busy" and "session_queue_depth" in lane_full.value.message
        second = engine.submit(ChunkJob(two, latents, embeds))
        with pytest.raises(ApiError) as engine_full:
            engine.submit(ChunkJob(lane(refiner, "three"), latents, embeds))
        assert engine_full.value.kind == "engine_busy" and "engine_queue_depth" in engine_full.value.message
        assert engine.outstanding == 2
        hold.release.set()
        await asyncio.gather(held, first, second)
        assert engine.outstanding == 0
        engine.stop_accepting()
        with pytest.raises(ApiError) as draining:
            engine.submit(ChunkJob(one, latents, embeds))
        assert draining.value.kind == "draining"

    run_with_engine(scenario, queue_depth=2, lane_depth=1)


def test_a_failing_forward_restores_its_session_and_spares_the_others(refiner, monkeypatch):
    latents, embeds, mask = make_clip(frames=8, seed=5)
    expected = expected_clip(refiner, latents, embeds, mask)

    async def scenario(engine):
        broken, healthy = lane(refiner, "broken"), lane(refiner, "healthy")
        real_execute = broken.session.execute
        calls = {"n": 0}

        def flaky(plan):
            calls["n"] += 1
            if calls["n"] == 3:  # the second block: the sink and one block already committed in this job
                raise RuntimeError("CUDA out of memory (injected)")
            return real_execute(plan)

        monkeypatch.setattr(broken.session, "execute", flaky)
        before = broken.session.state
        failing = engine.submit(ChunkJob(broken, latents, embeds, mask, seq=0, flush=True, finalize=_cat))
        other = engine.submit(ChunkJob(healthy, latents, embeds, mask, flush=True, finalize=_cat))
        with pytest.raises(RuntimeError, match="out of memory"):
            await failing
        assert broken.session.state is before, "an atomic job that fails leaves the session as it found it"
        assert broken.next_seq == 0, "a failed request does not use up its seq"
        healthy_out = (await other).value
        retried = (await engine.submit(ChunkJob(broken, latents, embeds, mask, seq=0, flush=True, finalize=_cat))).value
        return healthy_out, retried

    healthy_out, retried = run_with_engine(scenario)
    assert torch.equal(healthy_out, expected)
    assert torch.equal(retried, expected), "the retry gives the bytes an untroubled run gives"


def _cat(units, state):
    return torch.cat([unit.latents for unit in units], dim=2)


def test_warm_up_reaches_the_steady_state_window(refiner):
    settings = Settings(default_block_size=2, default_kv_max_frames=7, default_sink_frames=2, warmup_height=3)
    job = warmup_job(refiner, settings)

    async def scenario(engine):
        await engine.submit(job)

    run_with_engine(scenario)
    state = job.lane.session.state
    config = job.lane.session.config
    assert state.geometry.height == 3 and state.geometry.width == 4
    assert state.history_frames == config.max_history_frames, "the last block attended to a full window"
    assert state.blocks_refined >= 2 and state.pending_frames == 0
    # The history was already full before the last block, so that block ran at the steady-state shape.
    assert (state.blocks_refined - 1) * config.block_size >= config.max_history_frames
