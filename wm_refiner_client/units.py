"""Tensors on the wire and the refined units that come back.

Every payload is a safetensors file (docs/api.md "Tensors on the wire"). Inputs may be numpy
arrays or torch tensors (float32, float16 or bfloat16; bfloat16 only as a torch tensor, numpy has no such dtype).
Outputs are numpy arrays (``return_tensors="np"``, the default: no torch needed) or torch tensors (``"pt"``).

Shape letters: B batch, C latent channels, t latent frames, H, W latent height and width, L prompt tokens,
D caption channels, F pixel frames.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Literal, Mapping, Union

import numpy as np

ReturnTensors = Literal["np", "pt"]
# A numpy array or a torch tensor (torch stays optional: only imported when a torch tensor is passed or asked for).
Array = Union[np.ndarray, Any]


def is_torch(value: Any) -> bool:
    return type(value).__module__.split(".", 1)[0] == "torch"


def encode(tensors: Mapping[str, Array | None]) -> bytes:
    """safetensors bytes of the non-None ``tensors`` (numpy arrays, torch tensors or a mix)."""
    present = {name: value for name, value in tensors.items() if value is not None}
    if any(is_torch(value) for value in present.values()):
        import torch
        from safetensors.torch import save

        return save({
            name: (value if is_torch(value) else torch.from_numpy(np.ascontiguousarray(value)))
            .detach().to("cpu").contiguous()
            for name, value in present.items()
        })
    from safetensors.numpy import save

    arrays = {}
    for name, value in present.items():
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(value).__name__}")
        arrays[name] = np.ascontiguousarray(value)
    return save(arrays)


def read_metadata(data: bytes) -> dict[str, str]:
    """The safetensors ``__metadata__`` map (``frame_start``, ``frame_end``, ``seq``, ``latency_ms``, ...)."""
    if len(data) < 8:
        raise ValueError("the payload is shorter than a safetensors header")
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_size])
    return dict(header.get("__metadata__") or {})


def decode(data: bytes, return_tensors: ReturnTensors = "np") -> dict[str, Array]:
    if return_tensors == "pt":
        from safetensors.torch import load

        return dict(load(bytes(data)))
    from safetensors.numpy import load

    try:
        return dict(load(bytes(data)))
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(
            f"a response tensor cannot be read as numpy ({exc}); bfloat16 responses (the server's response_dtype "
            "'model') need return_tensors='pt'"
        ) from exc


@dataclass(frozen=True)
class Unit:
    """Refined frames as the server finalized them: latent frames ``[frame_start, frame_end)`` of the session
    (the sink frames once, then each refined block) and, for sessions with video outputs, pixel frames
    ``[video_frame_start, video_frame_end)`` of the session's video.

    ``latents``: (B, C, n, H, W), None when the session's outputs exclude latents. ``video``: uint8
    (B, F, H_px, W_px, 3) RGB or float32 (B, F, 3, H_px, W_px) in [0, 1], None without video outputs.
    ``latency_ms``: the server's time for the block (stream units). ``seq``/``replayed``: HTTP chunk responses
    (``replayed``: the server returned its stored response to a retried seq)."""

    frame_start: int
    frame_end: int
    latents: Array | None = None
    video: Array | None = None
    video_frame_start: int | None = None
    video_frame_end: int | None = None
    latency_ms: float | None = None
    seq: int | None = None
    replayed: bool = False
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def frames(self) -> int:
        """Latent frames in this unit."""
        return self.frame_end - self.frame_start

    @property
    def video_frames(self) -> int:
        """Pixel frames in this unit."""
        if self.video_frame_start is None or self.video_frame_end is None:
            return 0
        return self.video_frame_end - self.video_frame_start

    @classmethod
    def from_payload(cls, data: bytes, return_tensors: ReturnTensors = "np", replayed: bool = False) -> Unit:
        metadata = read_metadata(data)
        tensors = decode(data, return_tensors)
        if "frame_start" not in metadata or "frame_end" not in metadata:
            raise ValueError(f"a unit without frame_start/frame_end metadata (got {sorted(metadata)})")

        def number(name: str, kind=int):
            return kind(metadata[name]) if name in metadata else None

        return cls(
            frame_start=int(metadata["frame_start"]),
            frame_end=int(metadata["frame_end"]),
            latents=tensors.get("latents"),
            video=tensors.get("video"),
            video_frame_start=number("video_frame_start"),
            video_frame_end=number("video_frame_end"),
            latency_ms=number("latency_ms", float),
            seq=number("seq"),
            replayed=replayed,
            metadata=metadata,
        )

    def after(self, frame: int, video_frame: int | None = None) -> Unit:
        """This unit without the latent frames before ``frame`` and the pixel frames before ``video_frame`` (a
        unit resent whole after a reconnect may straddle what the client already has)."""
        skip = max(0, frame - self.frame_start)
        skip_video = 0
        if video_frame is not None and self.video_frame_start is not None:
            skip_video = max(0, video_frame - self.video_frame_start)
        if not skip and not skip_video:
            return self
        changes: dict[str, Any] = {}
        if skip:
            changes["frame_start"] = min(self.frame_start + skip, self.frame_end)
            if self.latents is not None:
                changes["latents"] = self.latents[:, :, skip:]  # (B, C, n - skip, H, W)
        if skip_video and self.video_frame_end is not None:
            changes["video_frame_start"] = min(self.video_frame_start + skip_video, self.video_frame_end)
            if self.video is not None:
                changes["video"] = self.video[:, skip_video:]  # (B, F - skip, ...)
        return replace(self, **changes)


def concat(units: Iterable[Unit], field_name: Literal["latents", "video"] = "latents") -> Array:
    """The units' ``latents`` (frame axis 2) or ``video`` (frame axis 1) joined into one array or tensor."""
    parts = [getattr(unit, field_name) for unit in units]
    parts = [part for part in parts if part is not None]
    if not parts:
        raise ValueError(f"no unit carries {field_name}")
    axis = 2 if field_name == "latents" else 1
    if is_torch(parts[0]):
        import torch

        return torch.cat(parts, dim=axis)
    return np.concatenate(parts, axis=axis)
