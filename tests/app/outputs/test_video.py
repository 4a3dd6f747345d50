"""Pixels out (api.md 1.1): sessions whose units carry the decoded video, over HTTP chunks, the WebSocket and
/v1/refine, compared with diffusers' ``SanaWMLTX2Refiner(..., vae=..., output_type="pt")`` on the same clip; the
decoder state through failures, drain/restore and reattach; the settings and errors around it."""

from __future__ import annotations

import json
import random
import socket

import httpx
import pytest
import torch
from diffusers import AutoencoderKLLTX2Video, SanaWMLTX2RefinerTransformer3DModel
from websockets.sync.client import connect

from app.core.codec import decode_response
from models.checkpoints import write_vae_checkpoint
from tests.faults import failing_forwards
from tests.reference import reference_refine as reference_pipeline

from tests.app.conftest import DEADLINE_S, OCTET, LiveServer, expected_clip, make_clip, payload, running_app, wait_until

FLUSH = json.dumps({"type": "flush"})
TOLERANCE = 1e-4  # api.md: float32 video within 1e-4 of the reference


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    return write_vae_checkpoint(tmp_path_factory.mktemp("tiny-vae"), "tiny-vae")


@pytest.fixture(scope="module")
def causal_vae_dir(tmp_path_factory):
    return write_vae_checkpoint(tmp_path_factory.mktemp("causal-vae"), "tiny-vae", decoder_causal=True)


def reference_video(checkpoint_dir, vae_dir, latents, embeds, mask, **config) -> torch.Tensor:
    """What the diffusers pipeline returns with that VAE: row 0, (F, 3, H, W) in [0, 1]."""
    model = SanaWMLTX2RefinerTransformer3DModel.from_pretrained(str(checkpoint_dir), low_cpu_mem_usage=False)
    vae = AutoencoderKLLTX2Video.from_pretrained(str(vae_dir), low_cpu_mem_usage=False).eval()
    names = {"sink_frames": "sink", "block_size": "block", "kv_max_frames": "kv_max"}
    return reference_pipeline(model, latents, embeds, mask, vae=vae, **{names.get(k, k): v for k, v in config.items()})


def post_chunks(client, session_id, latents, embeds, mask, splits) -> list[tuple[dict, dict]]:
    """The clip in chunks of the given sizes (the last one flushing); each response's (tensors, metadata)."""
    replies, start = [], 0
    for index, size in enumerate(splits):
        prompt = (embeds, mask) if index == 0 else ()
        last = index == len(splits) - 1
        response = client.post(f"/v1/sessions/{session_id}/chunks", params={"seq": index, "flush": last},
                               content=payload(latents[:, :, start : start + size], *prompt), headers=OCTET)
        assert response.status_code == 200, response.text
        replies.append(decode_response(response.content))
        start += size
    return replies


def joined(replies, name: str, dim: int) -> torch.Tensor:
    return torch.cat([tensors[name] for tensors, _ in replies], dim=dim)


def assert_contiguous_video(replies) -> int:
    at = 0
    for _, meta in replies:
        assert int(meta["video_frame_start"]) == at, (meta, at)
        at = int(meta["video_frame_end"])
    return at


def random_splits(frames: int, seed: int) -> list[int]:
    rng, splits, left = random.Random(seed), [], frames
    while left:
        size = min(left, rng.randint(0, 5))
        splits.append(size)
        left -= size
    return splits + [0] if splits[-1] else splits


