"""The video output: each committed unit decoded by the VAE into the pixel frames that became final with it.

Its state is the session's ``models.vae.VideoStream`` (the decoder's temporal state and what was emitted):
immutable, so atomic work's rollback point is the stream from before it. Decoding is costly, so the stage is
*deferred*: the engine runs it as an output step between model calls (``app.scheduler``), and the session's next
block already runs meanwhile. A flush that refined no block still finishes the video's tail. The payload is a
``models.vae.VideoChunk`` (frames (B, 3, n, H_px, W_px) in [-1, 1], or none, from video frame ``start``); on the
wire it is ``video``: uint8 (B, F, H_px, W_px, 3) RGB or float32 (B, F, 3, H_px, W_px) in [0, 1], with metadata
``video_frame_start`` and ``video_frame_end``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from models.config import SessionConfig
from models.session import Unit
from models.transfer import HostCopy
from models.vae import StreamingDecoder, VideoChunk, VideoStream, new_video, push_video, video_from_tensors, \
    video_tensor, video_to_tensors

from ..outputs import VIDEO, Outputs
from . import OutputStage


@dataclass(frozen=True)
class HostVideo:
    """A unit's video frames on the host: (B, 3, n, H_px, W_px) in [-1, 1] or None, video frames [start, end)."""

    frames: torch.Tensor | None
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return 0 if self.frames is None else self.frames.nbytes


class VideoStage(OutputStage):
    kind = VIDEO
    action = "decoding this session's video"
    deferred = True

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
        with_frames = [p for p in payloads if p.frames is not None]
        frames = torch.cat([p.frames for p in with_frames], dim=2) if with_frames else None
        start = with_frames[0].start if with_frames else (payloads[-1].end if payloads else at)
        video = video_tensor(frames, outputs.video_format, batch, height * scale, width * scale)
        return {VIDEO: video}, {"video_frame_start": start, "video_frame_end": start + int(video.shape[1])}

