"""Output stages: what a session's committed units become on their way out (latents, video, ...).

The engine commits a model-side ``models.session.Unit`` (latent frames) and runs the session's stages over it
without knowing their kinds (``SessionStages.push``); what each stage returns for the unit is its *payload*,
carried beside the unit in an ``OutUnit`` (``{kind: payload}``). Off the engine thread a payload is copied to the
host (``to_host``) and put on the wire (``wire``) in the format the session's ``app.outputs.kinds.Outputs`` say.

What a new output kind implements (subclass ``OutputStage``, in its own module), and how it is registered:

- ``kind`` (its name in ``outputs``), ``action`` (what it does, for the error when it fails: "decoding this
  session's video"), ``deferred`` (True when pushing a unit is costly: the engine then runs it as a scheduled
  *output step* between model calls instead of inside the commit; see ``app.engine.scheduler``);
- ``new_state(outputs, config)``: a new session's state. States are IMMUTABLE: ``push`` and ``finish`` return a
  new one. That is the rollback point: atomic work keeps the state from before it and puts it back on failure;
- ``push(state, unit, final) -> (state, payload)``: a committed unit; ``final``: the session's last one;
- ``finish(state) -> (state, payload | None)``: the stream ended (a flush) after the last unit: what the stage
  still holds (a video's tail); ``done(state)``: nothing left to finish;
- ``nbytes(state)``: what the state holds on the device (counted in the session's cache bytes);
- ``position(state)``: where its output stands (frames of its own that went out), 0 when it has no count;
- ``status(state | None)`` (a classmethod): its fields in ``GET /v1/sessions/{id}``; with None, their values
  for a session without the kind (reported whether or not this server can produce it);
- ``to_tensors(state, prefix) -> (tensors, fields)`` and ``from_tensors(tensors, fields, prefix)``: the state in
  a snapshot or checkpoint (tensor names under ``prefix``, JSON-able ``fields``);
- ``to_host(payload)``: start the payload's copy to the host (engine thread: no waiting) and return a function
  that waits for it; the host payload has ``nbytes``;
- ``wire(payloads, outputs, shape, at, response_dtype) -> (tensors, metadata)``: host payloads of consecutive
  units (possibly none) as one response or stream unit; ``shape``: the latents' (B, C, n, H, W), ``at``: its
  ``position`` when there are no payloads;
- ``build(**loaded)`` (a classmethod): the stage, given what the server loaded (``decoder``: the VAE's, or None),
  or a string saying why this server cannot produce the kind.

Then register the class in ``STAGE_TYPES`` (below), add the kind to the choices of the ``outputs`` field in
``wm_refiner_client.spec`` (``app.outputs.kinds.OUTPUT_KINDS`` is read from there), and teach the
client to decode its tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from models.config import SessionConfig
from models.session import Unit

from app.outputs.kinds import Outputs


class OutputStage:
    """One kind of output (see the module docstring for the contract)."""

    kind: str = ""
    action: str = ""
    deferred: bool = False

    def new_state(self, outputs: Outputs, config: SessionConfig) -> Any:
        return None

    def push(self, state: Any, unit: Unit, final: bool) -> tuple[Any, Any]:
        raise NotImplementedError

    def finish(self, state: Any) -> tuple[Any, Any | None]:
        return state, None

    def done(self, state: Any) -> bool:
        return True

    def nbytes(self, state: Any) -> int:
        return 0

    def position(self, state: Any) -> int:
        return 0

    @classmethod
    def status(cls, state: Any | None) -> dict[str, Any]:
        return {}

    @classmethod
    def build(cls, **loaded) -> OutputStage | str:
        return cls()

    def to_tensors(self, state: Any, prefix: str) -> tuple[dict[str, torch.Tensor], Any]:
        return {}, None

    def from_tensors(self, tensors: dict[str, torch.Tensor], fields: Any, prefix: str) -> Any:
        return None

    def to_host(self, payload: Any) -> Callable[[], Any]:
        raise NotImplementedError

    def wire(self, payloads: list[Any], outputs: Outputs, shape: tuple[int, ...], at: int,
             response_dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        raise NotImplementedError


@dataclass(frozen=True)
class OutUnit:
    """A committed unit on its way out: the model's unit (kind, frames, latents) and each stage's payload for it. A
    ``"tail"`` unit holds no latent frames: what the stages still held when a flush ended the stream."""

    kind: str  # "sink", "block" or "tail"
    latents: torch.Tensor  # (B, C, frame_end - frame_start, H, W)
    frame_start: int
    frame_end: int
    started_at: float = 0.0
    payloads: dict[str, Any] = field(default_factory=dict)
    key: tuple[int, ...] = ()  # where it ends in the stream: (latent frame, each stage's position after it)
    check: Any = None  # the model unit's finite check, still on the device (models.session.FiniteCheck), or None


class OutputFailure(Exception):
    """A stage failed on a unit; the session's stages are as they were before."""

    def __init__(self, stage: OutputStage, cause: BaseException):
        super().__init__(f"{stage.action} failed ({cause!r})")
        self.stage = stage
        self.cause = cause


