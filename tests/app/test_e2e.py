"""End to end against a real uvicorn server on 127.0.0.1: the WebSocket, HTTP chunks with a repeated seq and
the one-shot route all return the diffusers reference, and concurrent sessions do not disturb each other."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from websockets.sync.client import connect

from .conftest import (
    DEADLINE_S,
    OCTET,
    expected_clip,
    make_clip,
    payload,
    read_latents,
    reference_refine,
)

TOLERANCE = 1e-5


def stream_over_websocket(server, session_id, latents, embeds, mask, splits, headers=None):
    """Send the clip in ``splits`` frames per message, flush, and collect every unit until the server closes."""
    assert sum(splits) == latents.shape[2]
    units, events = [], []
    url = f"{server.ws_url}/v1/sessions/{session_id}/stream"
    with connect(url, additional_headers=headers or {}, max_size=None, open_timeout=DEADLINE_S) as ws:
        start = 0
        for i, frames in enumerate(splits):
            chunk = latents[:, :, start : start + frames]
            ws.send(payload(chunk, embeds, mask) if i == 0 else payload(chunk))
            start += frames
        ws.send(json.dumps({"type": "flush"}))
        while True:
            message = ws.recv(timeout=DEADLINE_S)
            if isinstance(message, bytes):
                units.append(read_latents(message))
            else:
                events.append(json.loads(message))
                if events[-1]["type"] == "done":
                    break
        with pytest.raises(Exception):
            ws.recv(timeout=DEADLINE_S)  # the server closes after "done"
        close_code = ws.close_code
    return units, events, close_code


def assert_contiguous(units, total_frames):
    position = 0
    for latents, meta in units:
        start, end = int(meta["frame_start"]), int(meta["frame_end"])
        assert start == position, f"unit starts at {start}, expected {position} (a frame lost or duplicated)"
        assert latents.shape[2] == end - start
        position = end
    assert position == total_frames


def test_websocket_http_chunks_and_one_shot_equal_the_reference(live_server, checkpoint_dir):
    latents, embeds, mask = make_clip(frames=17, seed=1)
    reference = reference_refine(checkpoint_dir, latents, embeds, mask)

    with httpx.Client(base_url=live_server.base_url, timeout=DEADLINE_S) as http:
        # One shot.
        response = http.post("/v1/refine", content=payload(latents, embeds, mask), headers=OCTET)
        assert response.status_code == 200, response.text
        one_shot, meta = read_latents(response.content)
        assert (meta["frame_start"], meta["frame_end"]) == ("0", "17")
        assert one_shot.dtype == torch.float32 and one_shot.shape == latents.shape

        # WebSocket, irregular message sizes (1..5 frames, blocks of 3 straddle messages).
        session_id = http.post("/v1/sessions", json={}).json()["session_id"]
        units, events, close_code = stream_over_websocket(
            live_server, session_id, latents, embeds, mask, splits=[2, 1, 4, 3, 1, 5, 1]
        )
        assert events == [{"type": "done", "frames": 17}]
        assert close_code == 1000
        assert_contiguous(units, 17)
        assert [int(m["frame_end"]) - int(m["frame_start"]) for _, m in units] == [1, 3, 3, 3, 3, 3, 1]
        assert all(float(m["latency_ms"]) >= 0 for _, m in units)
        streamed = torch.cat([u for u, _ in units], dim=2)

        # HTTP chunks with seq, retrying two of them (one the flushing chunk).
        session_id = http.post("/v1/sessions").json()["session_id"]
        url = f"/v1/sessions/{session_id}/chunks"
        pieces, start, seq = [], 0, 0
        for frames, flush in [(3, False), (4, False), (2, False), (5, False), (3, True)]:
            chunk = latents[:, :, start : start + frames]
            body = payload(chunk, embeds, mask) if seq == 0 else payload(chunk)
            params = {"seq": seq, "flush": str(flush).lower()}
            first = http.post(url, params=params, content=body, headers=OCTET)
            assert first.status_code == 200, first.text
            if seq in (1, 4):
                again = http.post(url, params=params, content=body, headers=OCTET)
                assert again.status_code == 200
                assert again.headers.get("x-replayed") == "true"
                assert again.content == first.content
            out, meta = read_latents(first.content)
            assert meta["seq"] == str(seq)
            pieces.append(out)
            start += frames
            seq += 1
        state = http.get(f"/v1/sessions/{session_id}").json()
        assert state["frames_returned"] == 17 and state["flushed"] and state["next_seq"] == 5
        chunked = torch.cat(pieces, dim=2)

    assert torch.equal(streamed, one_shot)
    assert torch.equal(chunked, one_shot)
    assert (one_shot - reference).abs().max().item() <= TOLERANCE
    assert torch.equal(one_shot[:, :, :1], latents[:, :, :1]), "the sink frame is returned unchanged"


def test_four_sessions_at_once_each_equal_their_single_session_result(live_server, refiner):
    configs = [
        dict(seed=1, block_size=3, kv_max_frames=11),
        dict(seed=2, block_size=2, kv_max_frames=6),
        dict(seed=3, block_size=3, kv_max_frames=7, sink_frames=2),
        dict(seed=4, block_size=1, kv_max_frames=4, positions="rebased"),
    ]
    splits = [[4, 4, 5], [1, 1, 1, 10], [13], [2, 3, 2, 3, 3]]
    clips = [make_clip(frames=13, seed=10 + i) for i in range(4)]
    results: dict[int, object] = {}
    barrier = threading.Barrier(4, timeout=DEADLINE_S)

    def run(i: int) -> None:
        try:
            with httpx.Client(base_url=live_server.base_url, timeout=DEADLINE_S) as http:
                session_id = http.post("/v1/sessions", json=configs[i]).json()["session_id"]
            barrier.wait()
            latents, embeds, mask = clips[i]
            units, events, close_code = stream_over_websocket(live_server, session_id, latents, embeds, mask, splits[i])
            assert close_code == 1000 and events[-1] == {"type": "done", "frames": 13}
            assert_contiguous(units, 13)
            results[i] = torch.cat([u for u, _ in units], dim=2)
        except BaseException as exc:  # reported by the main thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S * 2)
    for i in range(4):
        assert not isinstance(results.get(i), BaseException), results.get(i)
        latents, embeds, mask = clips[i]
        single = expected_clip(refiner, latents, embeds, mask, **configs[i])
        assert torch.equal(results[i], single), f"session {i} differs from its single-session run"
