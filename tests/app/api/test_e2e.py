"""End to end against a real uvicorn server on 127.0.0.1: the WebSocket, HTTP chunks with a repeated seq and
the one-shot route all return the diffusers reference, and concurrent sessions do not disturb each other."""

from __future__ import annotations

import json
import struct
import threading
import time

import httpx
import jsonschema
import pytest
import torch
from websockets.sync.client import connect

from tests.app.conftest import (
    DEADLINE_S,
    OCTET,
    expected_clip,
    make_clip,
    payload,
    read_latents,
    reference_refine,
    session_state,
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


# --- what every unit says: seq and latency_ms (api.md, "Tensors on the wire"); the flush without frames -----------
def safetensors_header(data: bytes) -> tuple[dict, bytes]:
    """The header and the tensors' bytes, read as api.md lays the format out (no safetensors library)."""
    size = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def unit_metadata(data: bytes) -> dict[str, str]:
    return safetensors_header(data)[0]["__metadata__"]


def watch_session(server, session_id: str, messages: list) -> tuple[threading.Thread, threading.Event]:
    """A watcher collecting every message until the server closes it (after the session's flush)."""
    joined = threading.Event()

    def run() -> None:
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/watch", max_size=None,
                     open_timeout=DEADLINE_S) as ws:
            joined.set()  # subscribed before the handshake is answered: nothing published from now on is missed
            messages.extend(ws)

    thread = threading.Thread(target=run)
    thread.start()
    assert joined.wait(DEADLINE_S)
    return thread, joined


def frames_and_seq(units: list[bytes]) -> list[tuple[int, int, str]]:
    return [(int(m["frame_start"]), int(m["frame_end"]), m["seq"]) for m in map(unit_metadata, units)]


def test_http_units_and_their_watchers_carry_the_chunks_seq_and_latency(live_server):
    """Each HTTP response says its chunk's seq (given or not, the flush without frames included) and its latency
    (at most the request's own round trip: the server's interval lies within it), in the form /openapi.json
    states; a watcher's units say the seq of the chunk that finalized them; /v1/refine says seq 0."""
    latents, embeds, mask = make_clip(frames=9, seed=3)
    with httpx.Client(base_url=live_server.base_url, timeout=DEADLINE_S) as http:
        schema = http.get("/openapi.json").json()["paths"]
        chunk_schema, refine_schema = (
            schema[path]["post"]["responses"]["200"]["content"]["application/octet-stream"]["x-safetensors"]["metadata"]
            for path in ("/v1/sessions/{session_id}/chunks", "/v1/refine"))
        session_id = http.post("/v1/sessions", json={}).json()["session_id"]
        watched: list = []
        watcher, _ = watch_session(live_server, session_id, watched)
        url = f"/v1/sessions/{session_id}/chunks"
        responses = []
        for params, body in [({"seq": 0}, payload(latents[:, :, :5], embeds, mask)),  # the sink, block [1, 4)
                             ({}, payload(latents[:, :, 5:])),                           # no seq given: [4, 7)
                             ({"seq": 2, "flush": "true"}, b"")]:                       # an empty flush: [7, 9)
            started = time.perf_counter()
            response = http.post(url, params=params, content=body, headers=OCTET)
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            assert response.status_code == 200, response.text
            metadata = unit_metadata(response.content)
            jsonschema.validate(metadata, chunk_schema)
            assert 0.0 < float(metadata["latency_ms"]) <= elapsed_ms
            responses.append((int(metadata["frame_start"]), int(metadata["frame_end"]), metadata["seq"]))
        assert responses == [(0, 4, "0"), (4, 7, "1"), (7, 9, "2")]
        watcher.join(DEADLINE_S)
        units = [m for m in watched if isinstance(m, bytes)]
        assert frames_and_seq(units) == [(0, 1, "0"), (1, 4, "0"), (4, 7, "1"), (7, 9, "2")]
        assert all(float(unit_metadata(unit)["latency_ms"]) > 0.0 for unit in units)

        started = time.perf_counter()
        clip = http.post("/v1/refine", content=payload(latents, embeds, mask), headers=OCTET)
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        metadata = unit_metadata(clip.content)
        jsonschema.validate(metadata, refine_schema)
        assert (metadata["frame_start"], metadata["frame_end"], metadata["seq"]) == ("0", "9", "0")
        assert 0.0 < float(metadata["latency_ms"]) <= elapsed_ms


