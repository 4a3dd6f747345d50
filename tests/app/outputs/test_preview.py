"""The preview output (api.md "Previews"): one JPEG per unit of its last video frame, ``preview_width`` wide, made
from the video stage's frames (no decode of its own), over HTTP chunks, the WebSocket and a watch; its option's
errors; the client's decoding of it (``unit.preview``)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from starlette.testclient import WebSocketDenialResponse

from app.outputs.kinds import Outputs
from app.outputs.catalog import build_stages
from models import SessionConfig
from models.checkpoints import build_vae, write_vae_checkpoint
from models.session import Unit as ModelUnit
from models.vae import StreamingDecoder
from wm_refiner_client import EncodedVideo, Unit

from tests.app.conftest import OCTET, make_clip, payload, running_app

FLUSH = json.dumps({"type": "flush"})
# The tiny random VAE's frames are noise, which JPEG keeps badly (about 16 levels of 255 off the exact resize at
# quality 85, mostly chroma). So the preview is compared with the same JPEG (quality 85, Pillow) of the exact resize:
# equal but for the resize's float rounding (mean absolute difference in levels of 255).
JPEG_MEAN_LEVELS = 1.0
JPEG_QUALITY = 85


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    return write_vae_checkpoint(tmp_path_factory.mktemp("tiny-vae"), "tiny-vae")


def resized(frame: torch.Tensor, width: int) -> np.ndarray:
    """A float32 video frame (3, H, W) in [0, 1], resized to ``width`` (aspect kept), as uint8 (h, w, 3)."""
    height = max(1, round(frame.shape[1] * width / frame.shape[2]))
    small = F.interpolate(frame[None].float(), size=(height, width), mode="bilinear", antialias=True)[0]
    return (small.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def as_jpeg(image: np.ndarray) -> np.ndarray:
    """uint8 (h, w, 3) through a JPEG at the preview's quality and back."""
    buffer = io.BytesIO()
    Image.fromarray(image, "RGB").save(buffer, "JPEG", quality=JPEG_QUALITY)
    return np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))


