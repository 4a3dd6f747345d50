"""Errors of the compute layer.

Every error carries a stable ``code`` so the service can map it to a status without parsing messages, and a
message that says what was wrong and what to send instead.
"""

from __future__ import annotations


class RefinerError(Exception):
    """Base class of every error raised on purpose by ``models``."""

    code = "refiner_error"


class InvalidConfigError(RefinerError, ValueError):
    """A session or model configuration that cannot work (e.g. ``kv_max_frames < sink_frames + block_size``)."""

    code = "invalid_config"


class InvalidInputError(RefinerError, ValueError):
    """A tensor with the wrong rank, dtype, channel count, geometry, or non-finite values."""

    code = "invalid_input"


class NonFiniteOutputError(InvalidInputError):
    """Finite inputs whose block refined to NaN or Inf (magnitudes near the dtype's limit): the block is not
    committed, so the session is as it was before it."""


class MissingInputError(RefinerError, ValueError):
    """A required tensor is absent (e.g. the first chunk carries no ``prompt_embeds``)."""

    code = "missing_input"


class StreamClosedError(RefinerError):
    """Frames were sent after the stream was flushed."""

    code = "stream_closed"


class ModelLoadError(RefinerError):
    """The refiner folder is missing, incomplete, or holds an unsupported configuration."""

    code = "model_load_error"


class CaptureError(RefinerError, RuntimeError):
    """A forward that should have captured K/V did not; the message names layer, mode, cause and fix."""

    code = "capture_error"
