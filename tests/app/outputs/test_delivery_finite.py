"""The finite check read off the engine thread (issue 22): on an accelerator a committed unit carries its finite
flag unread (``models.session.FiniteCheck``), and ``app.outputs.delivery.UnitCopies`` reads it with the unit's host copy,
failing with the error a CPU session's commit raises for the same block."""

from __future__ import annotations

import pytest
import torch

from app.outputs.delivery import UnitCopies
from app.outputs.catalog import build_stages
from app.outputs.stage import OutUnit
from models import RefinerSession, SessionConfig, from_model
from models.checkpoints import build_model
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
