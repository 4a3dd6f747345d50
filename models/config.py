"""Per-session configuration of the streaming refiner (the fields as a client sends them: docs/api.md, "Routes").

A ``SessionConfig`` is frozen and validated on construction, so a session can never hold an invalid one.

Its fields, defaults and per-field bounds are the ones ``wm_refiner_client.spec`` declares for the wire (the service
and the client derive everything from there); they are written out here because ``models/`` depends on nothing
above it, and tests/app/api/test_spec.py checks that the two stay equal.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .errors import InvalidConfigError

Positions = Literal["absolute", "rebased"]

# The 3-step distilled schedule of the public SANA-WM refiner release.
DEFAULT_SIGMAS: tuple[float, ...] = (0.909375, 0.725, 0.421875, 0.0)


@dataclass(frozen=True)
class SessionConfig:
    """What a stream is refined with. Defaults are the reference recipe's.

    - ``sink_frames`` (S): leading frames kept raw and used as the attention sink.
    - ``block_size``: frames refined together; the stream is cut on the grid ``S + i * block_size``.
    - ``kv_max_frames`` (K): sink + history frames a block may attend to besides itself.
    - ``positions``: ``"absolute"`` reproduces the reference bit for bit; ``"rebased"`` keeps RoPE positions
      bounded by ``S + K + block_size + 1`` for streams of any length.
    """

    seed: int = 42
    fps: float = 16.0
    sink_frames: int = 1
    block_size: int = 3
    kv_max_frames: int = 11
    sigmas: tuple[float, ...] = field(default=DEFAULT_SIGMAS)
    positions: Positions = "absolute"

    def __post_init__(self) -> None:
        try:
            sigmas = tuple(float(s) for s in self.sigmas)
        except (TypeError, ValueError):
            raise InvalidConfigError(f"sigmas must be a list of numbers, got {self.sigmas!r}") from None
        object.__setattr__(self, "sigmas", sigmas)
        problems = _problems(self)
        if problems:
            raise InvalidConfigError("invalid session config: " + "; ".join(problems))

    @property
    def max_history_frames(self) -> int:
        return self.kv_max_frames - self.sink_frames

    @property
    def steps(self) -> int:
        """Denoising forwards per block (one per sigma but the last)."""
        return len(self.sigmas) - 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["sigmas"] = list(self.sigmas)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionConfig:
        """Build from a JSON-like mapping, rejecting unknown keys (a typo must not silently fall back)."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidConfigError(f"unknown session config field(s) {unknown}; known fields are {sorted(known)}")
        values = {k: v for k, v in data.items() if v is not None}
        if "sigmas" in values and not isinstance(values["sigmas"], (list, tuple)):
            raise InvalidConfigError(f"sigmas must be a list of numbers, got {values['sigmas']!r}")
        return cls(**values)


_INT_LIMIT = 1 << 20


def _problems(config: SessionConfig) -> list[str]:
    """Every reason the config is invalid, each saying what to send instead."""
    problems: list[str] = []
    for name in ("seed", "sink_frames", "block_size", "kv_max_frames"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{name} must be an integer, got {value!r}")
    if problems:
        return problems
    if not 0 <= config.seed < 2**63:
        problems.append(f"seed must be in [0, 2**63), got {config.seed}")
    if isinstance(config.fps, bool) or not isinstance(config.fps, (int, float)) or not math.isfinite(config.fps):
        problems.append(f"fps must be a finite number, got {config.fps!r}")
    elif not 0.001 <= config.fps <= 1000:
        # Far below 0.001 (about 1e-35) the float32 RoPE time positions (pixel frame / fps) overflow and every
        # block is NaN; the floor is a margin (wm_refiner_client.spec.FPS_MIN).
        problems.append(f"fps must be in [0.001, 1000], got {config.fps}")
    if not 1 <= config.sink_frames <= _INT_LIMIT:
        problems.append(f"sink_frames must be >= 1, got {config.sink_frames}")
    if not 1 <= config.block_size <= _INT_LIMIT:
        problems.append(f"block_size must be >= 1, got {config.block_size}")
    if config.kv_max_frames > _INT_LIMIT:
        problems.append(f"kv_max_frames must be <= {_INT_LIMIT}, got {config.kv_max_frames}")
    elif config.kv_max_frames < config.sink_frames + config.block_size:
        problems.append(
            f"kv_max_frames must be >= sink_frames + block_size = {config.sink_frames + config.block_size}, "
            f"got {config.kv_max_frames}"
        )
    sigmas = config.sigmas
    if len(sigmas) < 2:
        problems.append(f"sigmas needs at least 2 values ending in 0.0, got {list(sigmas)}")
    elif not all(math.isfinite(s) and 0.0 <= s <= 1.0 for s in sigmas):
        problems.append(f"sigmas must lie within [0, 1], got {list(sigmas)}")
    elif any(b >= a for a, b in zip(sigmas, sigmas[1:])):
        problems.append(f"sigmas must be strictly decreasing, got {list(sigmas)}")
    elif sigmas[-1] != 0.0:
        problems.append(f"sigmas must end in 0.0, got {list(sigmas)}")
    if config.positions not in ("absolute", "rebased"):
        problems.append(f"positions must be 'absolute' or 'rebased', got {config.positions!r}")
    return problems
