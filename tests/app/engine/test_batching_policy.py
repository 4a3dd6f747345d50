"""app.engine.batching alone: which classes of model call may hold several sessions, and which wait for their probe.
Plain bookkeeping, tested with a fake prober (the real probe is tested in tests/models/test_invariance.py and through
a server in tests/app/engine/test_batching_modes.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from app.engine.batching import BatchingPolicy, ProbeShape

SHAPE = ProbeShape(height=4, width=4, block_frames=3, prompt_tokens=8)
A, B = (48, "float32", "cpu"), (27, "float32", "cpu")


@dataclass
class Finding:
    ok: bool
    group: tuple | None

    def __str__(self) -> str:
        return "invariant" if self.ok else "NOT invariant"


def policy_with(verdicts: dict, mode="auto") -> tuple[BatchingPolicy, list]:
    """A policy whose prober answers ``verdicts[tokens]`` for a shape's class; returns it and the probes it ran."""
    policy, probed = BatchingPolicy(mode), []

    def prober(shape: ProbeShape):
        group = (shape.height * shape.width * shape.block_frames, "float32", "cpu")
        probed.append(group)
        return Finding(verdicts[group], group)

    policy.prober = prober
    return policy, probed


def test_modes_decide_before_any_probe():
    assert BatchingPolicy(True).allows(A) and not BatchingPolicy(False).allows(A)
    assert not BatchingPolicy("auto").allows(A), "auto batches nothing it has not probed"
    with pytest.raises(ValueError, match="batching"):
        BatchingPolicy("sometimes")


def test_a_class_is_pending_until_probed_then_batched_only_if_it_passed():
    policy, probed = policy_with({A: True, B: False})
    policy.saw(A, SHAPE)
    policy.saw(B, ProbeShape(3, 3, 3, 8))
    assert policy.pending and not policy.allows(A) and policy.invariant is None
    assert [c["probe"] for c in policy.describe()] == ["pending", "pending"]
    policy.probe_next()
    policy.probe_next()
    assert probed == [A, B] and not policy.pending
    assert policy.allows(A) and not policy.allows(B) and policy.invariant is False and policy.batching
    policy.saw(A, SHAPE)  # seen again: never probed twice
    assert not policy.pending and policy.first.group == A


def test_two_ready_sessions_of_a_pending_class_ask_for_its_probe_now():
    policy, _ = policy_with({A: True})
    policy.saw(A, SHAPE)
    assert policy.wants_probe([A, B]) is None, "one session of the class: batching would not pay yet"
    assert policy.wants_probe([A, B, A]) == A


def test_false_never_queues_and_true_probes_but_batches_anyway():
    off, _ = policy_with({A: False}, mode=False)
    off.saw(A, SHAPE)
    assert not off.pending and off.describe() == []
    on, probed = policy_with({A: False}, mode=True)
    on.saw(A, SHAPE)
    on.probe_next()
    assert probed == [A] and on.allows(A) and on.invariant is False


def test_a_verdict_for_another_class_or_a_broken_probe_never_batches_and_is_not_retried():
    policy, _ = policy_with({A: True})
    policy.saw(B, ProbeShape(3, 3, 3, 8))
    policy.prober = lambda shape: Finding(True, A)  # measured A, asked for B
    verdict = policy.probe_next()
    assert not verdict.ok and "not the class" in verdict.probe and not policy.allows(B)

    def broken(shape):
        raise RuntimeError("out of memory")

    policy.prober = broken
    other = (12, "float32", "cpu")
    policy.saw(other, ProbeShape(2, 2, 3, 8))
    verdict = policy.probe_next()
    assert not verdict.ok and "out of memory" in verdict.probe and not policy.pending


def test_a_probe_that_runs_out_of_device_memory_judges_nothing_and_is_tried_again_later():
    """The probe's two sessions are not in the memory budget: with the budget full it can run out of memory, which
    says nothing about the class. The class stays pending (one session per call), not probed again at once (every
    idle iteration would), and is probed again OOM_RETRY_S later."""
    from app.engine.batching import OOM_RETRY_S

    now = [100.0]
    policy, probed = BatchingPolicy("auto", clock=lambda: now[0]), []

    def prober(shape: ProbeShape):
        probed.append(shape)
        if len(probed) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return Finding(True, A)

    policy.prober = prober
    policy.saw(A, SHAPE)
    assert policy.probe_next() is None and len(probed) == 1
    assert not policy.allows(A) and policy.invariant is None  # no verdict
    assert not policy.pending and policy.wants_probe([A, A]) is None  # not again at once
    assert "ran out of device memory" in policy.describe()[0]["probe"]
    now[0] += OOM_RETRY_S
    assert policy.pending and policy.wants_probe([A, A]) == A
    verdict = policy.probe_next()
    assert verdict.ok and policy.allows(A) and len(probed) == 2 and not policy.pending
