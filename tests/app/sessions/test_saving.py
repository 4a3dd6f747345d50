"""``app.sessions.saving.record_of``: the record of a session paged in on a side stream is read only after those
copies (a stub stands in for torch.cuda's current stream: the order is what is tested, not CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import app.sessions.saving as saving
from app.engine.worker import EngineSession


def test_a_record_of_a_paged_in_session_waits_for_its_copies_first(monkeypatch):
    """A checkpoint, spill or drain that reads a session paged in a moment ago (no work of it ran yet, so nothing
    waited for the page-in's side stream) makes the engine's stream wait for the page-in's event before the
    record's device-to-host reads are queued on it."""
    order = []

    class StubStream:
        def wait_event(self, event):
            order.append(("wait", event))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: StubStream())
    monkeypatch.setattr(saving, "SessionRecord", lambda *args, **kwargs: order.append(("record", None)) or "record")
    engine_session = EngineSession(session=None)
    engine_session.ready = event = object()
    chunks = SimpleNamespace(next_seq=1, last_seq=0, last_request=None, stored_response=lambda: None)
    handle = SimpleNamespace(id="s", session=None, chunks=chunks, retained=[], streaming=False, detached=False,
                             engine_session=engine_session, outputs=None, created_at=0.0)
    build = saving.record_of(handle, encoder=None)
    assert build() == "record"
    assert order == [("wait", event), ("record", None)] and engine_session.ready is None
