"""Committed units on their way to clients, off the engine thread: host copy, encoding, publication in order.

The engine hands each committed unit of a stream over the moment it commits it (``Deliveries.hand_over``, on the
engine thread: it only starts the device-to-host copy and schedules the rest on the event loop). There, the
encoder pool (``encode_workers`` threads) turns the unit into safetensors bytes (JPEG or H.264 video included),
and the session publishes the units in commit order: retained for reattaching clients, queued on the attached
connection. HTTP responses are encoded by the same pool (``Encoder.response``). A unit's payloads (one per output kind: ``app.outputs.stage``) are copied to the host
and put on the wire by their stages, as its session's ``app.outputs.kinds.Outputs`` say. The block latency metric is
observed here, once the unit's bytes are on the host, so on a GPU it measures finished work rather than queued
kernels.

The unit's finite check (``models.session.FiniteCheck``: on an accelerator the engine thread never reads it) is
copied with its payloads and read where they are awaited: a unit that is not finite raises the session's
``NonFiniteOutputError`` there instead of being encoded (an HTTP response then fails with it as it did at commit;
a stream unit is not published). On a CPU the session checked it at commit and there is nothing left to read.
The engine reads the same verdict before the session's next forward and undoes such a block (``app.engine.worker``, late
verdicts); the units it undid come back in ``Work.withdrawn`` and ``Deliveries.withdraw`` forgets them, so the
block's retry (the same frames) is handed on and published like any unit.

Nothing committed is lost on the way: a unit whose hand-over failed is still in its work's result and is
handed over again (``Deliveries.push`` ignores a unit it already has), and a unit that cannot be encoded is
retained as a tensor, encoded again when it is next sent (``app.outputs.replay.SentUnit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from models.errors import NonFiniteOutputError
from models.session import SessionState
from models.transfer import HostCopy

from app.core.codec import encode
from app.core.metrics import Metrics
from app.core.tasks import retrieve
from app.outputs.catalog import build_stages
from app.outputs.kinds import HostUnit, Outputs, payload
from app.outputs.replay import SentUnit
from app.outputs.stage import OutputStages, OutUnit

log = logging.getLogger(__name__)


class UnitCopies:
    """A unit's payloads on their way to the host (started on the engine thread, awaited off it)."""

    def __init__(self, unit: OutUnit, stages: OutputStages):
        self.unit = unit
        self._waits = {kind: stages[kind].to_host(payload) for kind, payload in unit.payloads.items()}
        check = getattr(unit, "check", None)
        # (3,) floats: the copy the session queued at commit (the engine reads the same one), else queued now.
        self._check = None if check is None else (check, check.host or HostCopy(check.summary))
        self._host: HostUnit | None = None
        self._lock = threading.Lock()

    def wait(self) -> HostUnit:
        """The unit on the host: one ``HostUnit`` for every caller, so what is encoded from it (a video format)
        is encoded once for the response and every watcher. ``NonFiniteOutputError`` if it is not finite."""
        with self._lock:
            if self._check is not None:
                check, copy = self._check
                error = check.error(copy.wait())  # on this (encoder) thread: the engine thread never waits for it
                if error is not None:
                    raise error
                self._check = None
            if self._host is None:
                unit = self.unit
                self._host = HostUnit(unit.kind, unit.frame_start, unit.frame_end, tuple(unit.latents.shape),
                                      {kind: wait() for kind, wait in self._waits.items()})
            return self._host


# How much lower than the rest of the process the watchers' encoder threads run (a Linux thread's nice value).
# At nice 10 the kernel's scheduler gives a thread about a tenth of a normal one's share of a core when both want
# it: a watcher's JPEG or H.264 runs in the CPU time the engine and the producer's encoding leave over.
WATCH_NICE = 10


def _lower_priority() -> None:
    """The initializer of a watchers' encoder thread: lower its own CPU priority. Linux schedules threads one by
    one, so ``setpriority`` of this thread's id touches no other thread; raising one's own nice value needs no
    privilege. Elsewhere (no per-thread nice) the pool only stays smaller than the producers'."""
    with contextlib.suppress(OSError, AttributeError):
        # Relative to the thread's own (inherited) nice value: a service started under `nice` (or a container's
        # default) keeps its watchers below its producers, where an absolute WATCH_NICE put them level, or tried to
        # raise them (refused without privilege).
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + WATCH_NICE))


