"""What a session sends back (api.md 1.1, "Pixels out"): latents, video or both, the video's format and look-ahead,
and how a unit becomes tensors on the wire.

``Outputs`` is per session (fields ``outputs``, ``video_format``, ``video_lookahead`` of its config). A unit's
payload holds a tensor per kind asked for, put there by the kind's stage (``app.stages``: ``latents``
(B, C, n, H, W); ``video``: uint8 (B, F, H_px, W_px, 3) RGB or float32 (B, F, 3, H_px, W_px) in [0, 1]); its
metadata always says ``frame_start`` and ``frame_end`` (latent frames, which a reattach counts in) and what the
stages add (video: ``video_frame_start`` and ``video_frame_end``, pixel frames of the session's video).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    """A finalized unit's payloads on the host, by kind (``app.stages``: latents (B, C, n, H, W), a video's frames,
    ...); ``latent_shape``: its latents' (B, C, n, H, W), which shapes empty outputs."""

    kind: str
    frame_start: int
    frame_end: int
    latent_shape: tuple[int, ...]
    payloads: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(payload.nbytes for payload in self.payloads.values())


def payload(units: list[HostUnit], outputs: Outputs, stages, *, latent_shape: tuple[int, ...], frame_at: int,
            positions: dict[str, int], response_dtype: str) -> tuple[dict, dict]:
    """(tensors, metadata) of ``units`` concatenated (an HTTP response, or one stream unit), each of ``outputs``'
    kinds put on the wire by its stage (``stages``: ``app.stages.OutputStages``). ``latent_shape`` (B, C, n, H, W)
    shapes empty outputs; ``frame_at`` / ``positions`` (by kind): where the stream stands when ``units`` is
    empty."""
    metadata: dict[str, Any] = {}
    if units:
        metadata["frame_start"], metadata["frame_end"] = units[0].frame_start, units[-1].frame_end
    else:
        metadata["frame_start"] = metadata["frame_end"] = frame_at
    tensors, kinds_meta = stages.wire([u.payloads for u in units], outputs, latent_shape, positions, response_dtype)
    return tensors, {**metadata, **kinds_meta}
