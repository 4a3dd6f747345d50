"""A session streamed closed-loop through ``wm_refiner_client``, as a live generator streams: hand the stream some
frames, wait for the unit that ends at a given frame, hand it the next ones. The benchmarks time exactly that
(send -> unit received, at the client), with the library clients use rather than a private copy of the wire.

The library's ``session.stream(chunks)`` pulls ``chunks`` from an iterator and yields units; here the iterator is a
queue the benchmark fills, and a reader (a task, or a thread for the sync client) moves the units to another queue,
so the connection is open (and warm) before anything is timed: the stream asks its source for a first chunk only
once the server's ``session`` event has arrived, and ``open`` returns then. Closing the asyncio one stops its stream
without a flush; closing the sync one ends its source, so the library flushes (the pending frames, none when the
benchmark sent whole blocks) and the stream ends on the server's ``done``: a thread cannot interrupt another
thread's blocking receive, the end of the clip can.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from wm_refiner_client import AsyncClient, Client, Unit

OPEN_TIMEOUT_S = 600.0
UNIT_TIMEOUT_S = 600.0


class AsyncClosedLoop:
    """One session on ``base_url`` with ``config``, streamed closed-loop over ``AsyncClient``."""

    def __init__(self, base_url: str, config: dict[str, Any]):
        self.client = AsyncClient(base_url, timeout=UNIT_TIMEOUT_S)
        self.config = config
        self.session_id: str | None = None
        self._chunks: asyncio.Queue = asyncio.Queue()
        self._units: asyncio.Queue = asyncio.Queue()
        self._asked = asyncio.Event()
        self._reader: asyncio.Task | None = None
        self._stream = None

    async def open(self) -> None:
        session = await self.client.create_session(**self.config)
        self.session_id = session.id
        self._stream = session.stream(self._source())
        self._reader = asyncio.create_task(self._read())
        await asyncio.wait_for(self._asked.wait(), OPEN_TIMEOUT_S)

    async def _source(self):
        while True:
            self._asked.set()
            yield await self._chunks.get()

    async def _read(self) -> None:
        try:
            async for unit in self._stream:
                await self._units.put(unit)
        except Exception as exc:  # handed to the waiting benchmark, which raises it
            await self._units.put(exc)

    def send(self, chunk: Any) -> None:
        """Latents (B, C, t, H, W), or a dict with ``latents`` and ``prompt`` (the library's ``Chunk`` fields)."""
        self._chunks.put_nowait(chunk)

    async def until(self, frame_end: int) -> Unit:
        """The first unit that reaches ``frame_end``."""
        while True:
            unit = await asyncio.wait_for(self._units.get(), UNIT_TIMEOUT_S)
            if isinstance(unit, BaseException):
                raise unit
            if unit.frame_end >= frame_end:
                return unit

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self.client.aclose()


class ClosedLoop:
    """The same over the sync ``Client`` (its stream runs on a reader thread)."""

    def __init__(self, base_url: str, config: dict[str, Any]):
        self.client = Client(base_url, timeout=UNIT_TIMEOUT_S)
        self.config = config
        self.session_id: str | None = None
        self._chunks: queue.Queue = queue.Queue()
        self._units: queue.Queue = queue.Queue()
        self._asked = threading.Event()
        self._reader: threading.Thread | None = None
        self._stream = None

    def open(self) -> None:
        session = self.client.create_session(**self.config)
        self.session_id = session.id
        self._stream = session.stream(self._source())
        self._reader = threading.Thread(target=self._read, name="closed-loop-reader", daemon=True)
        self._reader.start()
        if not self._asked.wait(OPEN_TIMEOUT_S):
            raise TimeoutError(f"the stream of session {session.id} did not open in {OPEN_TIMEOUT_S:.0f} s")

    def _source(self):
        while True:
            self._asked.set()
            item = self._chunks.get()
            if item is None:  # close(): the library's feed thread is released
                return
            yield item

    def _read(self) -> None:
        try:
            for unit in self._stream:
                self._units.put(unit)
        except Exception as exc:
            self._units.put(exc)

    def send(self, chunk: Any) -> None:
        self._chunks.put(chunk)

    def until(self, frame_end: int) -> Unit:
        while True:
            unit = self._units.get(timeout=UNIT_TIMEOUT_S)
            if isinstance(unit, BaseException):
                raise unit
            if unit.frame_end >= frame_end:
                return unit

    def close(self) -> None:
        self._chunks.put(None)
        if self._reader is not None:
            self._reader.join(UNIT_TIMEOUT_S)
        self.client.close()
