"""The encoded formats, declared once: what the server encodes pixels into and what the client decodes.

``FORMATS`` is read by the session fields (``spec``: ``video_format``'s choices, ``video_quality``'s ranges), by
the server (``app.outputs``: the codec label of a unit without frames, the library an encoder needs) and by this
client (``units.EncodedVideo``: the decoder of each format). A new format is one entry here plus its encoder
(``app.outputs.encoders``).

Plain Python: the libraries (Pillow, PyAV) are imported only by the decoder that needs them.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable

import numpy as np


def _jpeg_frames(pieces: tuple[bytes, ...]) -> list[np.ndarray]:
    """One uint8 (H, W, 3) RGB frame per JPEG image."""
    try:
        from PIL import Image
    except ImportError:
        raise RuntimeError("decoding jpeg needs Pillow: pip install pillow") from None
    return [np.asarray(Image.open(io.BytesIO(piece)).convert("RGB")) for piece in pieces]


def _h264_frames(pieces: tuple[bytes, ...]) -> list[np.ndarray]:
    """The uint8 (H, W, 3) RGB frames of one fragmented MP4 (the row's one piece)."""
    if not pieces:
        return []
    try:
        import av
    except ImportError:
        raise RuntimeError("decoding h264 needs PyAV: pip install av") from None
    with av.open(io.BytesIO(b"".join(pieces)), "r", format="mp4") as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


@dataclass(frozen=True)
class EncodedFormat:
    """One encoded format. ``codec``: the label a payload carries (``{kind}_codec``) when there is nothing more
    precise (H.264 units with frames carry their RFC 6381 string, ``avc1.64001F``); ``content_type``: the media type
    of one piece (a JPEG image) or of a row's bytes (a fragmented MP4); ``quality``: (lowest, highest, what "auto"
    stands for) of ``video_quality`` in this format; ``library``: (module, package) its encoder and decoder import;
    ``decode``: one batch row's pieces as uint8 (H, W, 3) RGB frames."""

    name: str
    codec: str
    content_type: str
    quality: tuple[int, int, int]
    quality_doc: str
    library: tuple[str, str]
    decode: Callable[[tuple[bytes, ...]], list[np.ndarray]]


FORMATS: dict[str, EncodedFormat] = {
    f.name: f
    for f in (
        EncodedFormat("jpeg", "image/jpeg", "image/jpeg", (1, 100, 85), "the JPEG quality", ("PIL", "Pillow"),
                      _jpeg_frames),
        EncodedFormat("h264", "avc1", "video/mp4", (0, 51, 23), "the H.264 CRF (lower is better)", ("av", "PyAV"),
                      _h264_frames),
    )
}
NAMES: tuple[str, ...] = tuple(FORMATS)