# --- HTTP --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config,splits",
    [
        ({}, [1] * 9),  # one frame at a time
        ({"sink_frames": 2, "block_size": 2, "kv_max_frames": 6}, "random"),
        ({"sink_frames": 1, "block_size": 4, "kv_max_frames": 9}, [3, 6, 0]),  # T not a multiple of the block
        ({"sink_frames": 2, "block_size": 1, "kv_max_frames": 4}, [9]),
    ],
)
def test_http_video_equals_the_reference_decode(make_settings, checkpoint_dir, vae_dir, refiner, config, splits):
    latents, embeds, mask = make_clip(frames=9, seed=3)
    splits = random_splits(9, seed=5) if splits == "random" else splits
    want = reference_video(checkpoint_dir, vae_dir, latents, embeds, mask, **config)
    with running_app(make_settings(vae=str(vae_dir))) as client:
        created = client.post("/v1/sessions", json={**config, "outputs": ["latents", "video"],
                                                    "video_format": "float32"})
        assert created.status_code == 201, created.text
        assert created.json()["config"]["outputs"] == ["latents", "video"]
        session_id = created.json()["session_id"]
        replies = post_chunks(client, session_id, latents, embeds, mask, splits)
        state = client.get(f"/v1/sessions/{session_id}").json()
    video = joined(replies, "video", dim=1)  # (B, F, 3, H, W)
    sink = config.get("sink_frames", 1)
    assert video.shape[1] == 8 * (9 - 1) + 1 - sink == want.shape[0]
    assert assert_contiguous_video(replies) == video.shape[1]
    assert (video[0] - want).abs().max().item() <= TOLERANCE
    # The latents are untouched by the decode: still the refiner's, frame for frame.
    assert torch.equal(joined(replies, "latents", dim=2), expected_clip(refiner, latents, embeds, mask, **config))
    assert state["video_frames_returned"] == video.shape[1]
    assert state["cache_bytes"] == state["kv_cache_bytes"] + state["video_state_bytes"]


def test_a_causal_decoder_streams_without_look_ahead(make_settings, checkpoint_dir, causal_vae_dir):
    latents, embeds, mask = make_clip(frames=7, seed=4)
    want = reference_video(checkpoint_dir, causal_vae_dir, latents, embeds, mask)
    with running_app(make_settings(vae=str(causal_vae_dir))) as client:
        vae = client.get("/v1/info").json()["vae"]
        assert vae["causal_decoder"] is True and vae["lookahead_latent_frames"] == 0
        session_id = client.post("/v1/sessions", json={"outputs": ["video"], "video_format": "float32"}).json()["session_id"]
        replies = post_chunks(client, session_id, latents, embeds, mask, [4, 3, 0])
    assert all("latents" not in tensors for tensors, _ in replies), "outputs ['video'] sends no latents"
    # No look-ahead: every block's pixel frames come with it (the sink's first pixel frame is dropped).
    counts = [tensors["video"].shape[1] for tensors, _ in replies]
    assert counts == [8 * 3, 8 * 3, 0]
    video = joined(replies, "video", dim=1)
    assert (video[0] - want).abs().max().item() <= TOLERANCE


def test_uint8_over_the_websocket_is_within_one_level(make_settings, checkpoint_dir, vae_dir):
    latents, embeds, mask = make_clip(frames=8, seed=6)
    want = reference_video(checkpoint_dir, vae_dir, latents, embeds, mask)  # (F, 3, H, W)
    want_u8 = (want * 255).round().permute(0, 2, 3, 1)  # (F, H, W, 3)
    units = []
    with LiveServer(make_settings(vae=str(vae_dir))) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions", json={"outputs": ["latents", "video"]},
                                timeout=DEADLINE_S).json()["session_id"]
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", open_timeout=DEADLINE_S, max_size=None) as ws:
            ws.send(payload(latents[:, :, :5], embeds, mask))
            ws.send(payload(latents[:, :, 5:]))
            ws.send(FLUSH)
            while isinstance(message := ws.recv(timeout=DEADLINE_S), bytes):
                units.append(decode_response(message))
            assert json.loads(message) == {"type": "done", "frames": 8}
    video = joined(units, "video", dim=1)
    assert video.dtype == torch.uint8 and video.shape[1:] == want_u8.shape
    assert (video[0].float() - want_u8).abs().max().item() <= 1
    assert assert_contiguous_video(units) == want.shape[0]
    # The flush's short block [7, 8) brings the rest of the video (the frames the look-ahead held back).
    last_tensors, last_meta = units[-1]
    assert (last_meta["frame_start"], last_meta["frame_end"]) == ("7", "8") and last_tensors["video"].shape[1] > 8


