"""Encoded video on the wire: uint8 RGB frames as JPEG (one per frame) or H.264 (one fragmented-MP4 segment per unit).

Plain functions of host arrays, called off the engine thread (``app.outputs.delivery``'s encoder pools) by the video
stage's ``wire``; they know nothing of sessions or the web.

Why these libraries: JPEG is Pillow's (libjpeg-turbo). ``torchvision.io.encode_jpeg`` would add nvJPEG on CUDA,
but the torchvision build for our torch (0.28.0 beside torch 2.13.0+cpu) fails to import (``operator
torchvision::nms does not exist``), so it is not a dependency; the frames reach the encoder on the host anyway
(``HostVideo``), where libjpeg-turbo is as fast per frame. H.264 is PyAV's libx264 (``preset`` veryfast, ``tune``
zerolatency: no B-frames, no look-ahead, so a unit's packets come out with its frames).

H.264 layout (what MSE and a file both need):

- every unit is encoded on its own, so it starts with an IDR frame and holds whole GOPs: one unit, one GOP. A
  viewer can start at any unit and a failed or dropped unit breaks nothing after it;
- each batch row's bytes are ``init segment (ftyp + moov) + media segment (moof + mdat)``. The init segment is the
  same bytes for every unit of a session (same size, same encoder settings), so a player appends it once (or
  again: MSE accepts a repeated init segment) and a file is the first unit's bytes followed by every later unit's
  media segment;
- the muxer starts each segment's clock at 0; the segment's decode time (``tfdt``) and sequence number (``mfhd``)
  are rewritten to the unit's first video frame, so the segments line up into one timeline.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from wm_refiner_client.formats import FORMATS

JPEG, H264 = "jpeg", "h264"
ENCODED_FORMATS = tuple(FORMATS)  # the registry shared with the spec and the client; an encoder for each below
JPEG_CODEC = FORMATS[JPEG].codec
H264_PRESET = "veryfast"


@dataclass(frozen=True)
class EncodedVideo:
    """One unit's video, encoded: ``data`` the bytes of every piece in row-major order, ``sizes`` (B, K) the bytes
    of each piece (JPEG: K = frames, one image each; H.264: K = 1, the row's segment, K = 0 without frames),
    ``init_sizes`` (B,) H.264 only: the bytes of the init segment at the start of each row's segment."""

    data: bytes
    sizes: np.ndarray
    codec: str
    init_sizes: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return len(self.data)


def encode_video(frames: np.ndarray, video_format: str, quality: int, start: int, fps: float) -> EncodedVideo:
    """uint8 RGB frames (B, F, H, W, 3) starting at video frame ``start`` in ``video_format`` at ``quality`` (JPEG
    quality or H.264 CRF)."""
    if frames.dtype != np.uint8 or frames.ndim != 5 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames (B, F, H, W, 3), got {frames.dtype} {tuple(frames.shape)}")
    if video_format == JPEG:
        return encode_jpeg(frames, quality)
    if video_format == H264:
        return encode_h264(frames, quality, start, fps)
    raise ValueError(f"no encoder for video format {video_format!r}")


def encode_jpeg(frames: np.ndarray, quality: int) -> EncodedVideo:
    from PIL import Image

    batch, count = frames.shape[:2]
    pieces, sizes = [], np.zeros((batch, count), dtype=np.int64)
    for row in range(batch):
        for index in range(count):
            buffer = io.BytesIO()
            Image.fromarray(frames[row, index], "RGB").save(buffer, "JPEG", quality=int(quality))
            pieces.append(buffer.getvalue())
            sizes[row, index] = len(pieces[-1])
    return EncodedVideo(b"".join(pieces), sizes, JPEG_CODEC)


def encode_h264(frames: np.ndarray, crf: int, start: int, fps: float) -> EncodedVideo:
    batch, count, height, width = frames.shape[:4]
    if height % 2 or width % 2:
        raise ValueError(f"H.264 (yuv420p) needs an even frame size, got {width}x{height}; ask for jpeg or uint8")
    if count == 0:
        return EncodedVideo(b"", np.zeros((batch, 0), dtype=np.int64), h264_codec_string(None),
                            np.zeros(batch, dtype=np.int64))
    rows, init_sizes, codec = [], np.zeros(batch, dtype=np.int64), ""
    for row in range(batch):
        init, media = _h264_segment(frames[row], crf, start, fps)
        rows.append(init + media)
        init_sizes[row] = len(init)
        codec = h264_codec_string(init)
    sizes = np.array([[len(r)] for r in rows], dtype=np.int64)
    return EncodedVideo(b"".join(rows), sizes, codec, init_sizes)


def _h264_segment(frames: np.ndarray, crf: int, start: int, fps: float) -> tuple[bytes, bytes]:
    import av

    rate = Fraction(fps).limit_denominator(1001)
    time_base = 1 / rate
    buffer = io.BytesIO()
    container = av.open(buffer, "w", format="mp4",
                        options={"movflags": "frag_keyframe+empty_moov+default_base_moof"})
    try:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.time_base = time_base
        # One GOP per unit: a fresh encoder starts with an IDR frame, and no other keyframe may start a new GOP (and
        # fragment) inside the unit. The same settings for every unit keep the init segment (SPS, PPS) the same.
        stream.codec_context.options = {"crf": str(int(crf)), "preset": H264_PRESET, "tune": "zerolatency",
                                        "x264-params": "keyint=infinite:scenecut=0"}
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            frame.pts, frame.time_base = index, time_base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    finally:
        container.close()
    return _place_segment(buffer.getvalue(), start, time_base)


def _boxes(data: bytes | bytearray, begin: int = 0, end: int | None = None):
    """(type, offset, size) of the ISO-BMFF boxes in ``data[begin:end]``."""
    end = len(data) if end is None else end
    at = begin
    while at + 8 <= end:
        size = int.from_bytes(data[at : at + 4], "big")
        if size < 8:
            raise ValueError(f"malformed MP4 box at byte {at}")
        yield data[at + 4 : at + 8].decode("latin-1"), at, size
        at += size


def _child(data: bytes | bytearray, offset: int, size: int, name: str, header: int = 8) -> tuple[int, int]:
    for kind, at, length in _boxes(data, offset + header, offset + size):
        if kind == name:
            return at, length
    raise ValueError(f"the muxer's output has no {name!r} box")


def _place_segment(mp4: bytes, start: int, time_base: Fraction) -> tuple[bytes, bytes]:
    """(init segment, media segment) of a fragmented MP4 whose clock starts at 0, its fragments moved to start at
    frame ``start``."""
    data = bytearray(mp4)
    boxes = list(_boxes(data))
    kinds = [kind for kind, _, _ in boxes]
    if "moov" not in kinds or "moof" not in kinds:
        raise ValueError(f"expected an init segment and fragments from the muxer, got boxes {kinds}")
    _, moov_at, moov_size = boxes[kinds.index("moov")]
    trak = _child(data, moov_at, moov_size, "trak")
    mdia = _child(data, *trak, "mdia")
    mdhd, _ = _child(data, *mdia, "mdhd")
    scale_at = mdhd + (28 if data[mdhd + 8] == 1 else 20)
    timescale = int.from_bytes(data[scale_at : scale_at + 4], "big")
    offset = start * timescale * time_base.numerator // time_base.denominator
    fragments = [(at, size) for kind, at, size in boxes if kind == "moof"]
    for index, (at, size) in enumerate(fragments):
        mfhd, _ = _child(data, at, size, "mfhd")
        # Increasing across the session's segments (a unit has at most one fragment per frame).
        data[mfhd + 12 : mfhd + 16] = (start + index + 1).to_bytes(4, "big")
        traf = _child(data, at, size, "traf")
        tfdt, _ = _child(data, *traf, "tfdt")
        width = 8 if data[tfdt + 8] == 1 else 4
        field = slice(tfdt + 12, tfdt + 12 + width)
        data[field] = (int.from_bytes(data[field], "big") + offset).to_bytes(width, "big")
    first = fragments[0][0]
    last = max(at + size for kind, at, size in boxes if kind == "mdat")
    # The trailing mfra (a random-access index of these fragments alone) would be wrong in a concatenated file.
    return bytes(data[:first]), bytes(data[first:last])


def h264_codec_string(init: bytes | None) -> str:
    """The RFC 6381 codec string (``avc1.PPCCLL``) of an init segment's avcC (MSE's ``isTypeSupported``)."""
    if not init:
        return FORMATS[H264].codec
    at = bytes(init).find(b"avcC")
    if at < 0:
        raise ValueError("the init segment has no avcC box")
    profile, constraints, level = init[at + 5], init[at + 6], init[at + 7]
    return f"avc1.{profile:02X}{constraints:02X}{level:02X}"
