"""Committed units on their way to clients, off the engine thread: host copy, encoding, publication in order.

The engine hands each committed unit of a stream over the moment it commits it (``Deliveries.hand_over``, on the
engine thread: it only starts the device-to-host copy and schedules the rest on the event loop). There, a
one-thread encoder pool turns the unit into safetensors bytes, and the session publishes the units in commit
order: retained for reattaching clients, queued on the attached connection. HTTP responses are encoded by the
same pool (``Encoder.payload``). The block latency metric is observed here, once the unit's bytes are on the
host, so on a GPU it measures finished work rather than queued kernels.

Nothing committed is lost on the way: a unit whose hand-over failed is still in its work's result and is
handed over again (``Deliveries.push`` ignores a unit it already has), and a unit that cannot be encoded is
retained as a tensor, encoded again when it is next sent (``app.resume.SentUnit``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from models.session import SessionState, Unit
from models.transfer import HostCopy

from .codec import LATENTS, encode
from .metrics import Metrics
from .resume import SentUnit

log = logging.getLogger(__name__)


class Encoder:
    """Encodes units and responses on one worker thread (the engine thread never waits for it)."""

    def __init__(self, metrics: Metrics, response_dtype: str):
        self.metrics = metrics
        self.response_dtype = response_dtype
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unit-encoder")

    def unit_bytes(self, unit: Unit, latents: torch.Tensor, received: float) -> bytes:
        """A stream unit: latents with metadata frame_start, frame_end, latency_ms (since its chunk arrived)."""
        if self.response_dtype == "float32":
            latents = latents.float()
        latency_ms = (time.perf_counter() - received) * 1000.0
        return encode(
            {LATENTS: latents},
            {"frame_start": unit.frame_start, "frame_end": unit.frame_end, "latency_ms": f"{latency_ms:.3f}"},
        )

    def _encode_unit(self, unit: Unit, host: HostCopy, received: float) -> tuple[torch.Tensor, bytes]:
        latents = host.wait()
        self.observe(unit)
        return latents, self.unit_bytes(unit, latents, received)

    def observe(self, unit: Unit) -> None:
        if unit.kind == "block":
            self.metrics.block_latency.observe(time.perf_counter() - unit.started_at)

    async def run(self, fn: Callable[[], bytes]) -> bytes:
        """Run an encoding on the encoder thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def response(self, units, state: SessionState, request_shape: tuple[int, ...],
                 metadata: dict[str, object] | None = None) -> Callable[[], bytes]:
        """What encodes an HTTP response: the frames ``units`` finalized as one latents (B, C, n, H, W), n >= 0,
        with metadata frame_start, frame_end and ``metadata``. Block latencies are observed the first time."""
        units, observed = tuple(units), []

        def build() -> bytes:
            payload = self._response(units, state, request_shape, metadata)
            if not observed:  # once the bytes are on the host
                observed.append(True)
                for unit in units:
                    self.observe(unit)
            return payload

        return build

    def _response(self, units, state, request_shape, metadata) -> bytes:
        if units:
            latents = torch.cat([HostCopy(unit.latents).wait() for unit in units], dim=2)  # (B, C, n, H, W)
            frame_start, frame_end = units[0].frame_start, units[-1].frame_end
        else:
            geometry = state.geometry
            if geometry is not None:
                shape = (geometry.batch, geometry.channels, 0, geometry.height, geometry.width)
            else:
                shape = (*request_shape[:2], 0, *request_shape[3:5])
            latents = torch.zeros(shape)  # (B, C, 0, H, W)
            frame_start = frame_end = state.frames_returned
        if self.response_dtype == "float32":
            latents = latents.to(torch.float32)
        return encode({LATENTS: latents}, {"frame_start": frame_start, "frame_end": frame_end, **(metadata or {})})

    def submit(self, loop: asyncio.AbstractEventLoop, unit: Unit, host: HostCopy, received: float) -> asyncio.Future:
        return loop.run_in_executor(self._pool, self._encode_unit, unit, host, received)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Outgoing:
    unit: Unit
    host: HostCopy
    received: float
    encoded: asyncio.Future  # (host latents, bytes)


class Deliveries:
    """One session's stream units between commit and publication, kept in commit order. Event loop only, except
    ``hand_over``'s callback, which runs on the engine thread."""

    def __init__(self, encoder: Encoder, publish: Callable[[Unit, SentUnit, float], None]):
        self.encoder = encoder
        self.publish = publish  # (unit, what goes on the wire, when its chunk arrived)
        self.handed_until = 0  # frame_end of the newest unit handed over
        self._queue: deque[_Outgoing] = deque()
        self._task: asyncio.Task | None = None

    def hand_over(self, received: float) -> Callable[[Unit], None]:
        """An ``on_unit`` for the engine thread: start the unit's host copy, continue on the loop."""
        loop = asyncio.get_running_loop()

        def on_unit(unit: Unit) -> None:
            host = HostCopy(unit.latents)
            loop.call_soon_threadsafe(self.push, unit, host, received)

        return on_unit

    def push(self, unit: Unit, host: HostCopy | None, received: float) -> None:
        """Encode and publish ``unit`` after every unit before it; a unit already handed over is ignored."""
        if unit.frame_end <= self.handed_until:
            return
        self.handed_until = unit.frame_end
        loop = asyncio.get_running_loop()
        host = host or HostCopy(unit.latents)
        self._queue.append(_Outgoing(unit, host, received, self.encoder.submit(loop, unit, host, received)))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._publish_in_order())

    async def _publish_in_order(self) -> None:
        while self._queue:
            item = self._queue[0]
            try:
                latents, payload = await asyncio.shield(item.encoded)
                sent = SentUnit(item.unit.frame_start, item.unit.frame_end, payload)
            except Exception:
                log.exception("encoding units [%d, %d) failed; kept as a tensor, encoded again when next sent",
                              item.unit.frame_start, item.unit.frame_end)
                sent = SentUnit(item.unit.frame_start, item.unit.frame_end, None, item.host.wait())
            self._queue.popleft()
            self.publish(item.unit, sent, item.received)

    async def flush(self) -> None:
        """Return once every unit handed over so far is published."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