def test_one_shot_refine_returns_the_video(make_settings, checkpoint_dir, vae_dir):
    latents, embeds, mask = make_clip(frames=6, seed=7)
    want = reference_video(checkpoint_dir, vae_dir, latents, embeds, mask, block_size=2)
    with running_app(make_settings(vae=str(vae_dir))) as client:
        response = client.post("/v1/refine", params={"outputs": "video", "video_format": "float32", "block_size": 2},
                               content=payload(latents, embeds, mask), headers=OCTET)
        assert response.status_code == 200, response.text
        tensors, meta = decode_response(response.content)
        bad = client.post("/v1/refine", params={"outputs": "pixels"}, content=payload(latents, embeds, mask),
                          headers=OCTET)
    assert set(tensors) == {"video"}
    assert (meta["video_frame_start"], meta["video_frame_end"]) == ("0", str(want.shape[0]))
    assert (tensors["video"][0] - want).abs().max().item() <= TOLERANCE
    assert bad.status_code == 422 and "outputs" in bad.json()["error"]["message"]


def test_bounded_look_ahead_sends_frames_sooner_and_the_same_count(make_settings, vae_dir):
    latents, embeds, mask = make_clip(frames=10, seed=8)
    counts = {}
    with running_app(make_settings(vae=str(vae_dir))) as client:
        exact = client.get("/v1/info").json()["vae"]["lookahead_latent_frames"]
        assert exact > 3
        for lookahead in ("exact", 0, 2):
            session_id = client.post("/v1/sessions", json={"outputs": ["video"], "video_lookahead": lookahead,
                                                           "video_format": "float32"}).json()["session_id"]
            replies = post_chunks(client, session_id, latents, embeds, mask, [4, 3, 3, 0])
            counts[lookahead] = [tensors["video"].shape[1] for tensors, _ in replies]
            assert assert_contiguous_video(replies) == 8 * 9 + 1 - 1
    # Latent frames 0..3 refined after the first chunk: N=0 shows all of them, N=2 two fewer, exact none yet.
    assert counts[0][0] == 8 * 3 and counts[2][0] == 8 * 1 and counts["exact"][0] == 0
    assert sum(counts[0]) == sum(counts[2]) == sum(counts["exact"])


def test_video_settings_and_errors(make_settings, vae_dir, client):
    # No VAE configured: info says so, and asking for video is 422 naming the setting.
    assert client.get("/v1/info").json()["vae"] is None
    refused = client.post("/v1/sessions", json={"outputs": ["video"]})
    assert refused.status_code == 422 and "vae" in refused.json()["error"]["message"]
    for bad in ({"outputs": []}, {"outputs": ["pixels"]}, {"video_format": "png"}, {"video_lookahead": -1},
                {"video_lookahead": "soon"}):
        response = client.post("/v1/sessions", json=bad)
        assert response.status_code == 422, (bad, response.text)
    assert client.post("/v1/sessions", json={"outputs": ["latents"]}).status_code == 201
    with running_app(make_settings(vae=str(vae_dir))) as with_vae:
        info = with_vae.get("/v1/info").json()["vae"]
        assert info["class"] == "AutoencoderKLLTX2Video" and info["latent_channels"] == 128
        assert info["temporal_compression"] == 8 and info["causal_decoder"] is False
        assert info["spatial_compression"] >= 1 and info["lookahead_latent_frames"] > 0
        twice = with_vae.post("/v1/sessions", json={"outputs": ["video", "video"]})
        assert twice.status_code == 422


def test_a_failed_chunk_rolls_the_video_back(make_settings, checkpoint_dir, vae_dir):
    """An HTTP chunk whose second block fails is all or nothing for the video too: the retry's frames equal a
    session that never failed."""
    latents, embeds, mask = make_clip(frames=10, seed=9)
    want = reference_video(checkpoint_dir, vae_dir, latents, embeds, mask)
    with running_app(make_settings(vae=str(vae_dir))) as client:
        services = client.app.state.services
        session_id = client.post("/v1/sessions", json={"outputs": ["video"], "video_format": "float32"}).json()["session_id"]
        first = client.post(f"/v1/sessions/{session_id}/chunks", params={"seq": 0},
                            content=payload(latents[:, :, :4], embeds, mask), headers=OCTET)
        assert first.status_code == 200, first.text
        session = services.registry.get(session_id).session
        # Blocks [4, 7) and [7, 10): its 5th forward is the second block's second.
        with failing_forwards(services.refiner.model, session, when=lambda n: n == 5) as failures:
            failed = client.post(f"/v1/sessions/{session_id}/chunks", params={"seq": 1},
                                 content=payload(latents[:, :, 4:10]), headers=OCTET)
        assert failures == [5]
        assert failed.status_code == 500
        retry = client.post(f"/v1/sessions/{session_id}/chunks", params={"seq": 1, "flush": True},
                            content=payload(latents[:, :, 4:10]), headers=OCTET)
        assert retry.status_code == 200, retry.text
    replies = [decode_response(first.content), decode_response(retry.content)]
    video = joined(replies, "video", dim=1)
    assert assert_contiguous_video(replies) == want.shape[0]
    assert (video[0] - want).abs().max().item() <= TOLERANCE


