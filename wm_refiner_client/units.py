"""Tensors on the wire and the refined units that come back.

Every payload is a safetensors file (docs/api.md "Tensors on the wire"). Inputs may be numpy
arrays or torch tensors (float32, float16 or bfloat16; bfloat16 only as a torch tensor, numpy has no such dtype).
Outputs are numpy arrays (``return_tensors="np"``, the default: no torch needed) or torch tensors (``"pt"``).

Shape letters: B batch, C latent channels, t latent frames, H, W latent height and width, L prompt tokens,
D caption channels, F pixel frames.

Encoded video (``video_format`` ``jpeg`` or ``h264``) arrives as bytes: ``Unit.encoded_video`` (an
``EncodedVideo``: the JPEG images or H.264 segments as they came), decoded into frames on request
(``Unit.decode_video()``, or ``from_payload(..., decode_video=True)``): JPEG with Pillow, H.264 with PyAV, both
imported only then (``formats.FORMATS``: each format's decoder).

A unit holds its payloads by kind (``Unit.payloads``: ``latents``, ``video``, ``preview``, ...; ``unit.preview``
reads the same). Any kind decodes without this module knowing it: a tensor ``{kind}`` is a plain array, or, with a
``{kind}_sizes`` tensor and ``{kind}_format`` metadata naming an encoded format, an ``EncodedVideo`` (the preview's
JPEGs: ``unit.preview.decode()`` is uint8 (B, K, h, w, 3)).
"""

from __future__ import annotations

import json
import struct
from types import MappingProxyType
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Literal, Mapping, Union

import numpy as np

from .errors import ProtocolError
from .formats import FORMATS

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
    from safetensors import SafetensorError, deserialize

    try:
        # safetensors parses and checks the file; each tensor is then read as numpy, bfloat16 (which numpy lacks)
        # widened to float32 exactly (a bfloat16 value is the high half of the float32 of the same value).
        return {name: _as_numpy(view["dtype"], view["data"]).reshape(view["shape"]) for name, view in deserialize(data)}
    except (TypeError, ValueError, KeyError, SafetensorError) as exc:
        raise ValueError(f"a response tensor cannot be read as numpy ({exc}); try return_tensors='pt'") from exc


# safetensors dtypes as numpy reads them (little-endian); BF16 is widened to float32 (``_as_numpy``).
_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                 "U8": "u1", "BOOL": "?"}


def _as_numpy(dtype: str, data) -> np.ndarray:
    if dtype == "BF16":
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(data, dtype=_NUMPY_DTYPES[dtype])


ENCODED_FORMATS = tuple(FORMATS)


