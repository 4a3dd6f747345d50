"""Encoded video (api.md "Encoded video"): jpeg and h264 units, their codecs and error bounds, a unit encoded once
for the producer and every watcher, watchers choosing their format, and a failed encoding that loses nothing."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
from starlette.testclient import WebSocketDenialResponse

from app.core.codec import encode
from app.outputs import video as video_stage
from app.outputs.kinds import Outputs
from app.outputs.video import HostVideo, VideoStage
from models.checkpoints import write_vae_checkpoint
from wm_refiner_client import EncodedVideo, Unit, concat

from tests.app.conftest import OCTET, make_clip, payload, running_app, wait_until

# Error bounds (PSNR against the uint8 frames, dB) at the default qualities, on smooth content: what
# docs/api.md promises for natural video. The tiny random VAE's frames are noise, which no codec keeps well:
# for those only "closer to its own frame than to any other" is asserted.
JPEG_PSNR_DB = 35.0
H264_PSNR_DB = 35.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def smooth_clip(frames: int, height: int = 96, width: int = 128, start: int = 0) -> np.ndarray:
    """Smooth moving gradients and a soft disc, uint8 (1, F, H, W, 3): what a camera sees, not noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    out = []
    for t in range(start, start + frames):
        cx, cy = width * (0.3 + 0.02 * t), height * 0.5
        disc = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * (height / 6) ** 2))
        r = 0.5 + 0.4 * np.sin(x / width * 3 + t * 0.1)
        g = 0.5 + 0.4 * np.cos(y / height * 2 - t * 0.05)
        b = 0.3 + 0.6 * disc
        out.append(np.stack([r, g, b], -1))
    return (np.clip(np.stack(out), 0, 1) * 255).round().astype(np.uint8)[None]


def as_host(frames_u8: np.ndarray, start: int) -> HostVideo:
    """uint8 (1, F, H, W, 3) as the stage's host payload: (B, 3, F, H, W) in [-1, 1]."""
    tensor = torch.from_numpy(frames_u8).permute(0, 4, 1, 2, 3).float() / 255 * 2 - 1
    return HostVideo(tensor, start, start + frames_u8.shape[1])


def unit_of(payloads: list[HostVideo], outputs: Outputs, height: int, width: int) -> Unit:
    stage = VideoStage(SimpleNamespace(spatial_compression=1))
    tensors, metadata = stage.wire(payloads, outputs, (1, 128, 0, height, width), 0, "float32")
    return Unit.from_payload(encode(tensors, {"frame_start": 0, "frame_end": 1, **metadata}))


# --- the codecs ---------------------------------------------------------------------------------------------------
def test_jpeg_units_decode_within_the_bound_and_name_their_codec():
    frames = smooth_clip(5)
    unit = unit_of([as_host(frames, 0)], Outputs(("video",), "jpeg", None, 85), 96, 128)
    assert unit.video is None and unit.encoded_video.codec == "image/jpeg" and unit.encoded_video.quality == 85
    assert [piece[:2] for piece in unit.encoded_video.pieces[0]] == [b"\xff\xd8"] * 5  # one JPEG per frame
    assert (unit.video_frame_start, unit.video_frame_end) == (0, 5)
    decoded = unit.decode_video().video
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8
    assert psnr(decoded, frames) >= JPEG_PSNR_DB
    assert unit.encoded_video.nbytes * 10 < frames.nbytes
    worse = unit_of([as_host(frames, 0)], Outputs(("video",), "jpeg", None, 20), 96, 128)
    assert worse.encoded_video.nbytes < unit.encoded_video.nbytes  # quality is the JPEG quality