def test_stream_and_watch_units_carry_the_seq_of_the_message_that_finalized_them(live_server):
    """A stream unit's seq is its message's (the flush counts as one), as HTTP chunks count; its latency is at
    most the time from sending its message to receiving the unit. A watcher in the session's outputs gets the
    same bytes."""
    latents, embeds, mask = make_clip(frames=9, seed=4)
    with httpx.Client(base_url=live_server.base_url, timeout=DEADLINE_S) as http:
        session_id = http.post("/v1/sessions", json={}).json()["session_id"]
    watched: list = []
    watcher, _ = watch_session(live_server, session_id, watched)
    streamed: list[bytes] = []
    with connect(f"{live_server.ws_url}/v1/sessions/{session_id}/stream", max_size=None,
                 open_timeout=DEADLINE_S) as ws:
        for message, units in [(payload(latents[:, :, :5], embeds, mask), 2), (payload(latents[:, :, 5:]), 1),
                               (json.dumps({"type": "flush"}), 1)]:
            started = time.perf_counter()
            ws.send(message)
            for _ in range(units):
                unit = ws.recv(timeout=DEADLINE_S)
                assert isinstance(unit, bytes), unit
                assert 0.0 < float(unit_metadata(unit)["latency_ms"]) <= (time.perf_counter() - started) * 1000.0
                streamed.append(unit)
        assert json.loads(ws.recv(timeout=DEADLINE_S)) == {"type": "done", "frames": 9}
    watcher.join(DEADLINE_S)
    assert frames_and_seq(streamed) == [(0, 1, "0"), (1, 4, "0"), (4, 7, "1"), (7, 9, "2")]
    assert [m for m in watched if isinstance(m, bytes)] == streamed


def test_an_empty_body_with_flush_is_a_flush_without_frames(client):
    """An empty body with flush=true gives what a zero-frame latents tensor with flush=true gives: the same
    tensors and metadata (latency_ms aside, each request's own) and the same session afterwards; its retry is
    the stored bytes. Without flush an empty body is a 400 that names both ways out, and changes nothing."""
    latents, embeds, mask = make_clip(frames=5, seed=5)
    answers = []
    for flush_body in (b"", payload(torch.zeros(1, 128, 0, 4, 4))):
        session_id = client.post("/v1/sessions", json={"seed": 7}).json()["session_id"]
        url = f"/v1/sessions/{session_id}/chunks"
        assert client.post(url, params={"seq": 0}, content=payload(latents, embeds, mask),
                           headers=OCTET).status_code == 200
        before = session_state(client, session_id)
        refused = client.post(url, params={"seq": 1}, content=b"", headers=OCTET)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_payload"
        message = refused.json()["error"]["message"]
        assert "empty" in message and "'latents'" in message and "flush=true" in message
        assert session_state(client, session_id) == before
        flushed = client.post(url, params={"seq": 1, "flush": "true"}, content=flush_body, headers=OCTET)
        assert flushed.status_code == 200, flushed.text
        again = client.post(url, params={"seq": 1, "flush": "true"}, content=flush_body, headers=OCTET)
        assert again.headers.get("x-replayed") == "true" and again.content == flushed.content
        header, data = safetensors_header(flushed.content)
        assert float(header["__metadata__"].pop("latency_ms")) > 0.0
        state = session_state(client, session_id)
        answers.append((header, data, {k: v for k, v in state.items() if k not in ("session_id", "created_at")}))
    (empty_header, empty_data, empty_state), (tensor_header, tensor_data, tensor_state) = answers
    assert empty_header == tensor_header and empty_data == tensor_data
    assert empty_header["__metadata__"]["seq"] == "1" and empty_header["latents"]["shape"] == [1, 128, 1, 4, 4]
    assert empty_state == tensor_state and empty_state["flushed"] and empty_state["frames_returned"] == 5
