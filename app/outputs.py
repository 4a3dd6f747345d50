"""What a session sends back (api.md 1.1, "Pixels out"): latents, video or both, the video's format and look-ahead,
and how a unit becomes tensors on the wire.

``Outputs`` is per session (fields ``outputs``, ``video_format``, ``video_lookahead`` of its config). A unit's
payload holds ``latents`` (B, C, n, H, W) when ``"latents"`` is asked for, ``video`` when ``"video"`` is: uint8
(B, F, H_px, W_px, 3) RGB or float32 (B, F, 3, H_px, W_px) in [0, 1]; its metadata always says ``frame_start`` and
``frame_end`` (latent frames, which a reattach counts in) and, with video, ``video_frame_start`` and
``video_frame_end`` (pixel frames of the session's video).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from models.vae import video_tensor
from wm_refiner_client import spec

from .errors import ApiError

LATENTS, VIDEO = "latents", "video"
OUTPUT_KINDS = spec.BY_NAME["outputs"].choices
VIDEO_FORMATS = spec.BY_NAME["video_format"].choices
EXACT = spec.EXACT
OUTPUT_FIELDS = spec.OUTPUT_NAMES


@dataclass(frozen=True)
class Outputs:
    kinds: tuple[str, ...] = (LATENTS,)
    video_format: str = "uint8"
    video_lookahead: int | None = None  # None: "exact"

    @property
    def latents(self) -> bool:
        return LATENTS in self.kinds

    @property
    def video(self) -> bool:
        return VIDEO in self.kinds

    def to_dict(self) -> dict[str, Any]:
        return {
            "outputs": list(self.kinds),
            "video_format": self.video_format,
            "video_lookahead": EXACT if self.video_lookahead is None else self.video_lookahead,
        }

    @classmethod
    def from_fields(cls, fields: dict[str, Any], vae_configured: bool) -> Outputs:
        """From a session config's fields as JSON values (absent = default; text goes through
        ``spec.SessionField.from_text`` first); ApiError 422 saying what to send instead."""
        try:
            kinds = spec.output_kinds(fields.get("outputs"))
            lookahead = spec.lookahead_frames(fields.get("video_lookahead"))
        except ValueError as exc:
            raise ApiError("invalid_config", str(exc)) from None
        if VIDEO in kinds and not vae_configured:
            raise ApiError(
                "invalid_config",
                "outputs includes 'video' but this server has no VAE (setting vae, flag --vae); ask for "
                "outputs ['latents'] or configure the server with an AutoencoderKLLTX2Video folder",
            )
        video_format = fields.get("video_format") or spec.BY_NAME["video_format"].default
        if video_format not in VIDEO_FORMATS:
            raise ApiError("invalid_config", f"video_format must be one of {list(VIDEO_FORMATS)}, got {video_format!r}")
        return cls(kinds, video_format, lookahead)

    def restrict(self, asked: str | None) -> Outputs:
        """The outputs a watcher asks for (``?outputs=video``), a subset of the session's; ApiError otherwise."""
        if asked is None:
            return self
        kinds = spec.BY_NAME["outputs"].from_text(asked)
        unknown = [k for k in kinds if k not in OUTPUT_KINDS]
        if not kinds or unknown:
            raise ApiError("invalid_request", f"outputs={asked!r}: ask for 'latents', 'video' or 'latents,video'")
        missing = [k for k in kinds if k not in self.kinds]
        if missing:
            raise ApiError(
                "invalid_request",
                f"this session does not produce {missing} (its outputs are {list(self.kinds)}); ask for a subset",
            )
        return Outputs(tuple(k for k in OUTPUT_KINDS if k in kinds), self.video_format, self.video_lookahead)


@dataclass(frozen=True)
class HostUnit:
    """A finalized unit's tensors on the host: latents (B, C, n, H, W); video frames (B, 3, f, H_px, W_px) in
    [-1, 1] or None when it has none (``video_start == video_end``)."""

    kind: str
    frame_start: int
    frame_end: int
    latents: torch.Tensor
    video: torch.Tensor | None = None
    video_start: int = 0
    video_end: int = 0

    @property
    def nbytes(self) -> int:
        return self.latents.nbytes + (0 if self.video is None else self.video.nbytes)


def payload(units: list[HostUnit], outputs: Outputs, *, latent_shape: tuple[int, ...], spatial_scale: int,
            frame_at: int, video_at: int, response_dtype: str) -> tuple[dict, dict]:
    """(tensors, metadata) of ``units`` concatenated (an HTTP response, or one stream unit). ``latent_shape``
    (B, C, n, H, W) shapes empty latents and, times ``spatial_scale`` (the VAE's), empty video; ``frame_at`` /
    ``video_at``: the position to report when ``units`` is empty."""
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, Any] = {}
    if units:
        metadata["frame_start"], metadata["frame_end"] = units[0].frame_start, units[-1].frame_end
    else:
        metadata["frame_start"] = metadata["frame_end"] = frame_at
    batch, channels, _, height, width = latent_shape
    if outputs.latents:
        latents = torch.cat([u.latents for u in units], dim=2) if units else torch.zeros(batch, channels, 0, height, width)
        tensors[LATENTS] = latents.float() if response_dtype == "float32" else latents
    if outputs.video:
        with_video = [u for u in units if u.video is not None]
        frames = torch.cat([u.video for u in with_video], dim=2) if with_video else None
        start = with_video[0].video_start if with_video else (units[-1].video_end if units else video_at)
        video = video_tensor(frames, outputs.video_format, batch, height * spatial_scale, width * spatial_scale)
        tensors[VIDEO] = video
        metadata["video_frame_start"], metadata["video_frame_end"] = start, start + int(video.shape[1])
    return tensors, metadata
