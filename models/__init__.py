"""The compute layer of wm-refiner: pure torch, no web.

    refiner = load_refiner("path/to/refiner", device="auto", dtype="auto")
    session = RefinerSession(refiner, SessionConfig(block_size=3))
    for unit in session.push(latents, prompt_embeds):   # any split of the stream
        ...                                            # the sink once, then each refined block
    session.flush()                                    # the final short block

or, for a whole clip, ``refine_clip(refiner, latents, prompt_embeds)``.
"""

from .attention import CaptureError, ForwardWindow, KVCapture, LayerKV, WindowAttnProcessor, install_processors
from .checkpoints import PRESETS, build_model, write_checkpoint
from .clip import refine_clip
from .config import DEFAULT_SIGMAS, SessionConfig
from .errors import (
    InvalidConfigError,
    InvalidInputError,
    MissingInputError,
    ModelLoadError,
    RefinerError,
    StreamClosedError,
)
from .forward import Prompt, run_forward
from .loading import ModelInfo, Refiner, from_model, load_refiner
from .session import Chunk, RefinerSession, SessionState, StepPlan, StepResult, Unit

__all__ = [
    "CaptureError",
    "Chunk",
    "DEFAULT_SIGMAS",
    "ForwardWindow",
    "InvalidConfigError",
    "InvalidInputError",
    "KVCapture",
    "LayerKV",
    "MissingInputError",
    "ModelInfo",
    "ModelLoadError",
    "PRESETS",
    "Prompt",
    "Refiner",
    "RefinerError",
    "RefinerSession",
    "SessionConfig",
    "SessionState",
    "StepPlan",
    "StepResult",
    "StreamClosedError",
    "Unit",
    "WindowAttnProcessor",
    "build_model",
    "from_model",
    "install_processors",
    "load_refiner",
    "refine_clip",
    "run_forward",
    "write_checkpoint",
]
