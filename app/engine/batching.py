"""Which model calls may hold several sessions: the ``batching`` setting and the batch-invariance probe per class.

Bit-identity under batching (a session's bytes do not depend on the sessions sharing its forwards) is a property
of the loaded model on the CPU or GPU it runs on, not a law: the stacked projections and feed-forward are GEMMs
whose M is rows x tokens, and a BLAS (MKL on one CPU or another, cuBLAS) may pick its kernel, and so its rounding,
by M. What the code makes invariant by construction is everything that runs per session on a solo forward's shapes
(attention, RoPE, gates, the time embedding, the prompt's projections: ``models.step``, ``models.attention``); the
rest is measured, by ``models.determinism.probe_batch_invariance``, for each *class* of model call served.

A class is what fixes the shapes of the stacked GEMMs: the forwards' group (tokens per row, dtype, device;
``models.step.RowForward.group``). The prompt's length does not enter: prompts are projected per session, so no
stacked GEMM sees it. A new latent size or a short last block is a new class.

- ``batching: auto`` (the default) batches a class only once its probe passed. A class seen for the first time is
  served one session per call until then; it is probed on the engine thread (the only caller of the model) at the
  first iteration where the engine is idle or two of its sessions are ready at once (then batching would pay; that
  call waits for the probe). A class whose probe failed stays one session per call, logged once, shown in
  ``/v1/info`` -> ``engine.batch_classes``.
- ``true`` batches every class and probes them all the same, warning once per class that fails.
- ``false`` never batches and never probes.

A probe of a class the engine saw that runs out of device memory (its two sessions are outside the memory budget,
which the served sessions may fill) judges nothing: the class stays pending and is probed again ``OOM_RETRY_S``
later.

Pure bookkeeping plus one call into the probe: the engine owns the thread and decides when to call ``probe_next``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Literal

import torch

log = logging.getLogger(__name__)

Mode = Literal["auto"] | bool
# A probe that ran out of device memory measured nothing: its class is probed again after this long (sessions may
# have been parked or ended meanwhile), served one session per call until then, and never judged by it.
OOM_RETRY_S = 60.0


@dataclass(frozen=True)
class ProbeShape:
    """What the probe needs to build sessions of a class: their latent frame size, block frames and prompt length."""

    height: int
    width: int
    block_frames: int
    prompt_tokens: int


@dataclass(frozen=True)
class ClassVerdict:
    group: Hashable
    shape: ProbeShape
    ok: bool
    probe: str  # the probe's finding, in words
    seconds: float

    def to_dict(self) -> dict:
        tokens, dtype, device = self.group if isinstance(self.group, tuple) and len(self.group) == 3 else (
            self.group, None, None)
        return {
            "tokens_per_row": tokens,
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
            "device": str(device) if device is not None else None,
            "frame": [self.shape.height, self.shape.width],
            "block_frames": self.shape.block_frames,
            "invariant": self.ok,
            "probe": self.probe,
            "probe_seconds": round(self.seconds, 3),
        }


class BatchingPolicy:
    """Whether a class of model call may hold several sessions, and which classes still wait for their probe.

    ``prober(shape)`` runs the probe for a class and returns a ``models.determinism.InvarianceProbe``; it is set
    once the model is loaded (until then nothing is probed and, in ``auto``, nothing is batched)."""

    def __init__(self, mode: Mode = "auto", clock: Callable[[], float] = time.monotonic):
        if mode not in ("auto", True, False):
            raise ValueError(f"batching must be 'auto', true or false, got {mode!r}")
        self.mode = mode
        self.prober: Callable[[ProbeShape], object] | None = None
        self._verdicts: dict[Hashable, ClassVerdict] = {}
        self._pending: dict[Hashable, ProbeShape] = {}  # in the order they were first seen
        self._deferred: dict[Hashable, float] = {}  # pending classes whose probe ran out of memory: when to retry
        self.clock = clock
        self.first: ClassVerdict | None = None  # the first class probed (the warm-up's when there is one)

    # --- the scheduler's question --------------------------------------------------------------------------
    def allows(self, group: Hashable) -> bool:
        """Whether forwards of ``group`` may share a model call now."""
        if self.mode is True:
            return True
        if self.mode is False:
            return False
        verdict = self._verdicts.get(group)
        return verdict is not None and verdict.ok

    @property
    def batching(self) -> bool:
        """Whether some model calls may hold several sessions now (any class allowed)."""
        return self.mode is True or (self.mode == "auto" and any(v.ok for v in list(self._verdicts.values())))

    # --- classes and their probes --------------------------------------------------------------------------
    def unseen(self, group: Hashable) -> bool:
        """Whether ``group`` is a class the policy has neither probed nor queued (and would queue)."""
        return self.mode is not False and group not in self._verdicts and group not in self._pending

    def saw(self, group: Hashable, shape: ProbeShape) -> None:
        """A ready forward of ``group``: a class never seen before waits for its probe."""
        if self.unseen(group):
            self._pending[group] = shape

    def wants_probe(self, ready_groups: list[Hashable]) -> Hashable | None:
        """The pending class to probe before this iteration's call: one with two sessions ready at once (batching
        would pay now); None otherwise."""
        if not self._pending or self.prober is None:
            return None
        due = self._due()
        counts: dict[Hashable, int] = {}
        for group in ready_groups:
            counts[group] = counts.get(group, 0) + 1
            if counts[group] == 2 and group in due:
                return group
        return None

    def _due(self) -> dict[Hashable, ProbeShape]:
        """The pending classes that may be probed now (not waiting out an out-of-memory retry)."""
        now = self.clock()
        return {g: s for g, s in self._pending.items() if self._deferred.get(g, now) <= now}

    @property
    def pending(self) -> bool:
        """Whether a class waits for a probe that may run now."""
        return bool(self._pending) and self.prober is not None and bool(self._due())

    def probe_next(self, group: Hashable | None = None) -> ClassVerdict | None:
        """Probe ``group`` (default: the oldest pending class that is due) on this thread and record its verdict
        (None when nothing is due, or the probe ran out of memory and is deferred)."""
        due = self._due()
        if not due or self.prober is None:
            return None
        if group is None:
            group = next(iter(due))
        return self.probe(self._pending[group], group)  # stays pending (visible) until its verdict is in

    def probed(self, shape: ProbeShape) -> bool:
        """Whether a class of ``shape``'s latent size and frames per forward has a verdict (the prompt's length
        does not enter a class)."""
        key = (shape.height, shape.width, shape.block_frames)
        return any((v.shape.height, v.shape.width, v.shape.block_frames) == key for v in list(self._verdicts.values()))

    def probe(self, shape: ProbeShape, group: Hashable | None = None) -> ClassVerdict | None:
        """Run the probe for ``shape`` now (on the engine thread) and record it under the group it measured. A probe
        of a class the engine saw (``group`` given) that runs out of device memory records nothing: the class stays
        pending, served one session per call, and is probed again ``OOM_RETRY_S`` later (None then). Its two
        sessions are not in the memory budget: the sessions that fill it are why it ran out, not the class."""
        if self.prober is None:
            raise RuntimeError("no prober: the model is not loaded")
        started = time.perf_counter()
        try:
            result = self.prober(shape)
        except torch.OutOfMemoryError as exc:
            if group is None:
                log.exception("the batch-invariance probe failed to run")
                result = _Broken(f"the probe failed to run: {exc!r}")
            else:
                self._deferred[group] = self.clock() + OOM_RETRY_S
                log.warning("the batch-invariance probe of %s ran out of device memory; served one session per call, "
                            "probed again in %.0f s", group, OOM_RETRY_S)
                return None
        except Exception as exc:  # recorded as the class's verdict, so that it is not probed again and again
            log.exception("the batch-invariance probe failed to run")
            result = _Broken(f"the probe failed to run: {exc!r}")
        seconds = time.perf_counter() - started
        measured = getattr(result, "group", None)
        ok, finding = bool(result.ok), str(result)
        if group is None:
            group = measured
        elif measured is not None and measured != group:
            # Never batch a class on another class's verdict.
            ok, finding = False, f"the probe measured {measured}, not the class {group} it was asked for"
        self._pending.pop(group, None)
        self._deferred.pop(group, None)
        verdict = ClassVerdict(group, shape, ok, finding, seconds)
        self._verdicts[group] = verdict
        if self.first is None:
            self.first = verdict
        self._log(verdict)
        return verdict

    def _log(self, verdict: ClassVerdict) -> None:
        tokens = verdict.to_dict()["tokens_per_row"]
        if verdict.ok:
            log.info("batch invariance probe, %s tokens per row (%.2f s): %s", tokens, verdict.seconds, verdict.probe)
        elif self.mode is True:
            log.warning("batching: true, but batched forwards of %s tokens per row are NOT bit-identical to solo "
                        "forwards here (%s): a session's bytes may depend on the sessions it shares model calls with "
                        "(still within the parity tolerance), so retries, restores and resumes may differ in the last "
                        "bits. Set batching: auto or false to keep them bit-identical.", tokens, verdict.probe)
        else:
            log.warning("batching: auto serves forwards of %s tokens per row one session per call: batched rows are "
                        "not bit-identical to solo ones here (%s). batching: true forces batching.", tokens,
                        verdict.probe)

    # --- what /v1/info says --------------------------------------------------------------------------------
    @property
    def invariant(self) -> bool | None:
        """None before any probe; else whether every class probed so far passed."""
        verdicts = list(self._verdicts.values())
        if not verdicts:
            return None
        return all(v.ok for v in verdicts)

    def describe(self) -> list[dict]:
        """Each class probed, then each still waiting for its probe."""
        # list() copies in one step under the GIL: the engine thread may add a class meanwhile.
        probed = [v.to_dict() for v in list(self._verdicts.values())]
        deferred = dict(self._deferred)
        waiting = [{"tokens_per_row": g[0] if isinstance(g, tuple) else g, "frame": [s.height, s.width],
                    "block_frames": s.block_frames, "invariant": None,
                    "probe": "pending" if g not in deferred else
                    f"pending (its probe ran out of device memory; tried again in "
                    f"{max(0.0, deferred[g] - self.clock()):.0f} s)"}
                   for g, s in list(self._pending.items())]
        return probed + waiting


@dataclass(frozen=True)
class _Broken:
    reason: str
    ok: bool = False
    group: None = None

    def __str__(self) -> str:
        return self.reason
