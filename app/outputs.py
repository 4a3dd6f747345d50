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

from .errors import ApiError

LATENTS, VIDEO = "latents", "video"
OUTPUT_KINDS = (LATENTS, VIDEO)
VIDEO_FORMATS = ("uint8", "float32")
EXACT = "exact"
OUTPUT_FIELDS = ("outputs", "video_format", "video_lookahead")


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
        """From a session config's fields (absent = default); ApiError 422 saying what to send instead."""
        kinds = fields.get("outputs")
        if kinds is None:
            kinds = [LATENTS]
        if isinstance(kinds, str):
            kinds = [part for part in kinds.split(",") if part]
        if not isinstance(kinds, (list, tuple)) or not kinds or any(k not in OUTPUT_KINDS for k in kinds):
            raise ApiError("invalid_config", f"outputs must be a non-empty list of {list(OUTPUT_KINDS)}, got {kinds!r}")
        if len(set(kinds)) != len(kinds):
            raise ApiError("invalid_config", f"outputs lists a kind twice: {list(kinds)}; list each at most once")
        kinds = tuple(kind for kind in OUTPUT_KINDS if kind in kinds)  # a canonical order
        if VIDEO in kinds and not vae_configured:
            raise ApiError(
                "invalid_config",
                "outputs includes 'video' but this server has no VAE (setting vae, flag --vae); ask for "
                "outputs ['latents'] or configure the server with an AutoencoderKLLTX2Video folder",
            )
        video_format = fields.get("video_format") or "uint8"
        if video_format not in VIDEO_FORMATS:
            raise ApiError("invalid_config", f"video_format must be one of {list(VIDEO_FORMATS)}, got {video_format!r}")
        lookahead = fields.get("video_lookahead", EXACT)
        if lookahead is None or lookahead == EXACT:
            lookahead = None
        else:
            if isinstance(lookahead, str) and lookahead.isdigit():
                lookahead = int(lookahead)
            if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
                raise ApiError(
                    "invalid_config",
                    f"video_lookahead must be \"exact\" or an integer >= 0 (latent frames), got {lookahead!r}",
                )
        return cls(kinds, video_format, lookahead)

    def restrict(self, asked: str | None) -> Outputs:
        """The outputs a watcher asks for (``?outputs=video``), a subset of the session's; ApiError otherwise."""
        if asked is None:
            return self
        kinds = [part for part in asked.split(",") if part]
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
