"""What one app holds and how it starts and stops: the engine, the registry, the metrics, the loaded refiner.

Lifecycle: ``start`` runs the engine thread and loads the refiner on it (a load failure fails start-up), then
warms the model up in the background at the steady-state window shape while ``/health`` already answers and
``/ready`` says why it is not ready. ``drain`` stops admitting, lets in-flight blocks finish and closes the
streams with 1001 and a reason, before the server closes connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from models import Refiner, RefinerSession, load_refiner

from .engine import ChunkJob, Engine, Lane
from .errors import WS_GOING_AWAY, ApiError
from .metrics import Metrics
from .registry import Registry
from .settings import Settings

log = logging.getLogger("app")


class Services:
    """What one app holds. Created by ``create_app``, started and stopped by its lifespan."""

    def __init__(self, settings: Settings, warmup_gate: Callable[[], None] | None = None):
        self.settings = settings
        self.metrics = Metrics()
        self.engine = Engine(self.metrics, settings.engine_queue_depth, settings.session_queue_depth)
        self.registry = Registry(
            max_sessions=settings.max_sessions,
            idle_timeout_s=settings.session_idle_timeout_s,
            remember_evicted=settings.evicted_ids_remembered,
            retry_after_s=settings.retry_after_s,
        )
        self.metrics.track(
            sessions=lambda: len(self.registry),
            cache_bytes=self.registry.total_cache_bytes,
            queue=lambda: self.engine.outstanding,
        )
        self.refiner: Refiner | None = None
        self.not_ready_reason: str | None = "loading the model"
        self.draining = False
        self.streams: set[Any] = set()  # open WebSocket streams (app.routes.stream.StreamConnection)
        self.warmup_gate = warmup_gate
        self._tasks: list[asyncio.Task] = []

    # --- admission -----------------------------------------------------------------------------------------
    def require_ready(self) -> None:
        if self.not_ready_reason is None:
            return
        kind = "draining" if self.draining else "not_ready"
        raise ApiError(
            kind, f"the server is not ready ({self.not_ready_reason}); retry in {self.settings.retry_after_s} s"
        )

    def require_model(self) -> Refiner:
        if self.refiner is None:
            raise ApiError("not_ready", f"the model is not loaded yet ({self.not_ready_reason}); retry shortly")
        return self.refiner

    def reject(self, error: ApiError) -> None:
        self.metrics.rejected_requests.labels(reason=error.kind).inc()

    # --- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.engine.start()
        settings = self.settings
        if settings.torch_threads is not None:
            # Process-wide; on a shared CPU, fewer threads avoid OpenMP workers spinning against each other.
            torch.set_num_threads(settings.torch_threads)
        self.refiner = await self.engine.call(lambda: _load(settings))
        log.info("loaded %s", self.refiner.info.to_dict())
        self._tasks.append(asyncio.create_task(self._warm_up(), name="warm-up"))
        self._tasks.append(asyncio.create_task(self._evict_forever(), name="evict-idle"))

    async def _warm_up(self) -> None:
        try:
            if self.warmup_gate is not None:
                self.not_ready_reason = "warming up"
                await self.engine.call(self.warmup_gate)
            if self.settings.warmup:
                self.not_ready_reason = "warming up"
                started = time.perf_counter()
                await self.engine.run(warmup_job(self.refiner, self.settings))
                log.info("warm-up done in %.2f s", time.perf_counter() - started)
            self.not_ready_reason = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("warm-up failed")
            self.not_ready_reason = f"warm-up failed: {exc}"

    async def _evict_forever(self) -> None:
        interval = min(self.settings.session_idle_timeout_s / 2, 5.0)
        while True:
            await asyncio.sleep(interval)
            evicted = self.registry.evict_idle()
            if evicted:
                log.info("evicted %d idle session(s)", len(evicted))

    async def drain(self) -> None:
        """Stop admitting, finish in-flight blocks, close streams cleanly. Idempotent."""
        if self.draining:
            return
        self.draining = True
        self.not_ready_reason = "draining: the server is shutting down"
        self.engine.stop_accepting()
        timeout = self.settings.drain_timeout_s
        if not await self.engine.wait_idle(timeout):
            log.warning("drain: %d job(s) still running after %.0f s", self.engine.outstanding, timeout)
        # The engine hands results to the loop in order; one more call puts us behind the last of them, so no
        # stream is closed before the units it was owed are queued.
        with contextlib.suppress(Exception):
            await self.engine.call(lambda: None)
        streams = list(self.streams)
        for stream in streams:
            stream.close(WS_GOING_AWAY, "server shutting down; reconnect after it restarts")
        await asyncio.gather(*(stream.closed() for stream in streams), return_exceptions=True)

    async def stop(self) -> None:
        await self.drain()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.engine.stop)


def warmup_job(refiner: Refiner, settings: Settings) -> ChunkJob:
    """A throwaway stream long enough that its last block attends to a full window (sink + K - S history
    frames + the block), so start-up pays for every allocation and kernel choice of the steady state."""
    config = settings.session_defaults()
    blocks = math.ceil(config.max_history_frames / config.block_size) + 1
    frames = config.sink_frames + blocks * config.block_size
    generator = torch.Generator().manual_seed(0)
    info = refiner.info
    latents = torch.randn(
        1, info.in_channels, frames, settings.warmup_height, settings.warmup_width, generator=generator
    )  # (1, C, T, H, W)
    prompt = torch.randn(1, settings.warmup_prompt_tokens, info.caption_channels, generator=generator)  # (1, L, D)
    lane = Lane(session=RefinerSession(refiner, config), name="warm-up", record_metrics=False)
    return ChunkJob(lane, latents, prompt, finalize=lambda units, state: None)


def model_dir(settings: Settings) -> Path:
    """The folder to serve: the configured one, or the embedded tiny refiner (built on first use)."""
    if settings.model:
        return Path(settings.model).expanduser()
    return ensure_embedded_model(settings.embedded_model_dir)


def ensure_embedded_model(folder: Path) -> Path:
    from models.checkpoints import write_checkpoint

    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a crash or a second server starting at once never leaves (or
    # reads) a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=folder.parent))
    write_checkpoint(staging, preset="tiny")
    try:
        os.rename(staging, folder)
    except OSError:
        if not (folder / "config.json").is_file():
            raise
    log.info("built the embedded tiny refiner in %s", folder)
    return folder


def _load(settings: Settings) -> Refiner:
    return load_refiner(model_dir(settings), device=settings.device, dtype=settings.dtype)
