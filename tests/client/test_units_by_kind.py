"""The client's ``Unit`` holds payloads by kind: the attributes callers always used (``latents``, ``video``,
``encoded_video``) and ``payloads`` agree, a kind the client was not written for decodes by its form, and a flush's
units join kind by kind."""

from __future__ import annotations

import io

import numpy as np
import pytest
from safetensors.numpy import save

from wm_refiner_client import EncodedVideo, Unit
from wm_refiner_client.client import _join

PIL = pytest.importorskip("PIL.Image")


def jpeg(value: int, size: tuple[int, int] = (8, 12)) -> bytes:
    buffer = io.BytesIO()
    PIL.fromarray(np.full((*size, 3), value, dtype=np.uint8), "RGB").save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def response(frame_start: int, frame_end: int, images: list[bytes], **tensors) -> bytes:
    data = b"".join(images)
    tensors = {"latents": np.zeros((1, 2, frame_end - frame_start, 1, 1), np.float32),
               "preview": np.frombuffer(data, dtype=np.uint8).copy(),
               "preview_sizes": np.array([[len(i) for i in images]], dtype=np.int64).reshape(1, len(images)),
               **tensors}
    metadata = {"frame_start": str(frame_start), "frame_end": str(frame_end), "preview_format": "jpeg",
                "preview_codec": "image/jpeg", "preview_quality": "85"}
    return save(tensors, metadata=metadata)


def test_payloads_by_kind_and_the_old_attributes_agree():
    unit = Unit.from_payload(response(0, 2, [jpeg(40)], video=np.zeros((1, 3, 4, 4, 3), np.uint8)))
    assert set(unit.payloads) == {"latents", "video", "preview"}
    assert unit.payloads["latents"] is unit.latents and unit.payloads["video"] is unit.video
    assert isinstance(unit.preview, EncodedVideo) and unit.preview is unit.payloads["preview"]
    decoded = unit.preview.decode()  # (B, K, h, w, 3)
    assert decoded.shape == (1, 1, 8, 12, 3) and abs(int(decoded[0, 0].mean()) - 40) <= 2
    # Built the old way, the mapping follows; a kind of the spec it lacks reads as None (the preview of a session
    # without one), a name that is no kind is an error.
    old = Unit(frame_start=0, frame_end=1, latents=np.ones((1, 2, 1, 1, 1)))
    assert list(old.payloads) == ["latents"] and old.video is None and old.encoded_video is None
    assert old.preview is None
    with pytest.raises(AttributeError):
        old.no_such_thing  # noqa: B018


def test_a_kind_unknown_to_the_client_arrives_as_its_array_and_aux_tensors_stay_with_their_kind():
    unit = Unit.from_payload(response(0, 1, [jpeg(10)], heatmap=np.ones((1, 1, 2, 2), np.float32),
                                      heatmap_scale=np.ones(1, np.float32)))
    assert set(unit.payloads) == {"latents", "preview", "heatmap"} and unit.heatmap.shape == (1, 1, 2, 2)


def test_a_flush_joins_previews_unit_by_unit():
    units = [Unit.from_payload(response(0, 1, [])), Unit.from_payload(response(1, 4, [jpeg(30)])),
             Unit.from_payload(response(4, 7, [jpeg(200)]))]
    joined = _join(units, 7, 0)
    assert (joined.frame_start, joined.frame_end) == (0, 7) and joined.latents.shape[2] == 7
    frames = joined.preview.decode()
    assert frames.shape[:2] == (1, 2) and frames[0, 0].mean() < frames[0, 1].mean()


def test_encoded_media_print_as_a_summary_not_their_bytes():
    images = [jpeg(value, (64, 96)) for value in (10, 120, 240)]
    unit = Unit.from_payload(response(0, 3, images))
    nbytes = sum(map(len, images))
    text = repr(unit.preview)
    assert text == (f"EncodedVideo(format='jpeg', codec='image/jpeg', quality=85, rows=1, frames=3, "
                    f"nbytes={nbytes})")
    assert str(unit.preview) == text  # print() shows the same
    assert "\\x" not in repr(unit) and len(repr(unit)) < 1000  # a unit holding it prints its summary too
    # H.264: a row is one fragmented-MP4 segment, whose frames are unknown until decoded; rows may differ.
    h264 = EncodedVideo("h264", "avc1.64001F", 23, ((b"\0" * 900,), ()), init_sizes=(700, 0), skip=1)
    assert repr(h264) == ("EncodedVideo(format='h264', codec='avc1.64001F', quality=23, rows=2, segments=[1, 0], "
                          "nbytes=900, init_sizes=(700, 0), skip=1)")
