"""The engine's clock and device on the CPU: the engine thread binds the model's device, and every model call's
measured time reaches /metrics and the real-time cost model through ``models.clock.CallClock``."""

from __future__ import annotations

import asyncio
import threading

import torch

from app.core.metrics import Metrics
from app.engine.worker import Engine, EngineSession, Work
from models import RefinerSession, SessionConfig
from models.clock import CallClock

from tests.models.test_clock import FakeEvent

from tests.app.conftest import DEADLINE_S


def test_engine_thread_binds_the_models_device_before_its_next_job(monkeypatch, refiner):
    """The engine thread, not the thread that set the model, makes the model's device current."""
    bound = []
    monkeypatch.setattr("app.engine.worker.use_device", lambda device: bound.append((device, threading.current_thread().name)))
    engine = Engine(Metrics(), 4, 4)
    engine.start()
    try:
        engine.model = refiner.model

        async def job():
            return await engine.call(lambda: threading.current_thread().name)

        name = asyncio.run(job())
    finally:
        engine.stop()
    assert bound == [(refiner.device, name)]
    assert name == "refiner-engine"


def test_engine_feeds_measured_calls_to_metrics_and_the_cost_model(refiner):
    """Every model call reaches model_call_seconds and, on success, the per-row cost: through the clock."""
    engine = Engine(Metrics(), 8, 8)
    engine.model = refiner.model
    engine.start()
    try:
        session = EngineSession(RefinerSession(refiner, SessionConfig()), name="s")
        latents = torch.randn(1, refiner.info.in_channels, 13, 4, 4)
        embeds = torch.randn(1, 8, refiner.info.caption_channels)

        async def go():
            return await engine.run(Work(session, latents, embeds, flush=True))

        asyncio.run(go())
    finally:
        engine.stop()
    calls = engine.metrics.model_call_seconds._sum.get()
    count = sum(bucket.get() for bucket in engine.metrics.model_call_seconds._buckets)
    assert count > 0 and calls > 0
    assert engine.pacer.cost.calls == count  # every call succeeded: each one costed
    assert engine.clock.pending == 0


def test_engine_reads_device_time_only_once_the_device_got_there(refiner):
    """With CUDA-style events (fakes here) a call's cost is unknown at its commit and the engine does not wait for
    it: the figures arrive when the events have passed, at a later commit (here: observe_calls)."""
    log = []
    engine = Engine(Metrics(), 8, 8)
    engine.model = refiner.model
    engine.clock = CallClock("cpu", event_factory=lambda: FakeEvent(log))
    engine.start()
    try:
        session = EngineSession(RefinerSession(refiner, SessionConfig()), name="s")
        latents = torch.randn(1, refiner.info.in_channels, 13, 4, 4)
        embeds = torch.randn(1, 8, refiner.info.caption_channels)

        async def go():
            return await asyncio.wait_for(engine.run(Work(session, latents, embeds, flush=True)), DEADLINE_S)

        asyncio.run(go())
        calls = engine.clock.pending
        assert calls > 0 and engine.pacer.cost.calls == 0  # nothing waited for, nothing costed yet
        for event in log:
            event.done = True

        async def observe():
            return await engine.call(engine.observe_calls)

        asyncio.run(observe())
    finally:
        engine.stop()
    assert engine.pacer.cost.calls == calls and engine.clock.pending == 0
    tokens = 4 * 4 * SessionConfig().block_size
    assert engine.pacer.cost.per_row(tokens) == 1.0  # FakeEvent: one second between a call's two events