# --- the decoder state across drain/restore and reattach ------------------------------------------------------------
def stream_units(ws, until_done: bool) -> list:
    units = []
    while True:
        message = ws.recv(timeout=DEADLINE_S)
        if isinstance(message, bytes):
            units.append(decode_response(message))
            continue
        event = json.loads(message)
        if event["type"] == "done" or not until_done:
            return units
        raise AssertionError(event)


def test_drain_restore_and_reattach_keep_the_video_bit_identical(make_settings, vae_dir, tmp_path):
    """One session streamed without interruption; another dropped, reattached, drained to disk, restored by a new
    server and finished: every pixel byte is the same."""
    latents, embeds, mask = make_clip(frames=14, seed=10)
    config = {"outputs": ["latents", "video"], "video_format": "float32"}
    settings = make_settings(vae=str(vae_dir), snapshot_dir=tmp_path / "snapshots")
    with LiveServer(settings) as server:
        plain = httpx.post(f"{server.base_url}/v1/sessions", json=config, timeout=DEADLINE_S).json()["session_id"]
        with connect(f"{server.ws_url}/v1/sessions/{plain}/stream", open_timeout=DEADLINE_S, max_size=None) as ws:
            ws.send(payload(latents, embeds, mask))
            ws.send(FLUSH)
            uninterrupted = stream_units(ws, until_done=True)
        session_id = httpx.post(f"{server.base_url}/v1/sessions", json=config, timeout=DEADLINE_S).json()["session_id"]
        url = f"{server.ws_url}/v1/sessions/{session_id}/stream"
        ws = connect(url, open_timeout=DEADLINE_S, max_size=None)
        ws.send(payload(latents[:, :, :7], embeds, mask))
        got = [decode_response(ws.recv(timeout=DEADLINE_S))]  # the sink unit
        ws.socket.shutdown(socket.SHUT_RDWR)  # lost, no close frame
        ws.close_socket()
        state = lambda: httpx.get(f"{server.base_url}/v1/sessions/{session_id}", timeout=DEADLINE_S).json()
        wait_until(lambda: state()["detached"] and state()["frames_returned"] == 7, "the drop and the blocks")
        with connect(f"{url}?resume_from=1", open_timeout=DEADLINE_S, max_size=None) as ws:
            assert json.loads(ws.recv(timeout=DEADLINE_S))["type"] == "session"
            got += [decode_response(ws.recv(timeout=DEADLINE_S)) for _ in range(2)]
            ws.send(payload(latents[:, :, 7:10]))
            got.append(decode_response(ws.recv(timeout=DEADLINE_S)))
    # The server drained on exit with the stream closed: the session is on disk, decoder state included.
    with LiveServer(settings) as server:
        restored = httpx.get(f"{server.base_url}/v1/sessions/{session_id}", timeout=DEADLINE_S).json()
        assert restored["frames_returned"] == 10 and restored["video_state_bytes"] > 0
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream?resume_from=10", open_timeout=DEADLINE_S,
                     max_size=None) as ws:
            assert json.loads(ws.recv(timeout=DEADLINE_S))["type"] == "session"
            ws.send(payload(latents[:, :, 10:]))
            ws.send(FLUSH)
            got += stream_units(ws, until_done=True)
    for name, dim in (("latents", 2), ("video", 1)):
        assert torch.equal(joined(got, name, dim), joined(uninterrupted, name, dim)), name
    assert assert_contiguous_video(got) == assert_contiguous_video(uninterrupted) == 8 * 13
