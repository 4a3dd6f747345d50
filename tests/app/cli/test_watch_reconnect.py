"""``python -m app watch`` across a drain of the session's replica: the stream closes with 1012 (session saved), the
watch connects again (behind a router, to the replica that adopts the session) instead of exiting 2 with the
stream's "reconnect with ?resume_from=" hint, which the command has no way to follow."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.cli import watch
from wm_refiner_client import TransportError
from wm_refiner_client.errors import ServiceUnavailableError


def _closed(code: int) -> TransportError:
    """What the client's watch raises when the server closes it before the flush."""
    return TransportError("the watch ended before the session's flush", close_code=code)


class FakeWatch:
    """What ``Session.watch`` returns: its events, then ``frames`` (the done event's count) once they ended."""

    def __init__(self, events, end, frames):
        self.events, self.end, self.frames = events, end, None
        self._frames = frames

    def __iter__(self):
        yield from self.events
        if self.end is not None:
            raise self.end
        self.frames = self._frames

    def close(self):
        pass


class FakeSession:
    def __init__(self, runs, states):
        self.runs, self.states, self.watches = list(runs), list(states), 0

    def watch(self, outputs, video_format=None, resume_from=None):
        self.watches += 1
        events, end = self.runs.pop(0)
        return FakeWatch(events, end, frames=3)

    def state(self):
        outcome = self.states.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_a_drain_1012_reconnects_and_the_watch_goes_on(monkeypatch, capsys):
    monkeypatch.setattr("time.sleep", lambda s: None)
    session = FakeSession([(["a"], _closed(1012)), (["b", "c"], None)],
                          [ServiceUnavailableError("draining", status=503),
                           SimpleNamespace(frames_returned=1, flushed=False)])
    assert list(watch._follow(session, None, None)) == ["a", watch.Rejoined(1, False), "b", "c", watch.Finished(3)]
    assert session.watches == 2
    assert "restarting (close 1012)" in capsys.readouterr().err


def test_other_closes_and_a_session_that_never_comes_back_still_fail(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    with pytest.raises(TransportError):
        list(watch._follow(FakeSession([(["a"], _closed(1011))], []), None, None))
    gone = FakeSession([([], _closed(1012))], [ServiceUnavailableError("down", status=503)] * 3)
    with pytest.raises(ServiceUnavailableError):
        list(watch._follow(gone, None, None, reconnect_for_s=-1))
