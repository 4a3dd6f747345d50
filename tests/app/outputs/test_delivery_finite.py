"""The finite check read off the engine thread (issue 22): on an accelerator a committed unit carries its finite
flag unread (``models.session.FiniteCheck``), and ``app.outputs.delivery.UnitCopies`` reads it with the unit's host copy,
failing with the error a CPU session's commit raises for the same block. The engine reads the same late verdict
before the session's next forward and undoes the block (``app.engine.worker``, late verdicts): run here on the CPU with
``RefinerSession.defer_finite_check``, which takes the accelerator's path exactly."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from app.core.metrics import Metrics
from app.engine.worker import Engine, EngineSession, Work
from app.outputs.delivery import UnitCopies
from app.outputs.catalog import build_stages
from app.outputs.kinds import Outputs
from app.outputs.stage import OutUnit
from models import RefinerSession, SessionConfig, from_model
from models.checkpoints import build_model, build_vae
from models.vae import StreamingDecoder
from models.errors import NonFiniteOutputError
from models.step import run_batch
from tests.models.conftest import make_inputs


def _run_block(session: RefinerSession, latents: torch.Tensor, embeds: torch.Tensor | None = None):
    """One block the engine's way (check, append, plan, start, forwards), not committed."""
    session.append(session.check(latents, embeds))
    run = session.start(session.plan())
    while (forward := session.next_forward(run)) is not None:
        session.advance(run, run_batch(session.refiner.model, [forward])[0])
    return run


def _out_unit(run, check) -> OutUnit:
    plan = run.plan
    return OutUnit(plan.kind, run.x, plan.start, plan.end, 0.0, {"latents": run.x}, (plan.end,), check)


@pytest.mark.parametrize("poisoned", [True, False])
def test_unit_copies_read_the_finite_flag_and_fail_as_the_commit_does(poisoned):
    refiner = from_model(build_model("tiny"))
    latents, embeds = make_inputs(frames=4, seed=3)
    session = RefinerSession(refiner, SessionConfig(block_size=3))
    session.push(latents[:, :, :1], embeds)  # the sink
    block = latents[:, :, 1:4].clone()
    if poisoned:
        block[:, :, :, 0, 0] = 3e38  # finite, overflows in the model
    run = _run_block(session, block)
    check = session._finite_check(run)  # what an accelerator session hands on with the unit, unread

    copies = UnitCopies(_out_unit(run, check), build_stages())
    if not poisoned:
        host = copies.wait()
        assert torch.equal(host.payloads["latents"], run.x)
        assert session.commit(run).check is None  # on a CPU the commit read it: nothing left for delivery
        return
    with pytest.raises(NonFiniteOutputError) as late:
        copies.wait()
    with pytest.raises(NonFiniteOutputError) as at_commit:
        session.commit(run)  # a CPU session refuses the block at commit, with the same words
    assert str(late.value) == str(at_commit.value)
    assert "NaN or Inf" in str(late.value) and "3e+38" in str(late.value)
    with pytest.raises(NonFiniteOutputError):
        copies.wait()  # every reader of the unit gets the error, not the bytes


# --- late verdicts undone by the engine --------------------------------------------------------------------------
CONFIG = dict(block_size=3, kv_max_frames=5)  # 4 history frames: the poisoned block's commit drops 3 of them


class Poison:
    """A forward hook on the model's output projection: while armed, every forward's velocity is NaN, so the block
    refines to NaN and its commit forward writes NaN K/V into the session's cache."""

    def __init__(self, model):
        self.armed = False
        self._handle = model.proj_out.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        return output * float("nan") if self.armed else None

    def close(self):
        self._handle.remove()


def _snapshot(session: RefinerSession):
    """Everything a later block reads of the session: its state and its cache's live K/V (cloned)."""
    kv = session.kv
    tensors = {name: [t.clone() for t in parts] for name, parts in kv.export().items()}
    return session.state, (kv.has_sink, kv.history_frames, kv.rollback_open), tensors


def _assert_same(before, after):
    (state_a, counters_a, kv_a), (state_b, counters_b, kv_b) = before, after
    for field in dataclasses.fields(state_a):
        a, b = getattr(state_a, field.name), getattr(state_b, field.name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), field.name  # bits
        elif field.name == "prompt":
            assert torch.equal(a.embeds, b.embeds) and (a.mask is None) == (b.mask is None)
        else:
            assert a == b, field.name
    assert counters_a == counters_b
    for name in kv_a:
        assert all(torch.equal(x, y) for x, y in zip(kv_a[name], kv_b[name], strict=True)), name