@dataclass(frozen=True)
class EncodedVideo:
    """A unit's video as the server encoded it. ``pieces[b]``: row ``b``'s bytes, one JPEG per frame (``jpeg``) or
    one fragmented-MP4 segment (``h264``: the init segment, ``init_sizes[b]`` bytes, then the unit's media segment;
    the init segment is the same for every unit of a session, so a file is the first unit's bytes followed by the
    media segments of the others). ``codec``: ``image/jpeg`` or an RFC 6381 string (``avc1.64001F``) for
    MediaSource. ``skip``: leading frames a resumed unit repeats (H.264 cannot be cut; ``decode`` drops them)."""

    format: str
    codec: str
    quality: int | None
    pieces: tuple[tuple[bytes, ...], ...]
    init_sizes: tuple[int, ...] = ()
    skip: int = 0

    @property
    def nbytes(self) -> int:
        return sum(len(piece) for row in self.pieces for piece in row)

    def __repr__(self) -> str:
        """A summary, not the bytes (a unit's JPEGs are kilobytes each): format, codec, quality, rows (the batch),
        per row its frames (JPEG: one image a frame) or segments (H.264, whose frames are known once decoded; one
        number when every row has as many), bytes in all, and H.264's init sizes and skipped frames when set."""
        counts = [len(row) for row in self.pieces]
        per_row: int | list[int] = counts[0] if len(set(counts)) == 1 else counts
        parts = [f"format={self.format!r}", f"codec={self.codec!r}", f"quality={self.quality!r}",
                 f"rows={len(self.pieces)}", f"{'frames' if self.format == 'jpeg' else 'segments'}={per_row}",
                 f"nbytes={self.nbytes}"]
        if self.init_sizes:
            parts.append(f"init_sizes={self.init_sizes!r}")
        if self.skip:
            parts.append(f"skip={self.skip}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def segment(self, row: int = 0, init: bool = True) -> bytes:
        """H.264: row ``row``'s bytes, with its init segment (``init``) or only the media segment (to append to a
        file or a MediaSource that has the init segment already)."""
        if self.format != "h264":
            raise ValueError(f"segment() is for h264 video; this unit's video is {self.format}")
        data = b"".join(self.pieces[row])
        return data if init or not data else data[self.init_sizes[row]:]

    def decode(self) -> np.ndarray:
        """The frames, uint8 (B, F, H, W, 3) RGB."""
        rows = [self._decode_row(row) for row in range(len(self.pieces))]
        if not rows or not rows[0]:
            return np.zeros((len(rows), 0, 0, 0, 3), dtype=np.uint8)  # no frame: no size to give either
        height, width = rows[0][0].shape[:2]
        return np.stack([np.stack(frames[self.skip:]) if len(frames) > self.skip
                         else np.zeros((0, height, width, 3), dtype=np.uint8) for frames in rows])

    def _decode_row(self, row: int) -> list[np.ndarray]:
        if self.format not in FORMATS:
            raise ValueError(f"cannot decode video format {self.format!r}; this client knows {list(FORMATS)}")
        return FORMATS[self.format].decode(self.pieces[row])

    def after(self, skip: int) -> EncodedVideo:
        """Without the first ``skip`` frames (JPEG drops them; H.264 marks them for ``decode`` to drop)."""
        if skip <= 0:
            return self
        if self.format == "jpeg":
            return replace(self, pieces=tuple(row[skip:] for row in self.pieces))
        return replace(self, skip=self.skip + skip)

    @classmethod
    def join(cls, videos: list[EncodedVideo]) -> EncodedVideo:
        """Consecutive units' video as one (H.264: each row's init segment once, then every media segment)."""
        first = videos[0]
        if any(v.format != first.format for v in videos):
            raise ValueError(f"cannot join units in different video formats {[v.format for v in videos]}")
        rows = []
        for row in range(len(first.pieces)):
            if first.format == "jpeg":
                rows.append(tuple(piece for v in videos for piece in v.pieces[row]))
            else:
                parts = [v.segment(row, init=index == 0) for index, v in enumerate(videos) if v.pieces[row]]
                rows.append((b"".join(parts),) if parts else ())
        with_frames = [v for v in videos if any(v.pieces)]
        init_sizes = with_frames[0].init_sizes if with_frames else first.init_sizes
        return cls(first.format, (with_frames[0] if with_frames else first).codec, first.quality, tuple(rows),
                   init_sizes, first.skip)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Array], metadata: Mapping[str, str],
                     kind: str = "video") -> EncodedVideo:
        """The encoded pieces of ``kind``: tensors ``{kind}`` (the bytes) and ``{kind}_sizes`` (B, K) (H.264:
        ``{kind}_init_sizes`` (B,)), metadata ``{kind}_format``, ``{kind}_codec`` and ``{kind}_quality``."""
        data = bytes(np.asarray(_numpy(tensors[kind])).tobytes())
        sizes = np.asarray(_numpy(tensors[f"{kind}_sizes"])).astype(np.int64)
        pieces, at = [], 0
        for row in sizes.tolist():
            pieces.append(tuple(data[at + sum(row[:i]) : at + sum(row[: i + 1])] for i in range(len(row))))
            at += sum(row)
        if at != len(data):
            raise ValueError(f"{kind}_sizes add up to {at} bytes but {kind} holds {len(data)}")
        init = tensors.get(f"{kind}_init_sizes")
        quality = metadata.get(f"{kind}_quality")
        return cls(metadata[f"{kind}_format"], metadata.get(f"{kind}_codec", ""),
                   int(quality) if quality not in (None, "None") else None, tuple(pieces),
                   tuple(int(v) for v in np.asarray(_numpy(init)).tolist()) if init is not None else ())


