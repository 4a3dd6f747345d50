"""Output stages: what a session's committed units become on their way out (latents, video, ...).

The engine commits a model-side ``models.session.Unit`` (latent frames) and runs the session's stages over it
without knowing their kinds (``SessionStages.push``); what each stage returns for the unit is its *payload*,
carried beside the unit in an ``OutUnit`` (``{kind: payload}``). Off the engine thread a payload is copied to the
host (``to_host``) and put on the wire (``wire``) in the format the session's ``app.outputs.kinds.Outputs`` say.

What a new output kind implements (subclass ``OutputStage``, in its own module), and how it is registered:

- ``kind`` (its name in ``outputs``), ``action`` (what it does, for the error when it fails: "decoding this
  session's video"), ``deferred`` (True when pushing a unit is costly: the engine then runs it as a scheduled
  *output step* between model calls instead of inside the commit; see ``app.engine.scheduler``);
- its options: ``read_options(fields)`` (a classmethod) reads and validates the session fields its spec entry
  declares (``spec.KINDS``: name, type, default, bounds, doc line), ValueError saying what to send (a 422); by
  default every option is a bounded integer. ``requires`` ("vae": it needs the server's VAE) and
  ``encoder_missing(outputs)`` (why this process cannot encode what the options ask for) are checked when a
  session asks for the kind;
- its wire form: ``wire_names`` (the tensors it puts on the wire) and ``wire`` below;
- ``needs``: kinds whose payloads of the same unit it is computed from (the preview from the video's frames). The
  session then runs those stages first, also when it did not ask for them (their payloads are then dropped before
  anything is copied to the host), and calls ``derive(state, payloads)`` instead of ``push`` and ``finish``;
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

Then register the class in ``STAGE_TYPES`` (``app.outputs.catalog``) and declare the kind with its options in
``wm_refiner_client.spec.KINDS`` (one entry: the ``outputs`` choices, ``app.outputs.kinds.OUTPUT_KINDS`` and the session
fields are read from there). The client decodes a kind's tensors without knowing it when they take a form it knows:
a plain array, or encoded pieces (``{kind}``, ``{kind}_sizes``, ``{kind}_format``: ``wm_refiner_client.formats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from models.config import SessionConfig
from models.session import Unit

from wm_refiner_client import spec

from app.outputs.kinds import Outputs, encoder_missing


class OutputStage:
    """One kind of output (see the module docstring for the contract)."""

    kind: str = ""
    action: str = ""
    deferred: bool = False
    needs: tuple[str, ...] = ()
    requires: str = ""  # "vae": the kind needs the server's VAE
    encoder: str = ""  # the encoded format (wm_refiner_client.formats) its payloads are always sent in, if any
    wire_names: tuple[str, ...] = ()

    @classmethod
    def read_options(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """The values of the options ``spec.KINDS`` declares for this kind, from a session's fields (JSON values,
        absent: the default); ValueError naming the field and what to send."""
        kind = spec.KIND_BY_NAME.get(cls.kind)
        return {f.name: f.bounded_integer(fields.get(f.name)) for f in (kind.options if kind else ())}

    @classmethod
    def encoder_missing(cls, outputs: Outputs) -> str | None:
        """Why this process cannot encode this kind for ``outputs``, or None when it can."""
        return None if not cls.encoder else encoder_missing(cls.encoder)

    def derive(self, state: Any, payloads: dict[str, Any]) -> tuple[Any, Any | None]:
        """A stage with ``needs``: its payload from the payloads of ``needs`` for the same unit (a pushed unit's or
        a finish's); None when there is nothing to send for it."""
        raise NotImplementedError

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
    """A session's stages and their states (engine thread; readers on the loop see whole immutable states).
    ``sent``: the kinds whose payloads go out (None: every stage's); the others run only because a sent kind is
    made from them (``OutputStage.needs``), and their payloads are dropped from the ``OutUnit``."""

    stages: tuple[OutputStage, ...]
    states: dict[str, Any]
    sent: tuple[str, ...] | None = None

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
        return OutUnit("tail", empty_latents, at, at, started_at, payloads, (at, *self._positions()))

    def _run(self, step) -> tuple[dict[str, Any], dict[str, Any]]:
        """Each stage's (state, payload) in order (a derived stage after what it needs); the payloads sent, less
        the None ones (a derived stage with nothing for the unit; a tail a stage does not have)."""
        states, payloads = dict(self.states), {}
        for stage in self.stages:
            try:
                if stage.needs:
                    states[stage.kind], payloads[stage.kind] = stage.derive(
                        states[stage.kind], {kind: payloads.get(kind) for kind in stage.needs})
                else:
                    states[stage.kind], payloads[stage.kind] = step(stage, states[stage.kind])
            except Exception as exc:
                raise OutputFailure(stage, exc) from exc
        sent = self.sent if self.sent is not None else tuple(payloads)
        return states, {kind: p for kind, p in payloads.items() if p is not None and kind in sent}

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

    def _running(self, outputs: Outputs) -> tuple[OutputStage, ...]:
        """The stages a session of ``outputs`` runs: its kinds and what they are made from, in registry order
        (``by_kind``'s: ``build_stages`` fills it in ``STAGE_TYPES``' order)."""
        needed, todo = set(), list(outputs.kinds)
        while todo:
            kind = todo.pop()
            if kind not in needed:
                needed.add(kind)
                todo.extend(self[kind].needs)
        return tuple(stage for kind, stage in self.by_kind.items() if kind in needed)

    def for_session(self, outputs: Outputs, config: SessionConfig) -> SessionStages:
        """A new session's stages, for ``outputs``' kinds (and those they are made from, unsent)."""
        stages = self._running(outputs)
        return SessionStages(stages, {stage.kind: stage.new_state(outputs, config) for stage in stages},
                             outputs.kinds)

    def from_tensors(self, outputs: Outputs, tensors: dict[str, torch.Tensor], fields: dict[str, Any],
                     prefix: str) -> SessionStages:
        """A restored session's stages (``SessionStages.to_tensors``); ``StageUnavailable`` or the stage's error
        when the snapshot does not fit this server."""
        stages = self._running(outputs)
        states = {stage.kind: stage.from_tensors(tensors, fields.get(stage.kind), f"{prefix}.{stage.kind}")
                  for stage in stages}
        return SessionStages(stages, states, outputs.kinds)

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