def _run_poisoned(deferred: bool | None, atomic: bool, device: str = "cpu", video: bool = False):
    """Sink and two blocks, then a block refined with the poison armed, then its retry without. Returns what the
    scenario saw: the error, the session before and after the failed block, units, hand-over observations.
    ``deferred``: ``RefinerSession.defer_finite_check`` (None: the device's default); ``video``: the session's
    units also go through the video stage (a deferred output step with a streaming decoder's state)."""
    refiner = from_model(build_model("tiny"), device=device)
    latents, embeds = make_inputs(frames=10, seed=3)
    poison = Poison(refiner.model)
    session = RefinerSession(refiner, SessionConfig(**CONFIG))
    session.defer_finite_check = deferred
    target = EngineSession(session=session, name="poisoned")
    if video:
        decoder = StreamingDecoder(build_vae("tiny-vae"))
        target.stages = build_stages(decoder=decoder).for_session(Outputs(("latents", "video")), session.config)
    handed: list = []  # (frame_start, whether the cache held NaN when the unit was handed on), engine thread

    def on_unit(unit):
        poisoned = any(not torch.isfinite(t).all() for t in session.kv.export()["history_value"])
        handed.append((unit.frame_start, poisoned))

    def work(frames, **options):
        return Work(target, frames, **options, atomic=atomic, on_unit=None if atomic else on_unit)

    async def scenario(engine):
        first = await engine.run(work(latents[:, :, :7], prompt_embeds=embeds))
        before = await engine.call(lambda: _snapshot(session))
        poison.armed = True
        failed = work(latents[:, :, 7:10])
        with pytest.raises(NonFiniteOutputError) as error:
            await engine.run(failed)
        poison.armed = False
        after = await engine.call(lambda: _snapshot(session))
        retry = await engine.run(work(latents[:, :, 7:10]))
        return first, before, failed, str(error.value), after, retry

    engine = Engine(Metrics(), 8, 4)
    engine.model = refiner.model
    engine.start()
    try:
        first, before, failed, error, after, retry = asyncio.run(asyncio.wait_for(scenario(engine), 120))
    finally:
        engine.stop()
        poison.close()
    kept = (*first.units, *retry.units)
    units = torch.cat([unit.latents for unit in kept], dim=2).cpu()
    frames = [u.payloads["video"].frames for u in kept if video and u.payloads["video"].frames is not None]
    expected = RefinerSession(refiner, SessionConfig(**CONFIG)).push(latents, embeds)
    return dict(error=error, before=before, after=after, failed=failed, units=units, handed=handed,
                video=torch.cat(frames, dim=2).cpu() if frames else None,
                expected=torch.cat([unit.latents for unit in expected], dim=2).cpu())


@pytest.mark.parametrize("atomic, video", [(True, False), (False, False), (False, True)],
                         ids=["http_chunk", "stream_message", "stream_message_video"])
def test_a_late_non_finite_verdict_rolls_the_session_back_before_its_next_forward(atomic, video):
    """The accelerator's path on the CPU: the poisoned block is committed (its K/V in the cache when its unit is
    handed on), its verdict read by the engine afterwards; the work fails with the CPU path's error, the session
    is bit for bit as before the block, and the retry refines what an untroubled session refines. With video, the
    decoder's state is undone too: the pixel frames equal those of the path that never committed the block."""
    late = _run_poisoned(deferred=True, atomic=atomic, video=video)
    at_commit = _run_poisoned(deferred=False, atomic=atomic, video=video)

    assert late["error"] == at_commit["error"]  # what the client reads, on either path
    assert "NaN or Inf" in late["error"]
    _assert_same(late["before"], late["after"])
    _assert_same(at_commit["before"], at_commit["after"])
    expected = late["expected"]  # the same solo shapes on every path: bits
    assert torch.equal(late["units"], expected) and torch.equal(at_commit["units"], expected)
    if video:
        assert late["video"] is not None and torch.equal(late["video"], at_commit["video"])
    failed = late["failed"]
    assert failed.units == []
    if atomic:
        return
    # The deferred path really committed the NaN block (and so had something to undo): its unit was handed on
    # with NaN K/V in the cache; delivery is told to forget it. The CPU path never committed it.
    assert (7, True) in late["handed"] and [u.frame_start for u in failed.withdrawn] == [7]
    assert all(not poisoned for _, poisoned in at_commit["handed"]) and at_commit["failed"].withdrawn == []
    assert failed.rolled_back and "this message was not taken" in late["error"]


@pytest.mark.parametrize("case", ["http_chunk", "stream_message", "stream_pending_frames"])
def test_the_services_non_finite_cases_hold_with_late_verdicts(case, monkeypatch, make_settings, refiner):
    """The service's own non-finite tests (HTTP chunk, stream message, frames pending from an earlier message),
    with every session of the app deferring its verdict as on an accelerator: same 422 texts, the session's JSON
    unchanged, the retry's bytes those of an untroubled session (delivery forgot the undone unit)."""
    from tests.app.api import test_hardening, test_hardening_ws

    monkeypatch.setattr(RefinerSession, "defer_finite_check", True)
    {
        "http_chunk": test_hardening.test_a_chunk_that_refines_to_non_finite_values_is_refused_and_the_session_is_unchanged,
        "stream_message": test_hardening_ws.test_a_stream_message_that_refines_to_non_finite_values_is_refused_and_rolled_back,
        "stream_pending_frames": test_hardening_ws.test_poisoned_frames_pending_from_an_earlier_message_are_dropped_not_kept,
    }[case](make_settings, refiner)


def test_an_undone_block_whose_output_step_has_not_run_leaves_the_queue_with_the_others():
    """A deferred stage (video) may not have taken the undone block yet: its entry leaves the session's output queue
    (found by identity; units compare by value and their tensors have no truth value), earlier ones stay."""
    from app.engine.worker import PendingVerdict
    from models.session import Unit

    refiner = from_model(build_model("tiny"))
    engine = Engine(Metrics(), 8, 4)
    target = EngineSession(session=RefinerSession(refiner, SessionConfig()), name="queued")
    latents = torch.zeros(1, 128, 3, 2, 2)
    checks = [object(), object()]  # stand-ins: only their identity matters here
    earlier, undone = (Unit("block", latents.clone(), 1 + 3 * i, 4 + 3 * i, 0.0, check) for i, check in enumerate(checks))
    target.pending_outputs.extend([(earlier, False), (undone, False)])
    engine.scheduler.output_pending(target)
    engine._withdraw(target, PendingVerdict(checks[1], None))
    assert list(target.pending_outputs) == [(earlier, False)] and target.pending_outputs[0][0] is earlier
