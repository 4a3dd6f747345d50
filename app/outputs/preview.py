"""The preview output: one small JPEG per unit, for session lists, dashboards and the view page's list.

Decisions, and why:

- **Which frame:** the unit's *last* video frame. A list or a dashboard shows where a session stands now, and the
  last frame is the newest one a viewer has; the tail of a flush gets one too (the video's last frames).
- **Which pixels:** the video stage's, never a decode of its own. The stage ``needs`` the video: the session runs
  the video stage first and hands its payload of the same unit to ``derive`` (``app.outputs.stage.SessionStages``), so a
  session that asks for video and preview decodes once, and one that asks for preview alone runs the video stage
  too, unsent (its frames never leave the device). That is also why the VAE is required and why the stage is
  cheap enough to run inside the video's output step: one frame is resized on the device, where the frames are.
- **Size:** exactly ``preview_width`` pixels wide (the session option, 16 to 1024, default 160), the height
  ``round(H_px * preview_width / W_px)`` (at least 1): every preview of a session has one size whatever the video's,
  so a list lays them out alike; a video narrower than that is scaled up. Bilinear with antialiasing (torch's, as
  Pillow resizes), from the decoded frame as the video sends it (clamped to [0, 1]), rounded to uint8 as the
  video's uint8 format is.
- **Encoding:** JPEG (quality: the format's "auto", 85) once per unit on the host, in the encoder pool that waits
  for the copy (``to_host``): the response and every watcher share the bytes.
- **Wire form:** that of JPEG video frames (``app.outputs.video``): ``preview`` uint8 (N,) the JPEG bytes of every
  preview (row-major), ``preview_sizes`` int64 (B, K) the bytes of each (K: the units in the response that had video
  frames; a unit whose video frames are still to come has no preview), metadata ``preview_format`` (jpeg),
  ``preview_codec`` (image/jpeg), ``preview_quality``, ``preview_width``, ``preview_height`` and ``preview_frames``
  (the video frame each preview shows, comma-separated). The client decodes it as it decodes JPEG video
  (``wm_refiner_client.units.EncodedVideo``): no decoder of its own.

Its state is the session's preview width (an int: immutable, nothing on the device, a snapshot keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from models.config import SessionConfig
from models.transfer import HostCopy
from models.vae import StreamingDecoder, VideoChunk
from wm_refiner_client.formats import FORMATS

from app.outputs.encoders import JPEG, encode_jpeg
from app.outputs.kinds import Outputs
from app.outputs.stage import OutputStage
from app.outputs.video import pieces_of

PREVIEW = "preview"
QUALITY = FORMATS[JPEG].quality[2]  # the JPEG "auto" quality: previews have no quality option of their own


def preview_height(height: int, width: int, preview_width: int) -> int:
    """The height of a ``preview_width`` wide preview of ``width`` x ``height`` frames (the aspect ratio kept)."""
    return max(1, round(height * preview_width / width))


@dataclass(frozen=True)
class Thumbnail:
    """A unit's preview on the device: uint8 (B, h, w, 3) RGB of video frame ``frame``."""

    images: torch.Tensor
    frame: int


@dataclass(frozen=True)
class HostPreview:
    """A unit's preview on the host: each batch row's JPEG, of video frame ``frame``, ``width`` x ``height``."""

    jpegs: tuple[bytes, ...]
    frame: int
    width: int
    height: int

    @property
    def nbytes(self) -> int:
        return sum(len(jpeg) for jpeg in self.jpegs)


class PreviewStage(OutputStage):
    kind = PREVIEW
    action = "making this session's preview"
    needs = ("video",)
    requires = "vae"
    encoder = JPEG
    wire_names = (PREVIEW, "preview_sizes")

    def __init__(self, decoder: StreamingDecoder):
        self.scale = decoder.spatial_compression

    @classmethod
    def build(cls, decoder: StreamingDecoder | None = None, **loaded) -> OutputStage | str:
        return "this server has no VAE (setting vae)" if decoder is None else cls(decoder)

    def new_state(self, outputs: Outputs, config: SessionConfig) -> int:
        return int(outputs.option("preview_width"))

    def derive(self, state: int, payloads: dict[str, Any]) -> tuple[int, Thumbnail | None]:
        chunk: VideoChunk | None = payloads.get("video")
        if chunk is None or chunk.frames is None or chunk.frames.shape[2] == 0:
            return state, None
        # Clamped first, as the video's frames are sent: the preview is a resize of the frame a viewer sees (the
        # decoder overshoots [-1, 1], and a resize of the overshoot would differ from it).
        last = (chunk.frames[:, :, -1].float() * 0.5 + 0.5).clamp(0, 1)  # (B, 3, H_px, W_px) in [0, 1]
        height = preview_height(last.shape[2], last.shape[3], state)
        small = F.interpolate(last, size=(height, state), mode="bilinear", antialias=True, align_corners=False)
        levels = (small.clamp(0, 1) * 255).round().to(torch.uint8)  # (B, 3, h, w), rounded as the video's uint8
        return state, Thumbnail(levels.permute(0, 2, 3, 1).contiguous(), chunk.end - 1)  # (B, h, w, 3)

    def to_tensors(self, state: int, prefix: str) -> tuple[dict[str, torch.Tensor], Any]:
        return {}, {"width": state}

    def from_tensors(self, tensors: dict[str, torch.Tensor], fields: Any, prefix: str) -> int:
        if not fields or "width" not in fields:
            raise ValueError("the snapshot holds no preview width")
        return int(fields["width"])

    def to_host(self, payload: Thumbnail) -> Callable[[], HostPreview]:
        copy, frame = HostCopy(payload.images), payload.frame

        def wait() -> HostPreview:  # on an encoder thread: the JPEG is made once, for every caller
            images = copy.wait().numpy()  # (B, h, w, 3)
            encoded = encode_jpeg(images[:, None], QUALITY)  # (B, 1, h, w, 3): one image per row
            return HostPreview(tuple(row[0] for row in pieces_of(encoded)), frame, images.shape[2], images.shape[1])

        return wait

    def wire(self, payloads: list[HostPreview], outputs: Outputs, shape: tuple[int, ...], at: int,
             response_dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        batch, _, _, height, width = shape
        preview_width = int(outputs.option("preview_width"))
        rows = [[p.jpegs[row] for p in payloads] for row in range(batch)]  # (B, K) pieces
        data = b"".join(piece for pieces in rows for piece in pieces)
        sizes = torch.tensor([[len(piece) for piece in pieces] for pieces in rows],
                             dtype=torch.int64).reshape(batch, len(payloads))  # (B, K)
        previews = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        metadata = {
            "preview_format": JPEG, "preview_codec": FORMATS[JPEG].codec, "preview_quality": QUALITY,
            "preview_width": preview_width,
            "preview_height": preview_height(height * self.scale, width * self.scale, preview_width),
            "preview_frames": ",".join(str(p.frame) for p in payloads),
        }
        return {PREVIEW: previews, "preview_sizes": sizes}, metadata
