"""The model-call clock (models.clock) and the thread's device (models.transfer.use_device), on the CPU: the CPU
path with the real clock, the CUDA path with fake events that pass when the test says so (the same code runs with
CUDA events)."""

from __future__ import annotations

import time

import pytest
import torch

from models import transfer
from models.clock import CallClock


class FakeEvent:
    """A CUDA event's surface: ``record``, ``query`` (True once the test completes it), ``elapsed_time`` in ms."""

    def __init__(self, log):
        self.log = log
        self.at = None
        self.done = False

    def record(self, stream=None):
        self.at = len(self.log)
        self.log.append(self)

    def query(self):
        return self.done

    def synchronize(self):
        for event in self.log[: self.at + 1]:
            event.done = True

    def elapsed_time(self, end):
        assert self.done and end.done, "elapsed_time read before both events passed (would sync or raise on CUDA)"
        return 1000.0 * (end.at - self.at)  # one "second" per event recorded in between


def test_cpu_clock_measures_wall_time_at_once():
    clock = CallClock("cpu")
    mark = clock.start("call")
    time.sleep(0.02)
    seconds = clock.stop(mark)
    assert seconds >= 0.02
    assert clock.finished() == [("call", seconds)]
    assert clock.finished() == []


def test_cuda_path_reads_events_only_once_they_passed():
    log = []
    clock = CallClock("cpu", event_factory=lambda: FakeEvent(log))
    first = clock.start("a")
    assert clock.stop(first) is None  # unknown until the device got there
    second = clock.start("b")
    clock.stop(second)
    assert clock.finished() == [] and clock.pending == 2
    first.start.done = first.end.done = True
    second.start.done = True  # its end has not passed yet
    assert clock.finished() == [("a", 1.0)]
    assert clock.pending == 1
    second.end.done = True
    assert clock.finished() == [("b", 1.0)]


def test_later_calls_wait_behind_an_unfinished_one_in_stream_order():
    log = []
    clock = CallClock("cpu", event_factory=lambda: FakeEvent(log))
    first, second = clock.start(1), None
    clock.stop(first)
    second = clock.start(2)
    clock.stop(second)
    second.start.done = second.end.done = True  # cannot happen on one stream, but the clock must not reorder
    assert clock.finished() == []
    assert [tag for tag, _ in clock.wait()] == [1, 2]


def test_pending_calls_are_bounded():
    log = []
    clock = CallClock("cpu", max_pending=3, event_factory=lambda: FakeEvent(log))
    for tag in range(5):
        clock.stop(clock.start(tag))
    assert clock.pending == 3 and clock.dropped == 2
    assert [tag for tag, _ in clock.wait()] == [2, 3, 4]


def test_use_device_sets_the_thread_device_only_for_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(torch.device(device)))
    transfer.use_device("cpu")
    assert calls == []
    transfer.use_device("cuda:1")
    assert calls == [torch.device("cuda", 1)]