def mean_levels(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def previews_of(units: list[Unit]) -> list[tuple[int, np.ndarray]]:
    """(video frame, uint8 (h, w, 3)) of every preview of batch row 0, in order."""
    found = []
    for unit in units:
        assert isinstance(unit.payloads["preview"], EncodedVideo) and unit.preview is unit.payloads["preview"]
        images = unit.preview.decode()  # (B, K, h, w, 3)
        frames = [int(f) for f in unit.metadata["preview_frames"].split(",") if f]
        assert images.shape[1] == len(frames) == unit.preview.pieces[0].__len__()
        found.extend(zip(frames, images[0]))
    return found


def read_stream(ws) -> list[Unit]:
    units = []
    while True:
        message = ws.receive()
        if message.get("bytes") is not None:
            units.append(Unit.from_payload(message["bytes"]))
        elif message.get("text") is not None and json.loads(message["text"])["type"] == "done":
            return units
        elif message.get("text") is None:
            return units


def test_previews_are_the_video_stages_last_frames_resized_over_http_the_websocket_and_a_watch(make_settings,
                                                                                              vae_dir):
    latents, embeds, mask = make_clip(frames=8, height=4, width=6, seed=4)
    splits = ((0, 1), (1, 4), (4, 7), (7, 8))  # a response per unit
    # No look-ahead: each block's frames come with it (an exact decode would hold them all to the flush).
    shape = {"video_lookahead": 0}
    with running_app(make_settings(vae=str(vae_dir))) as client:
        # Video (float32, the exact frames) and preview together, over HTTP chunks, watched for previews alone.
        created = client.post("/v1/sessions", json={"outputs": ["latents", "video", "preview"],
                                                    "video_format": "float32", **shape})
        assert created.status_code == 201, created.text
        assert created.json()["config"]["preview_width"] == 160
        base = f"/v1/sessions/{created.json()['session_id']}"
        with client.websocket_connect(f"{base}/watch?outputs=preview") as watch:
            http_units = []
            for index, (a, b) in enumerate(splits):
                prompt = (embeds, mask) if index == 0 else ()
                response = client.post(f"{base}/chunks", params={"seq": index, "flush": b == 8},
                                       content=payload(latents[:, :, a:b], *prompt), headers=OCTET)
                assert response.status_code == 200, response.text
                http_units.append(Unit.from_payload(response.content))
            watched = read_stream(watch)
        # Preview alone (the video decoded but not sent), over the WebSocket stream.
        alone = client.post("/v1/sessions", json={"outputs": ["latents", "preview"], **shape}).json()["session_id"]
        with client.websocket_connect(f"/v1/sessions/{alone}/stream") as ws:
            ws.send_bytes(payload(latents[:, :, :5], embeds, mask))
            ws.send_bytes(payload(latents[:, :, 5:]))
            ws.send_text(FLUSH)
            ws_units = read_stream(ws)

    video = torch.from_numpy(np.concatenate([u.video for u in http_units], axis=1)[0])  # (F, 3, H, W) in [0, 1]
    height = round(video.shape[2] * 160 / video.shape[3])
    assert (video.shape[2], video.shape[3], height) == (128, 192, 107)
    shown = previews_of(http_units)
    # One preview per unit that brought video frames, of its last frame, of the documented size.
    assert len(shown) >= 3 and [frame for frame, _ in shown] == sorted({frame for frame, _ in shown})
    assert shown[-1][0] == video.shape[0] - 1
    for unit in http_units:
        assert (unit.metadata["preview_width"], unit.metadata["preview_height"]) == ("160", str(height))
    for frame, image in shown:
        assert image.shape == (height, 160, 3)
        want = as_jpeg(resized(video[frame], 160))
        errors = [mean_levels(image, resized(video[other], 160)) for other in range(video.shape[0])]
        assert mean_levels(image, want) <= JPEG_MEAN_LEVELS, frame
        assert int(np.argmin(errors)) == frame  # closest to its own frame of all
    # The same previews without the video sent, over the WebSocket, and through a watch.
    assert all(u.video is None and u.encoded_video is None and "video" not in u.payloads for u in ws_units)
    for other in (previews_of(ws_units), previews_of(watched)):
        assert [frame for frame, _ in other] == [frame for frame, _ in shown]
        for (_, a), (_, b) in zip(other, shown):
            assert mean_levels(a, b) <= 1.0  # the same frames decoded and encoded (in another session)
    assert all(u.latents is None for u in watched)


def test_the_preview_width_option_sizes_previews_and_bad_values_are_a_422_naming_the_range(make_settings, vae_dir):
    latents, embeds, mask = make_clip(frames=4, height=4, width=4, seed=1)
    with running_app(make_settings(vae=str(vae_dir))) as client:
        for bad in (0, 10000, "x", 15, 1025, True):
            refused = client.post("/v1/sessions", json={"outputs": ["preview"], "preview_width": bad})
            assert refused.status_code == 422, (bad, refused.text)
            message = refused.json()["error"]["message"]
            assert "preview_width" in message and "[16, 1024]" in message, message
        refused = client.post("/v1/refine", params={"outputs": "preview", "preview_width": "x"},
                              content=payload(latents, embeds, mask), headers=OCTET)
        assert refused.status_code == 422 and "preview_width" in refused.text, refused.text
        response = client.post("/v1/refine", params={"outputs": "preview", "preview_width": 48},
                               content=payload(latents, embeds, mask), headers=OCTET)
        assert response.status_code == 200, response.text
        unit = Unit.from_payload(response.content)
        images = unit.preview.decode()
        assert images.shape[0] == 1 and images.shape[1] >= 1 and images.shape[2:] == (48, 48, 3)
        assert unit.latents is None and unit.video is None
    with running_app(make_settings()) as plain:
        refused = plain.post("/v1/sessions", json={"outputs": ["latents", "preview"]})
        assert refused.status_code == 422 and "'preview'" in refused.text and "no VAE" in refused.text


def test_one_decode_serves_video_and_preview_and_a_preview_alone_sends_no_video():
    stages = build_stages(decoder=StreamingDecoder(build_vae("tiny-vae")))
    config = SessionConfig(block_size=3)
    latents = torch.randn(1, 128, 7, 2, 3, generator=torch.Generator().manual_seed(2))
    both = stages.for_session(Outputs(("video", "preview"), options=(("preview_width", 32),)), config)
    alone = stages.for_session(Outputs(("preview",), options=(("preview_width", 32),)), config)
    assert both.kinds == alone.kinds == ("video", "preview") and alone.deferred
    for start, end in ((0, 1), (1, 4), (4, 7)):
        unit = ModelUnit("sink" if start == 0 else "block", latents[:, :, start:end], start, end)
        out, solo = both.push(unit, final=False), alone.push(unit, final=False)
        assert "video" not in solo.payloads and set(solo.payloads) == set(out.payloads) - {"video"}
        chunk = out.payloads["video"]
        if chunk.frames is None or chunk.frames.shape[2] == 0:
            assert "preview" not in out.payloads
            continue
        thumb = out.payloads["preview"]
        assert thumb.frame == chunk.end - 1 and thumb.images.shape == (1, 21, 32, 3)
        assert torch.equal(thumb.images, solo.payloads["preview"].images)  # same shapes, same code: same bits
    tensors, fields = alone.to_tensors("app")
    assert fields["preview"] == {"width": 32} and all(name.startswith("app.video.") for name in tensors)
    restored = stages.from_tensors(Outputs(("preview",)), tensors, fields, "app")
    assert restored.states["preview"] == 32 and restored.positions() == alone.positions()
