"""The output kinds this server knows: every stage registered (``STAGE_TYPES``), built with what it loaded.

The one place a new kind is registered (the interface is ``app.outputs.stage``'s).
"""

from __future__ import annotations

from typing import Any

from app.outputs.latents import LatentsStage
from app.outputs.stage import OutputStage, OutputStages, SessionStages
from app.outputs.video import VideoStage

# Every kind's stage, in the order of their tensors on the wire.
STAGE_TYPES: tuple[type[OutputStage], ...] = (LatentsStage, VideoStage)


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


def describe(stages: SessionStages) -> dict[str, Any]:
    """Every registered kind's fields in a session's description (their defaults for the kinds it lacks)."""
    states, fields = stages.states, {}
    for stage_type in STAGE_TYPES:
        fields.update(stage_type.status(states.get(stage_type.kind)))
    return fields