@dataclass(eq=False)
class SessionStages:
    """A session's stages and their states (engine thread; readers on the loop see whole immutable states)."""

    stages: tuple[OutputStage, ...]
    states: dict[str, Any]

    @property
    def deferred(self) -> bool:
        return any(stage.deferred for stage in self.stages)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(stage.kind for stage in self.stages)

    def push(self, unit: Unit, final: bool) -> OutUnit:
        """Every stage's payload for ``unit``; ``OutputFailure`` (states unchanged) when one fails."""
        states, payloads = self._run(lambda stage, state: stage.push(state, unit, final))
        self.states = states
        return OutUnit(unit.kind, unit.latents, unit.frame_start, unit.frame_end, unit.started_at, payloads,
                       (unit.frame_end, *self._positions()), unit.check)

    def finish(self, empty_latents: torch.Tensor, at: int, started_at: float) -> OutUnit:
        """The stream ended at latent frame ``at``: what the stages still hold, as a "tail" unit."""
        states, payloads = self._run(lambda stage, state: stage.finish(state))
        self.states = states
        payloads = {kind: payload for kind, payload in payloads.items() if payload is not None}
        return OutUnit("tail", empty_latents, at, at, started_at, payloads, (at, *self._positions()))

    def _run(self, step) -> tuple[dict[str, Any], dict[str, Any]]:
        states, payloads = dict(self.states), {}
        for stage in self.stages:
            try:
                states[stage.kind], payloads[stage.kind] = step(stage, states[stage.kind])
            except Exception as exc:
                raise OutputFailure(stage, exc) from exc
        return states, payloads

    @property
    def done(self) -> bool:
        return all(stage.done(self.states[stage.kind]) for stage in self.stages)

    # The rollback point of atomic work: the states are immutable, so the mapping of them is the whole point.
    def checkpoint(self) -> dict[str, Any]:
        return dict(self.states)

    def restore(self, point: dict[str, Any]) -> None:
        self.states = dict(point)

    @property
    def nbytes(self) -> int:
        states = self.states  # one read: the engine replaces the mapping, never edits it
        return sum(stage.nbytes(states[stage.kind]) for stage in self.stages)

    def positions(self) -> dict[str, int]:
        states = self.states
        return {stage.kind: stage.position(states[stage.kind]) for stage in self.stages}

    def _positions(self) -> tuple[int, ...]:
        return tuple(self.positions().values())

    def key_at(self, frame: int) -> tuple[int, ...]:
        """The ``OutUnit.key`` of a unit ending at latent frame ``frame`` with the stages where they are now."""
        return (frame, *self._positions())

    def status(self) -> dict[str, Any]:
        """Every registered kind's fields in the session's description (their defaults for kinds it lacks)."""
        states, fields = self.states, {}
        for stage_type in STAGE_TYPES:
            fields.update(stage_type.status(states.get(stage_type.kind)))
        return fields

    def to_tensors(self, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, {kind: fields}) of every stage's state, each under ``prefix.kind``."""
        tensors, fields = {}, {}
        states = self.states
        for stage in self.stages:
            stage_tensors, stage_fields = stage.to_tensors(states[stage.kind], f"{prefix}.{stage.kind}")
            tensors.update(stage_tensors)
            fields[stage.kind] = stage_fields
        return tensors, fields


class StageUnavailable(Exception):
    """The server cannot produce a kind (say, video without a VAE)."""


class OutputStages:
    """The stages this server can run, by kind (built once what they need is loaded)."""

    def __init__(self, stages: dict[str, OutputStage], unavailable: dict[str, str] | None = None):
        self.by_kind = stages
        self.unavailable = unavailable or {}  # kind -> why this server cannot produce it

    def __getitem__(self, kind: str) -> OutputStage:
        stage = self.by_kind.get(kind)
        if stage is None:
            raise StageUnavailable(self.unavailable.get(kind, f"this server has no output stage {kind!r}"))
        return stage

    def for_session(self, outputs: Outputs, config: SessionConfig) -> SessionStages:
        """A new session's stages, for ``outputs``' kinds."""
        stages = tuple(self[kind] for kind in outputs.kinds)
        return SessionStages(stages, {stage.kind: stage.new_state(outputs, config) for stage in stages})

    def from_tensors(self, outputs: Outputs, tensors: dict[str, torch.Tensor], fields: dict[str, Any],
                     prefix: str) -> SessionStages:
        """A restored session's stages (``SessionStages.to_tensors``); ``StageUnavailable`` or the stage's error
        when the snapshot does not fit this server."""
        stages = tuple(self[kind] for kind in outputs.kinds)
        states = {stage.kind: stage.from_tensors(tensors, fields.get(stage.kind), f"{prefix}.{stage.kind}")
                  for stage in stages}
        return SessionStages(stages, states)

    def wire(self, payloads_of: list[dict[str, Any]], outputs: Outputs, shape: tuple[int, ...],
             positions: dict[str, int], response_dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The tensors and metadata of ``outputs``' kinds for host units' payloads (in order)."""
        tensors: dict[str, torch.Tensor] = {}
        metadata: dict[str, Any] = {}
        for kind in outputs.kinds:
            payloads = [p[kind] for p in payloads_of if kind in p]
            kind_tensors, kind_meta = self[kind].wire(payloads, outputs, shape, positions.get(kind, 0), response_dtype)
            tensors.update(kind_tensors)
            metadata.update(kind_meta)
        return tensors, metadata


def latents_only() -> SessionStages:
    """The stages of a session that outputs latents only (the engine's default)."""
    stage = LatentsStage()
    return SessionStages((stage,), {stage.kind: None})


def build_stages(**loaded) -> OutputStages:
    """The stages this server can run with what it loaded (``decoder``: the VAE's, or None)."""
    stages, unavailable = {}, {}
    for stage_type in STAGE_TYPES:
        stage = stage_type.build(**loaded)
        if isinstance(stage, str):
            unavailable[stage_type.kind] = stage
        else:
            stages[stage_type.kind] = stage
    return OutputStages(stages, unavailable)


# The registration: every kind's stage, in the order of their tensors on the wire.
from app.outputs.latents import LatentsStage  # noqa: E402  (they build on the classes above)
from app.outputs.video import VideoStage  # noqa: E402

STAGE_TYPES: tuple[type[OutputStage], ...] = (LatentsStage, VideoStage)
