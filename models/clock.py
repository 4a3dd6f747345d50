"""How long model calls take, on the device's own clock, without making the caller wait for the device.

On a CPU a call's kernels run while it is issued, so wall time around it is its cost. On CUDA the call only
*queues* kernels: wall time around it measures launches (a few ms), not the GPU's work (tens to hundreds of ms),
so a cost model fed with it over-admits. ``CallClock`` brackets a call with two CUDA events recorded on the
device's current stream (``start`` before it is issued, ``stop`` after) and reads their elapsed time only once
the end event has passed (``event.query()``, which never blocks): ``finished()``, called whenever convenient (the
engine calls it in every commit), hands back the calls measured so far, in issue order. The engine thread never
synchronizes with the GPU for a figure; a figure arrives one or a few calls late, which is what the EWMA of the
real-time cost model and a histogram want anyway.

Decisions:
- A call's GPU time is the span between its two events on the stream: if the host issues kernels slower than the
  GPU runs them (launch-bound), that includes the gaps, which is right: it is how long the call held the stream.
- At most ``max_pending`` calls wait for their events (default 64): past that the oldest is dropped unmeasured
  (``dropped`` counts them), so a GPU that falls far behind cannot make the clock grow without bound.
- ``event_factory`` makes the clock testable on a CPU: a fake event with ``record``/``query``/``elapsed_time``
  drives the same CUDA code path (``tests/models/test_clock.py``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Mark:
    """One call being timed: its start (a ``perf_counter`` reading on the CPU, an event on CUDA)."""

    start: Any
    tag: Any = None
    end: Any = None


class CallClock:
    """Start/stop marks around model calls; ``finished()`` returns ``(tag, seconds)`` for every call whose time is
    known, oldest first (on the CPU, at once; on CUDA, once its end event has passed)."""

    def __init__(self, device: torch.device | str = "cpu", max_pending: int = 64,
                 event_factory: Callable[[], Any] | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" or event_factory is not None
        self.max_pending = max_pending
        self.dropped = 0
        self._pending: deque[Mark] = deque()
        self._done: list[tuple[Any, float]] = []
        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))

    def _record(self):
        event = self._event()
        if self.device.type == "cuda":
            event.record(torch.cuda.current_stream(self.device))
        else:  # a fake event (tests)
            event.record()
        return event

    def start(self, tag: Any = None) -> Mark:
        """Mark the start of a call, before it is issued."""
        return Mark(self._record() if self.cuda else time.perf_counter(), tag)

    def stop(self, mark: Mark) -> float | None:
        """Mark its end, after it was issued. Returns its seconds when known now (CPU), else None (CUDA: see
        ``finished``)."""
        if not self.cuda:
            seconds = time.perf_counter() - mark.start
            self._done.append((mark.tag, seconds))
            return seconds
        mark.end = self._record()
        self._pending.append(mark)
        while len(self._pending) > self.max_pending:
            self._pending.popleft()
            self.dropped += 1
        return None

    def finished(self) -> list[tuple[Any, float]]:
        """Every call measured since the last read, oldest first. Never waits: a CUDA call whose end event has not
        passed stays pending (and so do the ones after it, which the stream runs later)."""
        while self._pending and self._pending[0].end.query():
            mark = self._pending.popleft()
            self._done.append((mark.tag, mark.start.elapsed_time(mark.end) / 1000.0))  # elapsed_time is in ms
        done, self._done = self._done, []
        return done

    @property
    def pending(self) -> int:
        return len(self._pending)

    def wait(self) -> list[tuple[Any, float]]:
        """Every call's time, waiting for the device (benchmarks and tests; never the engine's hot path)."""
        if self._pending:
            self._pending[-1].end.synchronize()
        return self.finished()