class Encoder:
    """Encodes units and responses on ``workers`` threads (the engine thread never waits for them), and watchers'
    units on a pool of their own: a producer's unit never queues behind a watcher's encoding. The watchers' pool
    is smaller (half the threads, at least one) and its threads run at a lower CPU priority (``WATCH_NICE``), so
    on a machine with few cores a watcher's encoding takes CPU time from neither the engine nor the producer's
    encoding: watchers that fall behind lose units (their queues are bounded), the producer never waits. How many
    distinct encodings a session's watchers may ask for is bounded too (``max_watch_encodings``,
    ``app.sessions.operations``). A unit's video is encoded once per format whoever asks
    (``app.outputs.video.HostVideo.encoded``); units of one session encoded in parallel are still published in
    order (``Deliveries``)."""

    def __init__(self, metrics: Metrics, response_dtype: str, workers: int = 2):
        self.metrics = metrics
        self.response_dtype = response_dtype
        self.stages: OutputStages = build_stages()  # what puts each kind on the wire: the server's, once loaded
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="unit-encoder")
        self.watch_workers = max(1, workers // 2)
        self._watch_pool = ThreadPoolExecutor(max_workers=self.watch_workers, thread_name_prefix="watch-encoder",
                                              initializer=_lower_priority)

    def unit_bytes(self, host: HostUnit, outputs: Outputs, received: float,
                   extra: dict[str, str] | None = None) -> bytes:
        """A stream or watcher unit: its outputs with metadata frame_start, frame_end (video_frame_start,
        video_frame_end with video), latency_ms (since its chunk was read, up to now: its outputs are on the wire)
        and ``extra`` (``unit_metadata``: the seq of the chunk that finalized it, the session's durable_frames)."""
        tensors, metadata = payload(
            [host], outputs, self.stages, latent_shape=host.latent_shape, frame_at=host.frame_start, positions={},
            response_dtype=self.response_dtype,
        )
        metadata["latency_ms"] = latency_ms(received)
        metadata.update(extra or {})
        return encode(tensors, metadata)

    def _encode_unit(self, copies: UnitCopies, outputs: Outputs, received: float,
                     extra: dict[str, str] | None = None) -> tuple[HostUnit, bytes]:
        host = copies.wait()
        self.observe(copies.unit)
        return host, self.unit_bytes(host, outputs, received, extra)

    def observe(self, unit: OutUnit) -> None:
        if unit.kind == "block":
            self.metrics.block_latency.observe(time.perf_counter() - unit.started_at)

    async def run(self, fn: Callable[[], bytes]) -> bytes:
        """Run an encoding on the encoder pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def run_for_watcher(self, fn: Callable[[], bytes]) -> bytes:
        """Run a watcher's encoding on the watchers' pool."""
        return await asyncio.get_running_loop().run_in_executor(self._watch_pool, fn)

    def response(self, units, state: SessionState, request_shape: tuple[int, ...],
                 metadata: dict[str, object] | None = None, outputs: Outputs = Outputs(),
                 positions: dict[str, int] | None = None, received: float | None = None) -> Callable[[], bytes]:
        """What encodes an HTTP response: the frames ``units`` finalized as one payload (latents (B, C, n, H, W),
        n >= 0, and/or video), with metadata frame_start, frame_end (video_frame_start, video_frame_end),
        latency_ms (since ``received``, when the request's body was read) and ``metadata`` (the seq).
        ``positions``: where each output kind stands (``WorkResult.positions``), for a response without units.
        Block latencies are observed the first time. ``units``: ``OutUnit``s, or their ``UnitCopies`` when the same
        units go to watchers too (one host copy and one video encoding for all).

        The first bytes built are kept: a response built again (a repeated seq asking before the first build was
        stored, a snapshot, maybe at the same time on another thread) returns them. Encoding it again would not
        give the same bytes: safetensors writes the metadata in no fixed order (and the latency is taken at the
        first build)."""
        copies = [unit if isinstance(unit, UnitCopies) else UnitCopies(unit, self.stages) for unit in units]
        units, observed = tuple(c.unit for c in copies), []
        latency: list[str] = []
        built: list[bytes] = []  # the first bytes built, returned by every build
        keep = threading.Lock()

        def build() -> bytes:
            if built:
                return built[0]
            hosts = [c.wait() for c in copies]
            geometry = state.geometry
            if geometry is not None:
                shape = (geometry.batch, geometry.channels, 0, geometry.height, geometry.width)
            else:
                shape = (*request_shape[:2], 0, *request_shape[3:5])
            tensors, meta = payload(hosts, outputs, self.stages, latent_shape=shape, frame_at=state.frames_returned,
                                    positions=positions or {}, response_dtype=self.response_dtype)
            if received is not None and not latency:
                latency.append(latency_ms(received))
            data = encode(tensors, {**meta, **({"latency_ms": latency[0]} if latency else {}), **(metadata or {})})
            if not observed:  # once the bytes are on the host
                observed.append(True)
                for unit in units:
                    self.observe(unit)
            with keep:  # not held while encoding: a build never waits for another one
                if not built:
                    built.append(data)
                return built[0]

        return build

    def submit(self, loop: asyncio.AbstractEventLoop, copies: UnitCopies, outputs: Outputs,
               received: float, extra: dict[str, str] | None = None) -> asyncio.Future:
        return loop.run_in_executor(self._pool, self._encode_unit, copies, outputs, received, extra)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._watch_pool.shutdown(wait=False, cancel_futures=True)


def latency_ms(received: float) -> str:
    """A unit's ``latency_ms`` metadata (api.md defines it): milliseconds from ``received``, when the message or
    body that completed it was read, to now, its payload ready to go out."""
    return f"{(time.perf_counter() - received) * 1000.0:.3f}"


def unit_metadata(seq: int, durable: dict[str, str] | None = None) -> dict[str, str]:
    """The metadata a unit carries besides its frames and latency: ``seq``, the index of the chunk (HTTP request
    or WebSocket message, the flush included) that finalized it, and the session's ``durable_frames``."""
    return {"seq": str(seq), **(durable or {})}


@dataclass
class _Outgoing:
    unit: OutUnit
    copies: UnitCopies
    received: float
    metadata: dict[str, str]  # seq, durable_frames: what the unit's bytes say besides its frames
    encoded: asyncio.Future  # (host unit, bytes)
    withdrawn: bool = False  # its block was undone (``Deliveries.withdraw``): never published


class Deliveries:
    """One session's stream units between commit and publication, kept in commit order. Event loop only, except
    ``hand_over``'s callback, which runs on the engine thread."""

    def __init__(self, encoder: Encoder,
                 publish: Callable[[OutUnit, SentUnit, float, HostUnit, dict[str, str]], None],
                 outputs: Outputs = Outputs()):
        self.encoder = encoder
        # (unit, what goes on the wire, when its chunk arrived, its tensors on the host, its metadata: seq, ...)
        self.publish = publish
        self.outputs = outputs
        self.handed_until: tuple[int, ...] = (0,)  # the key (OutUnit.key) of the newest unit handed over
        # Metadata for every unit, read when it is handed over (the session's durable_frames: app.sessions.store).
        self.metadata: Callable[[], dict[str, str]] | None = None
        self._queue: deque[_Outgoing] = deque()
        self._task: asyncio.Task | None = None
        self._previous: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (newest key, handed_until before it)

    @property
    def pending(self) -> int:
        """Units handed over and not yet published."""
        return len(self._queue)

    def hand_over(self, received: float, seq: int) -> Callable[[OutUnit], None]:
        """An ``on_unit`` for the engine thread: start the unit's host copy, continue on the loop. ``seq``: the
        index of the message whose units these are (``ChunkLog.next_seq`` while it holds the session's turn)."""
        loop = asyncio.get_running_loop()

        def on_unit(unit: OutUnit) -> None:
            copies = UnitCopies(unit, self.encoder.stages)
            loop.call_soon_threadsafe(self.push, unit, copies, received, seq)

        return on_unit

    def push(self, unit: OutUnit, copies: UnitCopies | None, received: float, seq: int) -> None:
        """Encode and publish ``unit`` after every unit before it; a unit already handed over is ignored."""
        if unit.key <= self.handed_until:
            return
        self._previous = (unit.key, self.handed_until)
        self.handed_until = unit.key
        loop = asyncio.get_running_loop()
        copies = copies or UnitCopies(unit, self.encoder.stages)
        metadata = unit_metadata(seq, None if self.metadata is None else self.metadata())
        encoded = self.encoder.submit(loop, copies, self.outputs, received, metadata)
        self._queue.append(_Outgoing(unit, copies, received, metadata, encoded))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._publish_in_order())

    def withdraw(self, unit: OutUnit) -> None:
        """Forget ``unit``: the engine undid its block (a late NaN/Inf verdict), so it is never published and the
        next unit handed on for the same frames (the retry) is taken. It is the newest unit handed over: the
        engine commits nothing of the session after it until the verdict is read."""
        for item in self._queue:
            if item.unit is unit:
                item.withdrawn = True
        if self._previous is not None and self._previous[0] == unit.key == self.handed_until:
            self.handed_until = self._previous[1]
            self._previous = None

    async def _publish_in_order(self) -> None:
        while self._queue:
            item = self._queue[0]
            if item.withdrawn:
                self._queue.popleft()
                item.encoded.add_done_callback(retrieve)  # it fails with the NaN/Inf error nobody awaits now
                continue
            try:
                host, data = await asyncio.shield(item.encoded)
                sent = SentUnit(item.unit.frame_start, item.unit.frame_end, data)
            except NonFiniteOutputError:
                log.error("units [%d, %d) refined to NaN or Inf (read off the engine thread, after commit): not "
                          "published", item.unit.frame_start, item.unit.frame_end)
                self._queue.popleft()
                continue
            except Exception:
                log.exception("encoding units [%d, %d) failed; kept as tensors, encoded again when next sent",
                              item.unit.frame_start, item.unit.frame_end)
                host = item.copies.wait()
                sent = SentUnit(item.unit.frame_start, item.unit.frame_end, None, host, self.outputs, item.metadata)
            self._queue.popleft()
            self.publish(item.unit, sent, item.received, host, item.metadata)

    async def flush(self) -> None:
        """Return once every unit handed over so far is published."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