def test_h264_segments_concatenate_into_one_playable_file():
    frames = smooth_clip(12)
    outputs = Outputs(("video",), "h264", None, 23, fps=16.0)
    units = [unit_of([as_host(frames[:, a:b], a)], outputs, 96, 128) for a, b in ((0, 5), (5, 6), (6, 12))]
    first = units[0].encoded_video
    assert first.codec.startswith("avc1.") and len(first.codec) == len("avc1.64001F")
    # Every unit carries the same init segment and a media segment that starts with an IDR frame.
    inits = [u.encoded_video.segment(0)[: u.encoded_video.init_sizes[0]] for u in units]
    assert inits[0] == inits[1] == inits[2] and inits[0][4:8] == b"ftyp"
    assert all(u.encoded_video.segment(0, init=False)[4:8] == b"moof" for u in units)
    for unit, (a, b) in zip(units, ((0, 5), (5, 6), (6, 12))):  # each unit alone decodes (a viewer joining late)
        assert psnr(unit.decode_video().video, frames[:, a:b]) >= H264_PSNR_DB
    file = first.segment(0) + b"".join(u.encoded_video.segment(0, init=False) for u in units[1:])
    with av.open(io.BytesIO(file), format="mp4") as container:
        decoded = [(f.pts, f.time, f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    assert len(decoded) == 12
    assert [round(t * 16) for _, t, _ in decoded] == list(range(12)), "one timeline at the session's fps"
    assert psnr(np.stack([f for _, _, f in decoded])[None], frames) >= H264_PSNR_DB
    # A response holding several units is the same stream: one init segment, then each unit's fragment.
    joined = unit_of([as_host(frames[:, :5], 0), as_host(frames[:, 5:12], 5)], outputs, 96, 128)
    assert joined.encoded_video.decode().shape == frames.shape
    assert EncodedVideo.join([u.encoded_video for u in units]).decode().shape == frames.shape
    # A resent unit the client holds whole (H.264 cannot be cut, so it skips every frame): no frame, the same size.
    held = units[1].after(units[1].frame_end, video_frame=6)
    assert held.decode_video().video.shape == (1, 0, 96, 128, 3)


def test_a_failed_encoding_sends_the_raw_frames_and_says_why():
    frames = smooth_clip(3, height=95, width=127)  # odd sides: no yuv420p
    unit = unit_of([as_host(frames, 0)], Outputs(("video",), "h264", None, 23), 95, 127)
    assert unit.encoded_video is None and unit.metadata["video_format"] == "uint8"
    assert "even frame size" in unit.video_error and "jpeg or uint8" in unit.video_error
    assert np.abs(unit.video.astype(int) - frames.astype(int)).max() <= 1
    assert (unit.video_frame_start, unit.video_frame_end) == (0, 3)


def test_a_unit_is_encoded_once_per_format_whoever_asks(monkeypatch):
    calls = []
    real = video_stage.encode_video

    def counting(frames, fmt, quality, start, fps):
        calls.append((fmt, quality, start))
        return real(frames, fmt, quality, start, fps)

    monkeypatch.setattr(video_stage, "encode_video", counting)
    host = as_host(smooth_clip(2), 0)
    for _ in range(3):
        unit_of([host], Outputs(("video",), "jpeg", None, 85), 96, 128)
    unit_of([host], Outputs(("latents", "video"), "jpeg", None, 85), 96, 128)
    unit_of([host], Outputs(("video",), "jpeg", None, 50), 96, 128)
    assert calls == [("jpeg", 85, 0), ("jpeg", 50, 0)]


# --- the service --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    return write_vae_checkpoint(tmp_path_factory.mktemp("tiny-vae"), "tiny-vae")


def test_sessions_and_watchers_choose_encoded_formats(make_settings, vae_dir, monkeypatch):
    calls = []
    real = video_stage.encode_video

    def counting(frames, fmt, quality, start, fps):
        calls.append((fmt, quality, start))
        return real(frames, fmt, quality, start, fps)

    monkeypatch.setattr(video_stage, "encode_video", counting)
    latents, embeds, mask = make_clip(frames=6, seed=3)
    with running_app(make_settings(vae=str(vae_dir), encode_workers=3)) as client:
        for bad, fragment in (({"video_format": "jpeg", "video_quality": 0}, "[1, 100]"),
                              ({"video_format": "h264", "video_quality": 52}, "[0, 51]"),
                              ({"video_quality": "best"}, "video_quality")):
            refused = client.post("/v1/sessions", json={"outputs": ["video"], **bad})
            assert refused.status_code == 422 and fragment in refused.text, (bad, refused.text)
        ignored = client.post("/v1/sessions", json={"outputs": ["video"], "video_quality": 80})  # uint8: no quality
        assert ignored.status_code == 201 and ignored.json()["config"]["video_quality"] == "auto"
        created = client.post("/v1/sessions", json={"outputs": ["latents", "video"], "video_format": "jpeg"})
        assert created.status_code == 201 and created.json()["config"]["video_quality"] == 85
        session_id = created.json()["session_id"]
        base = f"/v1/sessions/{session_id}"
        for query, fragment in (("video_format=png", "video_format='png'"), ("video_quality=101", "[1, 100]"),
                                ("outputs=latents&video_format=jpeg", "gets no video"),
                                ("outputs=latents,latents", "lists a kind twice")):
            with pytest.raises(WebSocketDenialResponse) as refused:
                with client.websocket_connect(f"{base}/watch?{query}"):
                    pass
            error = json.loads(refused.value.content)["error"]
            assert refused.value.status_code == 422 and error["code"] == "invalid_request", (query, error)
            assert fragment in error["message"], (query, error)
        with client.websocket_connect(f"{base}/watch?outputs=video") as same, \
                client.websocket_connect(f"{base}/watch?outputs=video&video_format=uint8") as raw, \
                client.websocket_connect(f"{base}/watch?video_format=h264&video_quality=30") as h264:
            responses = []
            for index, (a, b) in enumerate(((0, 4), (4, 6))):
                prompt = (embeds, mask) if index == 0 else ()
                response = client.post(f"{base}/chunks", params={"seq": index, "flush": b == 6},
                                       content=payload(latents[:, :, a:b], *prompt), headers=OCTET)
                assert response.status_code == 200, response.text
                responses.append(Unit.from_payload(response.content))
            watched = {name: read_units(ws) for name, ws in (("same", same), ("raw", raw), ("h264", h264))}
    produced = [u for u in responses if u.video_frames]
    assert produced and all(u.encoded_video.format == "jpeg" and u.latents is not None for u in produced)
    raw_video = np.concatenate([u.video for u in watched["raw"] if u.video is not None], axis=1)
    jpeg_video = np.concatenate([u.decode_video().video for u in produced], axis=1)
    h264_units = [u for u in watched["h264"] if u.video_frames]
    assert [u.encoded_video.quality for u in h264_units] == [30] * len(h264_units)
    h264_video = np.concatenate([u.decode_video().video for u in h264_units], axis=1)
    assert raw_video.shape == jpeg_video.shape == h264_video.shape and raw_video.shape[1] == 8 * 5
    for decoded in (jpeg_video, h264_video):  # noise to the codecs, yet each frame is closest to its own
        errors = np.array([[np.abs(d.astype(np.int16) - r.astype(np.int16)).mean() for r in raw_video[0]]
                           for d in decoded[0]])
        assert list(errors.argmin(axis=1)) == list(range(raw_video.shape[1]))
    same_video = np.concatenate([u.decode_video().video for u in watched["same"] if u.video_frames], axis=1)
    assert np.array_equal(same_video, jpeg_video) and all(u.latents is None for u in watched["same"])
    # concat over every unit, those without frames too (they decode to (1, 0, 0, 0, 3)): what client.md shows.
    assert any(not u.video_frames for u in watched["h264"] + watched["same"])
    assert np.array_equal(concat(responses, "video"), jpeg_video)
    assert np.array_equal(concat(watched["same"], "video"), jpeg_video)
    assert np.array_equal(concat(watched["h264"], "video"), h264_video)
    # The response and the video-only watcher shared each unit's JPEG; the h264 watcher had its own.
    with_frames = len(produced)
    assert sorted(calls) == sorted([("jpeg", 85, u.video_frame_start) for u in produced]
                                   + [("h264", 30, u.video_frame_start) for u in h264_units])
    assert len(calls) == 2 * with_frames


def read_units(ws) -> list[Unit]:
    units = []
    while True:
        message = ws.receive()
        if message.get("bytes") is not None:
            units.append(Unit.from_payload(message["bytes"]))
        elif message.get("text") is not None:
            if json.loads(message["text"])["type"] == "done":
                return units
        else:
            return units


def test_the_setting_sizes_both_encoder_pools_and_shutdown_stops_them(make_settings):
    import os
    import threading

    from app.outputs.delivery import WATCH_NICE

    with running_app(make_settings(encode_workers=3)) as client:
        encoder = client.app.state.services.encoder
        assert encoder._pool._max_workers == 3
        # The watchers' pool is smaller, and its threads run at a lower priority than the producers' (issue 25
        # item 7): getpriority of the calling thread's own id reads that thread's nice value on Linux.
        assert encoder._watch_pool._max_workers == encoder.watch_workers == 1

        def nice() -> int:
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        producers = encoder._pool.submit(nice).result(timeout=5)
        assert encoder._watch_pool.submit(nice).result(timeout=5) == min(19, producers + WATCH_NICE) > producers
        # Every session's units go through the pool: a second worker takes work while the first is busy.
        started, release = threading.Event(), threading.Event()
        busy = encoder._pool.submit(lambda: (started.set(), release.wait(5)))
        assert started.wait(5)
        assert encoder._pool.submit(lambda: "second").result(timeout=5) == "second"
        release.set()
        busy.result(timeout=5)
    assert encoder._pool._shutdown and encoder._watch_pool._shutdown


def test_a_sessions_watchers_get_at_most_max_watch_encodings_beyond_the_producers(make_settings, vae_dir):
    """Issue 25 item 7: every distinct (video_format, video_quality) a watcher asks for costs encoder CPU per unit.
    Two beyond the producer's (max_watch_encodings: 2) are accepted, a third is refused before the handshake is
    accepted with 503 over_capacity naming the setting and the encodings asked for; the producer's own video, no
    video, or an encoding already asked for are always accepted; once a watcher leaves, its encoding is free."""
    with running_app(make_settings(vae=str(vae_dir), max_watch_encodings=2)) as client:
        session_id = client.post("/v1/sessions", json={"outputs": ["latents", "video"],
                                                       "video_format": "jpeg"}).json()["session_id"]
        base = f"/v1/sessions/{session_id}/watch"
        with client.websocket_connect(f"{base}?video_format=h264"), \
                client.websocket_connect(f"{base}?video_format=jpeg&video_quality=50") as second:
            for query in ("video_format=uint8", "video_format=h264&video_quality=30"):
                with pytest.raises(WebSocketDenialResponse) as refused:
                    with client.websocket_connect(f"{base}?{query}"):
                        pass
                error = json.loads(refused.value.content)["error"]
                assert refused.value.status_code == 503 and refused.value.headers["retry-after"], error
                assert error["code"] == "over_capacity" and "max_watch_encodings 2" in error["message"], error
                assert "video_format=h264&video_quality=23" in error["message"], error
                assert error["max_watch_encodings"] == 2
                assert sorted(map(tuple, error["watch_encodings"])) == [("h264", 23), ("jpeg", 50)]
            # None of these adds an encoding: the producer's own video, no video, one already asked for.
            for query in ("outputs=video", "outputs=latents", "video_format=jpeg&video_quality=85",
                          "video_format=h264&video_quality=23"):
                with client.websocket_connect(f"{base}?{query}"):
                    pass
            second.close()
            wait_until(lambda: len(client.app.state.services.store.registry.existing(session_id).watchers) == 1,
                       "the second watcher to leave")
            with client.websocket_connect(f"{base}?video_format=uint8"):
                pass


def test_a_slow_encoder_drops_watcher_units_never_the_producers(make_settings, vae_dir, monkeypatch):
    import time

    real = video_stage.encode_video

    def slow_h264(frames, fmt, quality, start, fps):
        if fmt == "h264":
            time.sleep(1.0)
        return real(frames, fmt, quality, start, fps)

    monkeypatch.setattr(video_stage, "encode_video", slow_h264)
    latents, embeds, mask = make_clip(frames=14, seed=4)
    settings = make_settings(vae=str(vae_dir), watch_queue_units=1, encode_workers=1)
    with running_app(settings) as client:
        session_id = client.post("/v1/sessions", json={"outputs": ["video"], "video_format": "jpeg",
                                                       "video_lookahead": 0}).json()["session_id"]
        base = f"/v1/sessions/{session_id}"
        with client.websocket_connect(f"{base}/watch?video_format=h264") as watcher:
            started = time.monotonic()
            with client.websocket_connect(f"{base}/stream") as stream:
                stream.send_bytes(payload(latents[:, :, :7], embeds, mask))
                stream.send_bytes(payload(latents[:, :, 7:]))
                stream.send_text(json.dumps({"type": "flush"}))
                produced = []
                while (message := stream.receive()).get("bytes") is not None or \
                        json.loads(message["text"])["type"] != "done":
                    if message.get("bytes") is not None:
                        produced.append(Unit.from_payload(message["bytes"]))
            producer_s = time.monotonic() - started
            events, watched = [], []
            while True:
                message = watcher.receive()
                if message.get("bytes") is not None:
                    watched.append(Unit.from_payload(message["bytes"]))
                elif message.get("text") is not None:
                    events.append(json.loads(message["text"]))
                    if events[-1]["type"] == "done":
                        break
    with_video = [u for u in produced if u.video_frames]
    assert len(with_video) >= 4 and all(u.encoded_video.format == "jpeg" for u in with_video)
    assert sum(u.video_frames for u in produced) == 8 * 13 + 1 - 1, "the producer lost nothing"
    assert producer_s < len(with_video) * 1.0, "the producer never waited for the watcher's encoder"
    dropped = sum(e["units"] for e in events if e["type"] == "dropped")
    assert dropped >= 1 and len([u for u in watched if u.video_frames]) < len(with_video)


def test_the_video_file_takes_segments_as_they_come_and_encodes_only_what_came_raw(tmp_path):
    from app.cli.remote import SegmentFile

    frames = smooth_clip(14)
    outputs = Outputs(("video",), "h264", None, 23, fps=16.0)
    served = unit_of([as_host(frames[:, :6], 0)], outputs, 96, 128)
    raw = Unit(0, 1, video=frames[:, 6:9], video_frame_start=6, video_frame_end=9, video_error="encoding failed")
    # A resumed unit repeating frames 9..10 the file already has: [9, 14) sent whole, frames from 11 wanted.
    resent = unit_of([as_host(frames[:, 9:14], 9)], outputs, 96, 128)
    partly_new = resent.after(0, 11)
    assert partly_new.encoded_video.skip == 2 and partly_new.video_frame_start == 11
    first_half = unit_of([as_host(frames[:, 9:11], 9)], outputs, 96, 128)
    file = SegmentFile(tmp_path / "out.mp4", 16.0)
    for unit in (served, raw, first_half, partly_new):
        file.write(unit)
    file.close()
    assert file.frames == 14
    data = (tmp_path / "out.mp4").read_bytes()
    assert data.startswith(served.encoded_video.segment(0))  # the server's bytes, as they came
    with av.open(str(tmp_path / "out.mp4")) as container:
        decoded = [(round(f.time * 16), f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    assert [t for t, _ in decoded] == list(range(14))
    assert psnr(np.stack([f for _, f in decoded])[None], frames) >= H264_PSNR_DB


def test_a_watchers_thread_goes_below_the_nice_value_it_started_with():
    # Under `nice` (a service started with it, a container's default) an absolute WATCH_NICE put the watchers' threads
    # level with the producers', or below them (a raise, refused without privilege).
    import os
    import threading

    from app.outputs.delivery import WATCH_NICE, _lower_priority

    seen = []

    def thread() -> None:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, os.getpriority(os.PRIO_PROCESS, me) + 5)
        started = os.getpriority(os.PRIO_PROCESS, me)
        _lower_priority()
        seen.append((started, os.getpriority(os.PRIO_PROCESS, me)))

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join(5)
    (started, lowered), = seen
    assert lowered == min(19, started + WATCH_NICE) > started