def payloads_of(tensors: Mapping[str, Array], metadata: Mapping[str, str]) -> dict[str, Any]:
    """A response's payloads by kind. A tensor named ``{kind}_...`` beside a tensor ``{kind}`` belongs to that kind
    (``video_sizes``); a kind with ``{kind}_sizes`` and an encoded ``{kind}_format`` is an ``EncodedVideo``, any
    other a plain array."""
    payloads: dict[str, Any] = {}
    for name, value in tensors.items():
        if any(name.startswith(other + "_") for other in tensors if other != name):
            continue
        if metadata.get(f"{name}_format") in ENCODED_FORMATS and f"{name}_sizes" in tensors:
            payloads[name] = EncodedVideo.from_tensors(tensors, metadata, name)
        else:
            payloads[name] = value
    return payloads


def spec_kinds() -> tuple[str, ...]:
    """The output kinds this client knows (``spec.KINDS``): ``unit.<kind>`` is None, not an error, without one."""
    from . import spec

    return spec.BY_NAME["outputs"].choices


def _numpy(value: Array) -> np.ndarray:
    return value.numpy() if is_torch(value) else value


@dataclass(frozen=True)
class Unit:
    """Refined frames as the server finalized them: latent frames ``[frame_start, frame_end)`` of the session
    (the sink frames once, then each refined block) and, for sessions with video outputs, pixel frames
    ``[video_frame_start, video_frame_end)`` of the session's video.

    ``latents``: (B, C, n, H, W), None when the session's outputs exclude latents. ``video``: uint8
    (B, F, H_px, W_px, 3) RGB or float32 (B, F, 3, H_px, W_px) in [0, 1], None without video outputs, and for
    encoded video (``jpeg``, ``h264``) until decoded: ``encoded_video`` holds its bytes, ``decode_video()`` the
    frames. ``video_error``: the server could not encode this unit's video as asked and sent it as uint8 instead.
    ``seq`` and ``latency_ms``, on every unit (HTTP chunks, refine, streams, watchers; None only from a server
    older than both): the index of the chunk (HTTP request or stream message, the flush included) that finalized
    it, and the server's milliseconds from that chunk having been read to the unit being ready (api.md defines
    it). ``replayed``: the server returned its stored response to a retried seq."""

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
    encoded_video: EncodedVideo | None = None
    video_error: str | None = None
    payloads: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        merged = dict(self.payloads)
        if self.latents is None and merged.get("latents") is not None:
            object.__setattr__(self, "latents", merged["latents"])
        video = merged.get("video")
        if self.video is None and self.encoded_video is None and video is not None:
            object.__setattr__(self, "encoded_video" if isinstance(video, EncodedVideo) else "video", video)
        merged.pop("latents", None)
        merged.pop("video", None)
        fields = {"latents": self.latents, "video": self.video if self.video is not None else self.encoded_video}
        merged = {**{kind: value for kind, value in fields.items() if value is not None}, **merged}
        object.__setattr__(self, "payloads", MappingProxyType(merged))

    def __getattr__(self, name: str) -> Any:
        """``unit.preview`` and any other kind's payload (None when the unit has none) by its name."""
        payloads = self.__dict__.get("payloads")
        if payloads is not None and not name.startswith("_") and name in spec_kinds():
            return payloads.get(name)
        if payloads is not None and name in payloads:
            return payloads[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
    def from_payload(cls, data: bytes, return_tensors: ReturnTensors = "np", replayed: bool = False,
                     decode_video: bool = False) -> Unit:
        """``decode_video``: encoded video decoded into ``video`` (uint8 (B, F, H, W, 3)) right away. A payload that is
        not a unit (not safetensors, truncated, absurd shapes, frame numbers that are not numbers or that disagree
        with its latents) is a ``ProtocolError`` naming what is wrong."""
        try:
            unit = cls._from_payload(data, return_tensors, replayed)
        except ProtocolError:
            raise
        except Exception as exc:  # safetensors' and numpy's own errors: the server sent something that is no unit
            raise ProtocolError(f"the server sent a unit this client cannot read ({len(data)} bytes: "
                                f"{type(exc).__name__}: {exc})") from exc
        frames = unit.frame_end - unit.frame_start
        latents = unit.latents
        if frames < 0 or unit.frame_start < 0:
            raise ProtocolError(f"the server sent a unit of frames [{unit.frame_start}, {unit.frame_end})")
        if latents is not None and len(latents.shape) == 5 and int(latents.shape[2]) != frames:
            raise ProtocolError(f"the server sent a unit of frames [{unit.frame_start}, {unit.frame_end}) whose "
                                f"latents hold {int(latents.shape[2])} frames")
        return unit.decode_video() if decode_video and unit.encoded_video is not None else unit

    @classmethod
    def _from_payload(cls, data: bytes, return_tensors: ReturnTensors, replayed: bool) -> Unit:
        metadata = read_metadata(data)
        tensors = decode(data, return_tensors)
        if "frame_start" not in metadata or "frame_end" not in metadata:
            raise ProtocolError(f"the server sent a unit without frame_start/frame_end metadata (got "
                                f"{sorted(metadata)})")

        def number(name: str, kind=int):
            return kind(metadata[name]) if name in metadata else None

        return cls(
            frame_start=int(metadata["frame_start"]),
            frame_end=int(metadata["frame_end"]),
            payloads=payloads_of(tensors, metadata),
            video_frame_start=number("video_frame_start"),
            video_frame_end=number("video_frame_end"),
            latency_ms=number("latency_ms", float),
            seq=number("seq"),
            replayed=replayed,
            metadata=metadata,
            video_error=metadata.get("video_error"),
        )

    def decode_video(self) -> Unit:
        """This unit with ``video`` holding its encoded video's frames, uint8 (B, F, H, W, 3) RGB (numpy, or torch
        when its latents are torch tensors); itself when there is nothing to decode."""
        if self.encoded_video is None or self.video is not None:
            return self
        frames = self.encoded_video.decode()
        if self.latents is not None and is_torch(self.latents):
            import torch

            frames = torch.from_numpy(frames)
        return replace(self, video=frames)

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
            if self.encoded_video is not None:
                changes["encoded_video"] = self.encoded_video.after(skip_video)
        return replace(self, **changes)


def concat(units: Iterable[Unit], field_name: Literal["latents", "video"] = "latents") -> Array:
    """The units' ``latents`` (frame axis 2) or ``video`` (frame axis 1) joined into one array or tensor (encoded
    video decoded first). Units without frames add nothing: an encoded unit with no frame (the first units of a
    session whose decoder is still filling its look-ahead) decodes to (B, 0, 0, 0, 3), not the session's size."""
    if field_name == "video":
        units = [unit.decode_video() for unit in units]
    parts = [getattr(unit, field_name) for unit in units]
    parts = [part for part in parts if part is not None]
    if not parts:
        raise ValueError(f"no unit carries {field_name}")
    axis = 2 if field_name == "latents" else 1
    parts = [part for part in parts if part.shape[axis]] or parts[:1]
    if is_torch(parts[0]):
        import torch

        return torch.cat(parts, dim=axis)
    return np.concatenate(parts, axis=axis)
