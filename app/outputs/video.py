"""The video output: each committed unit decoded by the VAE into the pixel frames that became final with it.

Its state is the session's ``models.vae.VideoStream`` (the decoder's temporal state and what was emitted):
immutable, so atomic work's rollback point is the stream from before it. Decoding is costly, so the stage is
*deferred*: the engine runs it as an output step between model calls (``app.engine.scheduler``), and the session's next
block already runs meanwhile. A flush that refined no block still finishes the video's tail. The payload is a
``models.vae.VideoChunk`` (frames (B, 3, n, H_px, W_px) in [-1, 1], or none, from video frame ``start``); on the
wire it is ``video``: uint8 (B, F, H_px, W_px, 3) RGB or float32 (B, F, 3, H_px, W_px) in [0, 1], with metadata
``video_frame_start`` and ``video_frame_end``.

The encoded formats (``jpeg``, ``h264``: ``app.outputs.encoders``) put the bytes on the wire instead: ``video`` uint8
(N,) (every piece, row-major), ``video_sizes`` int64 (B, K) (the bytes of each: a JPEG per frame, or a row's
H.264 segment), ``video_init_sizes`` int64 (B,) (H.264: the init segment at the start of each row's bytes), with
metadata ``video_format``, ``video_codec`` and ``video_quality``. A unit is encoded once per (format, quality,
frame rate) whoever asks (the producer, every watcher): the encoding is kept on its ``HostVideo``. An encoding
that fails loses nothing: the unit goes out as uint8 frames with ``video_format`` uint8 and ``video_error`` saying
why.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import torch

from models.config import SessionConfig
from models.session import Unit
from models.transfer import HostCopy
from models.vae import StreamingDecoder, VideoChunk, VideoStream, new_video, push_video, video_from_tensors, \
    video_tensor, video_to_tensors

from wm_refiner_client import formats, spec

from app.outputs.encoders import ENCODED_FORMATS, H264, EncodedVideo, encode_video
from app.outputs.kinds import VIDEO, VIDEO_FORMATS, Outputs, encoder_missing
from app.outputs.stage import OutputStage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostVideo:
    """A unit's video frames on the host: (B, 3, n, H_px, W_px) in [-1, 1] or None, video frames [start, end), and
    its encodings so far (shared by whoever sends the unit)."""

    frames: torch.Tensor | None
    start: int
    end: int
    _encoded: dict = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)  # guards _locks
    _locks: dict = field(default_factory=dict, compare=False, repr=False)  # one per encoding

    @property
    def nbytes(self) -> int:
        return 0 if self.frames is None else self.frames.nbytes

    def encoded(self, video_format: str, quality: int, fps: float, batch: int, height: int,
                width: int) -> EncodedVideo:
        """This unit's frames in ``video_format``, encoded by the first caller (the others wait for it, then share
        it); an encoding that failed fails again for each caller (it is not retried: it would fail the same way).
        One lock per encoding, not per unit: a producer's JPEG never waits behind a watcher's H.264 of the same
        unit (issue 25 item 7)."""
        key = (video_format, quality, fps)
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._encoded:
                try:
                    frames = video_tensor(self.frames, "uint8", batch, height, width).numpy()
                    self._encoded[key] = encode_video(frames, video_format, quality, self.start, fps)
                except Exception as exc:  # kept: the unit goes out raw, with the error, for every caller
                    self._encoded[key] = exc
            found = self._encoded[key]
        if isinstance(found, Exception):
            raise found
        return found


class VideoStage(OutputStage):
    kind = VIDEO
    action = "decoding this session's video"
    deferred = True
    requires = "vae"
    wire_names = (VIDEO, "video_sizes", "video_init_sizes")

    @classmethod
    def read_options(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """``video_format``, ``video_quality`` (its reading depends on the format) and ``video_lookahead``, the
        fields of ``Outputs`` of the same names."""
        lookahead = spec.lookahead_frames(fields.get("video_lookahead"))
        video_format = fields.get("video_format") or spec.BY_NAME["video_format"].default
        if video_format not in VIDEO_FORMATS:
            raise ValueError(f"video_format must be one of {list(VIDEO_FORMATS)}, got {video_format!r}")
        quality = spec.video_quality(video_format, fields.get("video_quality"))
        return {"video_format": video_format, "video_quality": quality, "video_lookahead": lookahead}

    @classmethod
    def encoder_missing(cls, outputs: Outputs) -> str | None:
        return encoder_missing(outputs.video_format)

    def __init__(self, decoder: StreamingDecoder):
        self.decoder = decoder

    def new_state(self, outputs: Outputs, config: SessionConfig) -> VideoStream:
        # The reference drops the sink's pixel frames.
        return new_video(self.decoder, drop=config.sink_frames, lookahead=outputs.video_lookahead)

    def push(self, state: VideoStream, unit: Unit, final: bool) -> tuple[VideoStream, VideoChunk]:
        latents = unit.latents if unit.frame_end > unit.frame_start else None
        return push_video(self.decoder, state, latents, final=final)

    def finish(self, state: VideoStream) -> tuple[VideoStream, VideoChunk]:
        return push_video(self.decoder, state, None, final=True)

    def done(self, state: VideoStream) -> bool:
        return state.state.finished

    def nbytes(self, state: VideoStream) -> int:
        return state.nbytes

    def position(self, state: VideoStream) -> int:
        return self.status(state)["video_frames_returned"]

    @classmethod
    def status(cls, state: VideoStream | None) -> dict[str, Any]:
        # The decoder's temporal state and the video frames returned so far (0 and 0 without video).
        return {"video_state_bytes": 0 if state is None else state.nbytes,
                "video_frames_returned": 0 if state is None else max(state.emitted - state.drop, 0)}

    @classmethod
    def build(cls, decoder: StreamingDecoder | None = None, **loaded) -> OutputStage | str:
        return "this server has no VAE (setting vae)" if decoder is None else cls(decoder)

    def to_tensors(self, state: VideoStream, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return video_to_tensors(state, prefix)

    def from_tensors(self, tensors: dict[str, torch.Tensor], fields: Any, prefix: str) -> VideoStream:
        if fields is None:
            raise ValueError("the snapshot holds no decoder state for its video")
        return video_from_tensors(self.decoder, tensors, fields, prefix)

    def to_host(self, payload: VideoChunk) -> Callable[[], HostVideo]:
        copy = None if payload.frames is None else HostCopy(payload.frames)
        return lambda: HostVideo(None if copy is None else copy.wait(), payload.start, payload.end)

    def wire(self, payloads: list[HostVideo], outputs: Outputs, shape: tuple[int, ...], at: int,
             response_dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        batch, _, _, height, width = shape
        scale = self.decoder.spatial_compression
        if outputs.video_format in ENCODED_FORMATS:
            try:
                return encoded_wire(payloads, outputs, batch, height * scale, width * scale, at)
            except Exception as exc:
                log.warning("encoding video as %s failed (%r); sent as uint8 frames", outputs.video_format, exc)
                tensors, metadata = self._raw_wire(payloads, "uint8", batch, height * scale, width * scale, at)
                return tensors, {**metadata, "video_format": "uint8",
                                 "video_error": f"encoding as {outputs.video_format} failed ({exc}); sent as uint8"}
        return self._raw_wire(payloads, outputs.video_format, batch, height * scale, width * scale, at)

    @staticmethod
    def _raw_wire(payloads: list[HostVideo], video_format: str, batch: int, height: int, width: int,
                  at: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        with_frames = [p for p in payloads if p.frames is not None]
        frames = torch.cat([p.frames for p in with_frames], dim=2) if with_frames else None
        start = with_frames[0].start if with_frames else (payloads[-1].end if payloads else at)
        video = video_tensor(frames, video_format, batch, height, width)
        return {VIDEO: video}, {"video_frame_start": start, "video_frame_end": start + int(video.shape[1])}


def encoded_wire(payloads: list[HostVideo], outputs: Outputs, batch: int, height: int, width: int,
                 at: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Consecutive units' video as one encoded piece list: JPEG frames one after another; H.264 each row's init
    segment once, then every unit's media segment (a valid fragmented MP4)."""
    fmt = outputs.video_format
    with_frames = [p for p in payloads if p.frames is not None and p.end > p.start]
    start = with_frames[0].start if with_frames else (payloads[-1].end if payloads else at)
    end = with_frames[-1].end if with_frames else start
    parts = [p.encoded(fmt, outputs.video_quality, outputs.fps, batch, height, width) for p in with_frames]
    rows: list[list[bytes]] = [[] for _ in range(batch)]
    init_sizes = np.zeros(batch, dtype=np.int64)
    # Without frames there is no stream to describe yet: the format's own label (the codec's family alone).
    codec = parts[0].codec if parts else formats.FORMATS[fmt].codec
    for index, part in enumerate(parts):
        for row, pieces in enumerate(pieces_of(part)):
            if fmt == H264:
                init = int(part.init_sizes[row])
                rows[row].append(pieces[0] if index == 0 else pieces[0][init:])
                if index == 0:
                    init_sizes[row] = init
            else:
                rows[row].extend(pieces)
    if fmt == H264:
        rows = [[b"".join(pieces)] if pieces else [] for pieces in rows]
    width_k = max((len(pieces) for pieces in rows), default=0)
    lengths = [[len(piece) for piece in pieces] for pieces in rows]
    sizes = torch.tensor(lengths, dtype=torch.int64).reshape(batch, width_k)
    data = b"".join(piece for pieces in rows for piece in pieces)
    video = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    tensors = {VIDEO: video, "video_sizes": sizes}
    if fmt == H264:
        tensors["video_init_sizes"] = torch.from_numpy(init_sizes)
    metadata = {"video_frame_start": start, "video_frame_end": end, "video_format": fmt, "video_codec": codec,
                "video_quality": outputs.video_quality}
    return tensors, metadata


def pieces_of(video: EncodedVideo) -> list[list[bytes]]:
    """Each row's pieces (JPEG images, or its one H.264 segment) as bytes."""
    pieces, at = [], 0
    for row in video.sizes.tolist():
        pieces.append([])
        for size in row:
            pieces[-1].append(video.data[at : at + size])
            at += size
    return pieces

