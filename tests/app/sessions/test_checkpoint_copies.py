"""A crash checkpoint's copy of its session (``app.sessions.checkpoints``): its host buffers staged on a worker thread,
its copies only queued by the engine thread, the writer and the session's next forward both waiting for them, and
the file holding the session as it was then while the session refines on. On CUDA the copies run on a side stream
(``models.snapshot.copy_session``, checked on a GPU by ``tests/gpu/test_cuda.py``); here a CPU session's one clone
has nothing in flight, so the event they complete with is stood in for, with torch.cuda's current stream (the order
is what is tested, not CUDA), as ``test_saving.py`` does for a page-in."""

from __future__ import annotations

import logging
import threading

import torch
from safetensors.torch import load_file

import app.engine.worker as worker_module
import app.sessions.checkpoints as checkpoints_module
from app.core.metrics import Metrics
from app.engine.worker import Engine, EngineSession, PendingVerdict
from app.persistence.records import snapshot_path
from models import RefinerSession, SessionConfig, from_model
from models.checkpoints import build_model
from models.snapshot import session_to_tensors
from models.transfer import HostMemoryError

from tests.app.conftest import DEADLINE_S, OCTET, make_clip, payload, running_app, wait_until
from tests.models.conftest import make_inputs

LATENTS, EMBEDS, MASK = make_clip(frames=10, seed=41)
FIRST, SECOND = LATENTS[:, :, :5], LATENTS[:, :, 5:]
# A history of 3 frames at most: the second chunk's commits shift it left in place, over what the first copied.
CONFIG = {"block_size": 2, "kv_max_frames": 4}


class _Copies:
    """Stands for the CUDA event a checkpoint's side-stream copies complete with."""


class _Stream:
    """Stands for torch.cuda's current stream: notes each wait for a checkpoint's copies."""

    def __init__(self, note):
        self.note = note

    def wait_event(self, event):
        if isinstance(event, _Copies):
            self.note("compute stream waits")


def _send(client, sid: str, seq: int, body: bytes) -> None:
    reply = client.post(f"/v1/sessions/{sid}/chunks?seq={seq}", content=body, headers=OCTET)
    assert reply.status_code == 200, reply.text


def test_a_checkpoints_copies_are_waited_for_by_its_writer_and_by_its_sessions_next_forward(make_settings, tmp_path,
                                                                                          monkeypatch):
    """Locking the buffers (seconds for a 720p session) happens on a worker thread before the engine's turn; the
    engine thread only queues the copies and hands on the event they complete with; the writer waits for that
    event before it reads the bytes, and the session's next model call is queued only after the compute stream was
    told to wait for it (its cache is written in place), so neither reads nor overwrites bytes still in flight."""
    order = []

    def note(what: str) -> None:
        order.append((what, threading.current_thread().name))

    class Copies(_Copies):
        def synchronize(self):
            note("writer waits")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(note))
    real_stage, real_copy, real_write = (checkpoints_module.stage_copy, checkpoints_module.record_copy,
                                         checkpoints_module.write_fenced)
    real_run = worker_module.run_isolated

    def record_copy(record, host, after=None):
        tensors, metadata, ready = real_copy(record, host, after)
        assert ready is None and host == {}, "a CPU session: nothing staged, cloned at once"
        note("copies queued")
        return tensors, metadata, Copies()

    monkeypatch.setattr(checkpoints_module, "stage_copy", lambda session: note("staged") or real_stage(session))
    monkeypatch.setattr(checkpoints_module, "record_copy", record_copy)
    monkeypatch.setattr(checkpoints_module, "write_fenced", lambda *a, **k: note("written") or real_write(*a, **k))
    monkeypatch.setattr(worker_module, "run_isolated", lambda *a, **k: note("model call") or real_run(*a, **k))
    with running_app(make_settings(snapshot_dir=tmp_path / "snaps", checkpoint_every_blocks=1)) as client:
        sid = client.post("/v1/sessions", json=CONFIG).json()["session_id"]
        handle = client.app.state.services.registry.existing(sid)
        _send(client, sid, 0, payload(FIRST, EMBEDS, MASK))
        wait_until(lambda: any(what == "written" for what, _ in order), "the first checkpoint's file")
        first_checkpoint = len(order)
        _send(client, sid, 1, payload(SECOND))
        wait_until(lambda: handle.checkpoint_write is not None and handle.checkpoint_write.done(), "the checkpoints")

    staged = next(i for i, (what, _) in enumerate(order) if what == "staged")
    queued = order.index(("copies queued", "refiner-engine"))
    assert staged < queued and order[staged][1] not in ("refiner-engine", "MainThread"), order
    waits = [i for i, (what, _) in enumerate(order) if what == "writer waits"]
    assert waits, f"the writer never waited for the copies: {order}"
    waits, written = waits[0], next(i for i, (what, _) in enumerate(order) if what == "written")
    assert queued < waits < written and order[waits][1] == order[written][1] != "refiner-engine", order
    after = order[first_checkpoint:]
    next_call = next(i for i, (what, _) in enumerate(after) if what == "model call")
    assert ("compute stream waits", "refiner-engine") in after[:next_call], order


