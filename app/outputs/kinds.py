"""What a session sends back (api.md 1.1, "Pixels out"): the kinds it asked for (latents, video, preview, ...),
each kind's options (the video's format, quality and look-ahead, the preview's width), and how a unit becomes
tensors on the wire.

``Outputs`` is per session (its config's fields of part ``outputs``: ``spec.OUTPUT_NAMES``); a watcher may ask for
a subset of the kinds and another video format (``Outputs.restrict``). Nothing here names a kind's options: each
kind's stage class (``app.outputs.catalog.STAGE_TYPES``) reads and validates its own (``OutputStage.read_options``), and
says what it needs loaded (``requires``) and encoded (``encoder``). A unit's payload holds a tensor per kind asked
for, put there by the kind's stage (``app.outputs.stage``: ``latents`` (B, C, n, H, W); ``video``: uint8
(B, F, H_px, W_px, 3) RGB or float32 (B, F, 3, H_px, W_px) in [0, 1]; ``preview``: JPEG bytes); its metadata always
says ``frame_start`` and ``frame_end`` (latent frames, which a reattach counts in) and what the stages add (video:
``video_frame_start`` and ``video_frame_end``, pixel frames of the session's video).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from wm_refiner_client import formats, spec

from app.core.error_kinds import ApiError

LATENTS, VIDEO = "latents", "video"
OUTPUT_KINDS = spec.BY_NAME["outputs"].choices
VIDEO_FORMATS = spec.BY_NAME["video_format"].choices
EXACT = spec.EXACT
OUTPUT_FIELDS = spec.OUTPUT_NAMES


# The library each encoded format needs (the optional ``video`` extra): (module, its package's name).
ENCODER_MODULES = {name: f.library for name, f in formats.FORMATS.items()}


def encoder_missing(video_format: str) -> str | None:
    """Why this process cannot encode ``video_format`` (its library does not import), or None when it can.

    Asked when a session or a watch chooses the format, so the client hears it as a 422 at once rather than as
    an encoding failure logged at its first unit. Imported, not looked up: a library present but broken (a missing
    FFmpeg shared library) counts as missing too; after the first import it is a dictionary lookup."""
    if video_format not in ENCODER_MODULES:
        return None
    module, package = ENCODER_MODULES[video_format]
    try:
        __import__(module)
    except ImportError as exc:
        return (f"video_format {video_format!r} needs {package}, which this server cannot import ({exc}); install "
                "the server with its video extra (pip install -e '.[video]'), or ask for video_format 'uint8' or "
                "'float32'")
    return None


@dataclass(frozen=True)
class Outputs:
    kinds: tuple[str, ...] = (LATENTS,)
    video_format: str = "uint8"
    video_lookahead: int | None = None  # None: "exact"
    video_quality: int | None = None  # the JPEG quality or H.264 CRF (spec.video_quality); None for raw formats
    fps: float = 16.0  # the session's frame rate: the H.264 segments' timing (not a field of its own)
    # The other kinds' option values, (name, JSON value) pairs as their stages read them (``preview_width``); an
    # option left out has its spec default.
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def latents(self) -> bool:
        return LATENTS in self.kinds

    @property
    def video(self) -> bool:
        return VIDEO in self.kinds

    def option(self, name: str) -> Any:
        """A kind's option (not the video's own fields): its value, or the spec's default when it was left out."""
        return dict(self.options).get(name, spec.BY_NAME[name].default_json())

    def to_dict(self) -> dict[str, Any]:
        video = {
            "outputs": list(self.kinds),
            "video_format": self.video_format,
            "video_lookahead": EXACT if self.video_lookahead is None else self.video_lookahead,
            "video_quality": spec.AUTO if self.video_quality is None else self.video_quality,
        }
        return {**video, **{name: self.option(name) for name in OUTPUT_FIELDS if name not in video}}

    def restrict(self, asked: str | None, video_format: str | None = None, video_quality: str | None = None,
                 ) -> Outputs:
        """The outputs a watcher asks for (``?outputs=video&video_format=jpeg&video_quality=80``): a subset of the
        session's kinds, and the video in any format (a format other than the session's starts at its own "auto"
        quality); ApiError otherwise. Watchers asking for the same outputs share one encoding of each unit."""
        outputs = self if asked is None else self._subset(asked)
        if video_format is None and video_quality is None:
            return outputs
        if not outputs.video:
            raise ApiError("invalid_request", f"video_format/video_quality choose how video is sent, but this watch "
                                              f"gets no video (outputs {list(outputs.kinds)}); leave them out")
        fmt = self.video_format if video_format is None else video_format
        if fmt not in VIDEO_FORMATS:
            raise ApiError("invalid_request", f"video_format={fmt!r}: ask for one of {list(VIDEO_FORMATS)}")
        try:
            if video_quality is not None:
                quality = spec.video_quality(fmt, spec.BY_NAME["video_quality"].from_text(video_quality))
            elif fmt == self.video_format:
                quality = self.video_quality
            else:
                quality = spec.video_quality(fmt, None)
        except ValueError as exc:
            raise ApiError("invalid_request", str(exc)) from None
        missing = encoder_missing(fmt)
        if missing is not None:
            raise ApiError("invalid_request", missing)
        return replace(outputs, video_format=fmt, video_quality=quality)

    def _subset(self, asked: str) -> Outputs:
        kinds = spec.BY_NAME["outputs"].from_text(asked)
        unknown = [k for k in kinds if k not in OUTPUT_KINDS]
        if not kinds or unknown:
            raise ApiError("invalid_request", f"outputs={asked!r}: ask for one or more of {list(OUTPUT_KINDS)}, "
                                              "comma-separated (latents,video)")
        if len(set(kinds)) != len(kinds):  # as a session's config refuses it (spec.output_kinds)
            raise ApiError("invalid_request", f"outputs={asked!r} lists a kind twice; list each at most once")
        missing = [k for k in kinds if k not in self.kinds]
        if missing:
            raise ApiError(
                "invalid_request",
                f"this session does not produce {missing} (its outputs are {list(self.kinds)}); ask for a subset",
            )
        return replace(self, kinds=tuple(k for k in OUTPUT_KINDS if k in kinds))


@dataclass(frozen=True)
class HostUnit:
    """A finalized unit's payloads on the host, by kind (``app.outputs.stage``: latents (B, C, n, H, W), a video's frames,
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
    kinds put on the wire by its stage (``stages``: ``app.outputs.stage.OutputStages``). ``latent_shape`` (B, C, n, H, W)
    shapes empty outputs; ``frame_at`` / ``positions`` (by kind): where the stream stands when ``units`` is
    empty."""
    metadata: dict[str, Any] = {}
    if units:
        metadata["frame_start"], metadata["frame_end"] = units[0].frame_start, units[-1].frame_end
    else:
        metadata["frame_start"] = metadata["frame_end"] = frame_at
    tensors, kinds_meta = stages.wire([u.payloads for u in units], outputs, latent_shape, positions, response_dtype)
    return tensors, {**metadata, **kinds_meta}
