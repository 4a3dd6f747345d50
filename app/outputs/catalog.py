"""The output kinds this server knows: every stage registered (``STAGE_TYPES``), built with what it loaded.

The one place a new kind is registered (the interface is ``app.outputs.stage``'s).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from wm_refiner_client import spec

from app.core.error_kinds import ApiError
from app.outputs.kinds import VIDEO, Outputs
from app.outputs.latents import LatentsStage
from app.outputs.preview import PreviewStage
from app.outputs.stage import OutputStage, OutputStages, SessionStages
from app.outputs.video import VideoStage

# Every kind's stage, in the order of their tensors on the wire (a stage after those it needs).
STAGE_TYPES: tuple[type[OutputStage], ...] = (LatentsStage, VideoStage, PreviewStage)


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


def kinds_with_needs(kinds: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Each of ``kinds`` with the kinds it is made from, itself included (``OutputStage.needs``, transitively)."""
    by_kind = {stage_type.kind: stage_type for stage_type in STAGE_TYPES}
    found: dict[str, tuple[str, ...]] = {}
    for kind in kinds:
        running, todo = [], [kind]
        while todo:
            current = todo.pop()
            if current not in running:
                running.append(current)
                todo.extend(by_kind[current].needs)
        found[kind] = tuple(running)
    return found


def describe(stages: SessionStages) -> dict[str, Any]:
    """Every registered kind's fields in a session's description (their defaults for the kinds it lacks)."""
    states, fields = stages.states, {}
    for stage_type in STAGE_TYPES:
        fields.update(stage_type.status(states.get(stage_type.kind)))
    return fields


def outputs_from_fields(fields: dict[str, Any], vae_configured: bool) -> Outputs:
    """A session's ``Outputs`` from its config's fields as JSON values (absent = default; text goes through
    ``spec.SessionField.from_text`` first); ApiError 422 saying what to send instead.

    Every registered kind reads its options whether or not the session asks for the kind (a bad value is a
    422 either way, as a bad ``video_format`` always was); what a kind needs (a VAE, an encoder library) is
    checked only for the kinds asked for and the kinds they are computed from."""
    try:
        kinds = spec.output_kinds(fields.get("outputs"))
        values: dict[str, Any] = {}
        for stage_type in STAGE_TYPES:
            values.update(stage_type.read_options(fields))
    except ValueError as exc:
        raise ApiError("invalid_config", str(exc)) from None
    own = {f.name for f in dataclasses.fields(Outputs)}
    outputs = Outputs(kinds, **{k: v for k, v in values.items() if k in own},
                  options=tuple((k, v) for k, v in values.items() if k not in own))
    running = kinds_with_needs(kinds)
    by_kind = {stage_type.kind: stage_type for stage_type in STAGE_TYPES}
    for kind in kinds:
        if not vae_configured and any(by_kind[k].requires == "vae" for k in running[kind]):
            via = "" if kind == VIDEO else " (made from the decoded video)"
            raise ApiError(
                "invalid_config",
                f"outputs includes {kind!r}{via} but this server has no VAE (setting vae, flag --vae); ask for "
                "outputs ['latents'] or configure the server with an AutoencoderKLLTX2Video folder",
            )
        for needed in running[kind]:
            missing = by_kind[needed].encoder_missing(outputs)
            if missing is not None:
                raise ApiError("invalid_config", missing)
    return outputs
