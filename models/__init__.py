"""The compute layer of wm-refiner: pure torch, no web.

    refiner = load_refiner("path/to/refiner", device="auto", dtype="auto")
    session = RefinerSession(refiner, SessionConfig(block_size=3))
    for unit in session.push(latents, prompt_embeds):   # any split of the stream
        ...                                            # the sink once, then each refined block
    session.flush()                                    # the final short block

or, for a whole clip, ``refine_clip(refiner, latents, prompt_embeds)``. Several sessions' forwards run as one
model call with ``run_batch`` (what the service's engine does); a session's bytes do not depend on which
sessions share its forwards (``models.determinism``).
"""

from .determinism import request_reproducible_gemm

# Before torch runs its first GEMM: see models.determinism.
request_reproducible_gemm()

from .attention import (  # noqa: E402
    CaptureError,
    ForwardWindow,
    KVWrites,
    PreparedPrompt,
    PromptAttnProcessor,
    RowWindow,
    WindowAttnProcessor,
    install_processors,
)
from .checkpoints import PRESETS, build_model, write_checkpoint  # noqa: E402
from .clip import refine_clip  # noqa: E402
from .config import DEFAULT_SIGMAS, SessionConfig  # noqa: E402
from .errors import (  # noqa: E402
    InvalidConfigError,
    InvalidInputError,
    MissingInputError,
    ModelLoadError,
    RefinerError,
    StreamClosedError,
)
from .forward import Prompt  # noqa: E402
from .kv import SessionKV, WindowLayout  # noqa: E402
from .loading import ModelInfo, Refiner, from_model, load_refiner  # noqa: E402
from .session import BlockRun, Chunk, RefinerSession, SessionCheckpoint, SessionState, StepPlan, Unit  # noqa: E402
from .step import RowForward, prepare_prompt, run_batch  # noqa: E402

__all__ = [
    "BlockRun",
    "CaptureError",
    "Chunk",
    "DEFAULT_SIGMAS",
    "ForwardWindow",
    "InvalidConfigError",
    "InvalidInputError",
    "KVWrites",
    "MissingInputError",
    "ModelInfo",
    "ModelLoadError",
    "PRESETS",
    "PreparedPrompt",
    "Prompt",
    "PromptAttnProcessor",
    "Refiner",
    "RefinerError",
    "RefinerSession",
    "RowForward",
    "RowWindow",
    "SessionCheckpoint",
    "SessionConfig",
    "SessionKV",
    "SessionState",
    "StepPlan",
    "StreamClosedError",
    "Unit",
    "WindowAttnProcessor",
    "WindowLayout",
    "build_model",
    "from_model",
    "install_processors",
    "load_refiner",
    "prepare_prompt",
    "refine_clip",
    "run_batch",
    "write_checkpoint",
]
