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


def test_a_staged_park_copies_into_the_buffers_staged_off_the_engine_thread(fake_cuda, monkeypatch):
    """``stage_host`` page-locks a park's host buffers on a worker thread (one per CUDA tensor the session holds, of
    its shape and dtype); the move then locks nothing itself and copies into those. A tensor staged for is matched
    by identity, and a buffer that no longer fits (shape changed) is not used."""
    locked = []

    def host_buffer(shape, dtype):
        locked.append(tuple(shape))
        buffer = torch.empty(shape, dtype=dtype)
        buffer.copy_ = lambda source, non_blocking=False: None  # the D2H copy, queued
        return buffer

    monkeypatch.setattr(move_module, "pinned_empty", host_buffer)
    bound = []
    monkeypatch.setattr(move_module, "use_device", bound.append)

    def on_device(shape):
        return SimpleNamespace(device=torch.device("cuda", 0), shape=torch.Size(shape), dtype=torch.bfloat16,
                               record_stream=lambda stream: None)

    window, sink, pending = on_device((2, 4, 8)), on_device((1, 4)), on_device((1, 3))
    session = SimpleNamespace(kv=SimpleNamespace(window=window, sink_key=sink, history_key=None),
                              state=SimpleNamespace(prompt=None, pending=pending))
    staged = move_module.stage_host(session, torch.device("cpu"))
    assert sorted(locked) == [(1, 3), (1, 4), (2, 4, 8)] and bound == [torch.device("cuda", 0)]
    assert set(staged) == {id(window), id(sink), id(pending)}
    locked.clear()
    with Move(torch.device("cpu"), host=staged) as move:
        assert move(window) is staged[id(window)] and move(sink) is staged[id(sink)]
        wider = on_device((2, 3))
        staged_wrong = {id(wider): torch.empty(5)}
    assert locked == []  # nothing locked by the move itself
    with Move(torch.device("cpu"), host=staged_wrong) as move:
        assert move(wider).shape == (2, 3)  # the misfit was not used: locked here instead
    assert locked == [(2, 3)]
    # Without CUDA anywhere nothing is staged.
    on_host = SimpleNamespace(kv=None, state=SimpleNamespace(prompt=None, pending=torch.zeros(2)))
    assert move_module.stage_host(on_host, torch.device("cpu")) == {}


def test_an_exact_size_buffer_is_unlocked_off_the_thread_that_frees_it_and_freed_only_after(monkeypatch):
    """``pinned_empty`` from ``EXACT_PIN_BYTES`` up: its bytes registered exactly once; when the caller's tensor is
    dropped (here on this thread, in the service the engine's), the unregistration runs on the unlocking thread, and
    the memory is still held until it has (a stub stands in for the CUDA runtime: no CUDA here)."""
    import threading

    import models.transfer as transfer

    calls = []
    runtime = SimpleNamespace(
        cudaHostRegister=lambda pointer, size, flags: calls.append(("register", pointer, size, flags)) or 0,
        cudaHostUnregister=lambda pointer: calls.append(("unregister", pointer, threading.current_thread().name)) or 0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    real_unregister = transfer._unregister

    def unregister(base, pointer):
        calls.append(("base alive", base.data_ptr() == pointer))
        real_unregister(base, pointer)

    monkeypatch.setattr(transfer, "_unregister", unregister)
    count = transfer.EXACT_PIN_BYTES // 4 + 1024
    buffer = transfer.pinned_empty((count,), torch.float32)
    pointer = buffer.data_ptr()
    assert buffer.shape == (count,) and calls == [("register", pointer, count * 4, 1)]
    del buffer
    transfer._unlocker.submit(lambda: None).result(timeout=30)
    assert calls[1:] == [("base alive", True), ("unregister", pointer, calls[2][2])]
    assert calls[2][2].startswith("wm-unpin") and calls[2][2] != threading.current_thread().name
