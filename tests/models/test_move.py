"""``models.move.Move``'s stream logic, on a CPU: stubs stand in for torch.cuda's streams and events (and for a
device tensor), so what is tested is which stream waits for what and which host buffers are kept alive until a
copy's event has passed, not CUDA itself (``tests/gpu/test_cuda.py`` runs the real copies)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import models.move as move_module
from models.move import Move, release_finished


class StubEvent:
    def __init__(self, log, done=False):
        self.log, self.done = log, done

    def record(self, stream):
        self.log.append(("record", stream.name))

    def query(self):
        return self.done


class StubStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "wait_event", event))


class StubContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.fixture
def fake_cuda(monkeypatch):
    log: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: StubStream(log, "compute"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: StubStream(log, "side"))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: StubContext())
    monkeypatch.setattr(torch.cuda, "Event", lambda: StubEvent(log))
    # The host buffer a park copies into: plain memory here (no CUDA to pin it with).
    monkeypatch.setattr(move_module, "pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(move_module, "_in_flight", [])
    monkeypatch.setattr(move_module, "_side_streams", {})
    return log


def test_a_park_waits_for_the_compute_stream_and_for_the_page_in_before_it(fake_cuda):
    """A park right after a page-in (no work of the session ran between, so nothing waited for the page-in's side
    stream) reads the paged-in tensors only after those copies: its side stream waits for ``after`` too."""
    paged_in = object()
    with Move(torch.device("cpu"), after=paged_in):
        pass
    assert ("side", "wait_stream", "compute") in fake_cuda
    assert ("side", "wait_event", paged_in) in fake_cuda


def test_a_parks_host_buffers_stay_alive_until_its_copies_are_done(fake_cuda, monkeypatch):
    """The host buffers a park copies into are held with the copy's event (``_in_flight``), so a session deleted
    while its copies run does not free (and unregister) memory the copy still writes into; they are released once
    the event has passed."""
    recorded = []
    on_device = SimpleNamespace(device=torch.device("cuda", 0), shape=(2, 3), dtype=torch.float32,
                                record_stream=recorded.append)  # a device tensor's part in a park
    written = []

    def host_buffer(shape, dtype):
        buffer = torch.empty(shape, dtype=dtype)
        buffer.copy_ = lambda source, non_blocking=False: written.append(non_blocking)  # the D2H copy, queued
        return buffer

    monkeypatch.setattr(move_module, "pinned_empty", host_buffer)
    with Move(torch.device("cpu")) as move:
        host = move(on_device)
    assert written == [True] and [s.name for s in recorded] == ["side"]
    assert len(move_module._in_flight) == 1
    event, buffers = move_module._in_flight[0]
    assert event is move.ready and any(b is host for b in buffers)
    release_finished()
    assert len(move_module._in_flight) == 1  # the copy has not passed: still held
    event.done = True
    release_finished()
    assert move_module._in_flight == []


def test_parks_and_page_ins_each_keep_one_side_stream(fake_cuda):
    """The allocator pools blocks per stream: a new stream per move would strand each page-in's freed window in a
    pool the next page-in (on another stream) cannot reuse. One stream per device and direction, kept."""
    streams = []
    for device in ("cpu", "cuda:0", "cpu", "cuda:0"):
        with Move(torch.device(device), cuda_device=torch.device("cuda", 0)) as move:
            streams.append(move._stream)
    park, page_in = streams[0], streams[1]
    assert park is not page_in and streams[2] is park and streams[3] is page_in