def test_a_checkpoint_holds_its_session_as_it_was_while_the_session_refines_on(make_settings, tmp_path, monkeypatch):
    """The writer of the first chunk's checkpoint is held until the second chunk has refined (its commits shift the
    history over the frames the first copied): the file holds the session exactly as it was when the engine thread
    queued its copy, none of it shared with the session that went on."""
    at_copy, gate, held = {}, threading.Event(), threading.Event()
    real_copy, real_write = checkpoints_module.record_copy, checkpoints_module.write_fenced

    def record_copy(record, host, after=None):
        if not at_copy:
            at_copy.update(session_to_tensors(record.session, own=True)[0])
        return real_copy(record, host, after)

    def write_fenced(*args, **kwargs):
        if not held.is_set():
            held.set()
            gate.wait(DEADLINE_S)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(checkpoints_module, "record_copy", record_copy)
    monkeypatch.setattr(checkpoints_module, "write_fenced", write_fenced)
    folder = tmp_path / "snaps"
    with running_app(make_settings(snapshot_dir=folder, checkpoint_every_blocks=1)) as client:
        sid = client.post("/v1/sessions", json=CONFIG).json()["session_id"]
        handle = client.app.state.services.registry.existing(sid)
        _send(client, sid, 0, payload(FIRST, EMBEDS, MASK))
        assert held.wait(DEADLINE_S), "the first checkpoint's writer"
        _send(client, sid, 1, payload(SECOND))
        now = {name: tensor.clone() for name, tensor in session_to_tensors(handle.session)[0].items()}
        gate.set()
        wait_until(lambda: handle.checkpoint_write.done(), "the first checkpoint's file")
        saved = load_file(snapshot_path(folder, sid))
    history = [name for name in at_copy if name.startswith("history.")]
    assert history and any(not torch.equal(at_copy[name], now[name]) for name in history), "the cache did not move"
    assert all(torch.equal(saved[name], tensor) for name, tensor in at_copy.items()), "the file is not the session then"


def test_a_checkpoint_without_pinned_memory_is_still_written(make_settings, tmp_path, monkeypatch, caplog):
    """Host memory that cannot be locked (``ulimit -l``, a container's memlock) does not cost the checkpoint: the
    session is copied into plain memory as before staging existed (on CUDA that copy waits for the device), and the
    log says why and what it costs."""

    def refused(session):
        raise HostMemoryError("cudaHostRegister of 1024 bytes failed with CUDA error 1 (host memory locked past the "
                              "limit? check `ulimit -l` and the container's memlock)")

    monkeypatch.setattr(checkpoints_module, "stage_copy", refused)
    folder = tmp_path / "snaps"
    with caplog.at_level(logging.WARNING, logger="app"):
        with running_app(make_settings(snapshot_dir=folder, checkpoint_every_blocks=1)) as client:
            sid = client.post("/v1/sessions", json=CONFIG).json()["session_id"]
            handle = client.app.state.services.registry.existing(sid)
            _send(client, sid, 0, payload(FIRST, EMBEDS, MASK))
            wait_until(lambda: handle.checkpoint_write is not None and handle.checkpoint_write.done(),
                       "the checkpoint")
            expected = session_to_tensors(handle.session)[0]
            saved = load_file(snapshot_path(folder, sid))
    assert all(torch.equal(saved[name], tensor) for name, tensor in expected.items())
    assert any("without pinned memory" in r.getMessage() and "ulimit -l" in r.getMessage() for r in caplog.records)


def test_undoing_a_late_non_finite_block_waits_for_a_checkpoints_copies_first(monkeypatch):
    """A drain fails the session's queued work before any forward of it ran (``_fail_everything``), reading its last
    block's verdict: NaN/Inf rolls the cache back in place, so the compute stream must first wait for a checkpoint's
    copies of that cache still in flight, or the file would hold bytes of both moments."""
    order = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(order.append))
    session = RefinerSession(from_model(build_model("tiny")), SessionConfig(block_size=2))
    latents, embeds = make_inputs(frames=3, seed=5)
    session.push(latents, embeds)
    target = EngineSession(session=session, name="checkpointed")
    before = session.checkpoint()
    real_rollback = session.rollback
    monkeypatch.setattr(session, "rollback", lambda mark: order.append("rollback") or real_rollback(mark))
    target.ready = _Copies()  # what the checkpoint left for the session's next work
    Engine(Metrics(), 8, 4)._withdraw(target, PendingVerdict(object(), before))
    assert order == ["compute stream waits", "rollback"] and target.ready is None
