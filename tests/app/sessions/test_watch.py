"""Watchers (WS /v1/sessions/{id}/watch) and the session list (GET /v1/sessions), against a real server."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import torch
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from app.core.codec import decode_response
from models.checkpoints import write_vae_checkpoint

from tests.app.conftest import DEADLINE_S, OCTET, LiveServer, make_clip, payload, wait_until

FLUSH = json.dumps({"type": "flush"})


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    return write_vae_checkpoint(tmp_path_factory.mktemp("tiny-vae"), "tiny-vae")


def read_until_closed(ws) -> tuple[list, list]:
    """Every (tensors, metadata) unit and every text event a watcher gets until the server closes it."""
    units, events = [], []
    try:
        while True:
            message = ws.recv(timeout=DEADLINE_S)
            if isinstance(message, bytes):
                units.append(decode_response(message))
            else:
                events.append(json.loads(message))
    except ConnectionClosed:
        pass
    return units, events


def metric(server, name: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=DEADLINE_S).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_two_watchers_get_what_the_producer_gets(make_settings, vae_dir):
    latents, embeds, mask = make_clip(frames=11, seed=1)
    with LiveServer(make_settings(vae=str(vae_dir))) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions", json={"outputs": ["latents", "video"]},
                                timeout=DEADLINE_S).json()["session_id"]
        base = f"{server.ws_url}/v1/sessions/{session_id}"
        video_only = connect(f"{base}/watch?outputs=video", open_timeout=DEADLINE_S, max_size=None)
        everything = connect(f"{base}/watch", open_timeout=DEADLINE_S, max_size=None, subprotocols=["wm-refiner"])
        assert everything.subprotocol == "wm-refiner"
        wait_until(lambda: httpx.get(f"{server.base_url}/v1/sessions/{session_id}").json()["watchers"] == 2,
                   "both watchers to join")
        produced = []
        with connect(f"{base}/stream", open_timeout=DEADLINE_S, max_size=None) as ws:
            ws.send(payload(latents[:, :, :6], embeds, mask))
            ws.send(payload(latents[:, :, 6:]))
            ws.send(FLUSH)
            while isinstance(message := ws.recv(timeout=DEADLINE_S), bytes):
                produced.append(decode_response(message))
        watched = {name: read_until_closed(ws) for name, ws in (("video", video_only), ("all", everything))}
        assert video_only.close_code == everything.close_code == 1000
    producer_video = torch.cat([t["video"] for t, _ in produced], dim=1)
    producer_latents = torch.cat([t["latents"] for t, _ in produced], dim=2)
    for name, (units, events) in watched.items():
        assert torch.equal(torch.cat([t["video"] for t, _ in units], dim=1), producer_video), name
        assert [meta["video_frame_start"] for _, meta in units] == [meta["video_frame_start"] for _, meta in produced]
        blocks = [(e["frame_start"], e["frame_end"]) for e in events if e["type"] == "block"]
        assert blocks == [(1, 4), (4, 7), (7, 10), (10, 11)], name
        assert all(e["latency_ms"] >= 0 for e in events if e["type"] == "block")
        assert events[-1] == {"type": "done", "frames": 11}
        assert not any(e["type"] == "dropped" for e in events)
    assert all("latents" not in t for t, _ in watched["video"][0]), "?outputs=video restricts the payload"
    assert torch.equal(torch.cat([t["latents"] for t, _ in watched["all"][0]], dim=2), producer_latents)


def test_a_watcher_that_never_reads_loses_units_and_slows_nobody(make_settings):
    """A watcher whose socket is never read: the producer still gets every unit, a reading watcher of the same
    session too, and the stalled one's lost units are counted; once it reads, it is told how many it lost."""
    frames, size = 37, 32  # 12 blocks of (1, 128, 3, 32, 32) float32 latents: 1.5 MB each
    latents, embeds, mask = make_clip(frames=frames, height=size, width=size, seed=2)
    with LiveServer(make_settings(watch_queue_units=2, max_frame_tokens=size * size)) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=DEADLINE_S).json()["session_id"]
        base = f"{server.ws_url}/v1/sessions/{session_id}"
        # The stalled watcher: a small receive window and a client that buffers at most one message.
        raw = socket.create_connection(("127.0.0.1", server.port))
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 262144)
        stalled = connect(f"{base}/watch", sock=raw, open_timeout=DEADLINE_S, max_size=None, max_queue=1, ping_interval=None,
                          compression=None)
        reading = connect(f"{base}/watch", open_timeout=DEADLINE_S, max_size=None, compression=None)
        wait_until(lambda: httpx.get(f"{server.base_url}/v1/sessions/{session_id}").json()["watchers"] == 2,
                   "both watchers to join")
        produced = []
        with connect(f"{base}/stream", open_timeout=DEADLINE_S, max_size=None, compression=None) as ws:
            ws.send(payload(latents, embeds, mask))
            ws.send(FLUSH)
            while isinstance(message := ws.recv(timeout=DEADLINE_S), bytes):
                produced.append(decode_response(message)[1])
        assert [int(meta["frame_end"]) for meta in produced] == [1, *range(4, frames + 1, 3)]
        reading_units, reading_events = read_until_closed(reading)
        assert len(reading_units) == len(produced) and reading_events[-1]["type"] == "done"
        dropped = metric(server, "refiner_watch_units_dropped_total")
        assert dropped > 0, "the stalled watcher's queue never overflowed"
        stalled_units, stalled_events = read_until_closed(stalled)
    told = sum(e["units"] for e in stalled_events if e["type"] == "dropped")
    assert told == dropped and len(stalled_units) + told == len(produced)
    assert stalled_events[-1] == {"type": "done", "frames": frames}
    # What it did get is in order and intact.
    ends = [int(meta["frame_end"]) for _, meta in stalled_units]
    assert ends == sorted(ends) and set(ends) <= {int(meta["frame_end"]) for meta in produced}


def test_watch_refusals_and_http_producers(make_settings):
    latents, embeds, mask = make_clip(frames=4, seed=3)
    with LiveServer(make_settings(max_watchers=1)) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        session_id = http.post("/v1/sessions").json()["session_id"]
        base = f"{server.ws_url}/v1/sessions/{session_id}"
        for url, status in ((f"{base}/watch?outputs=video", 422), (f"{base}/watch?resume_frm=2", 422),
                            (f"{server.ws_url}/v1/sessions/nope/watch", 404)):
            with pytest.raises(InvalidStatus) as refused:
                connect(url, open_timeout=DEADLINE_S)
            assert refused.value.response.status_code == status, url
        with connect(f"{base}/watch", open_timeout=DEADLINE_S, max_size=None) as watcher:
            wait_until(lambda: http.get(f"/v1/sessions/{session_id}").json()["watchers"] == 1, "the watcher")
            with pytest.raises(InvalidStatus) as full:
                connect(f"{base}/watch", open_timeout=DEADLINE_S)
            assert full.value.response.status_code == 503
            refusal = json.loads(full.value.response.body)["error"]
            assert (refusal["code"], refusal["watchers"], refusal["max_watchers"]) == ("over_capacity", 1, 1), refusal
            assert "max_watchers 1" in refusal["message"] and full.value.response.headers["retry-after"]
            watcher.send(payload(latents))  # read-only: an error event, and nothing reaches the session
            assert json.loads(watcher.recv(timeout=DEADLINE_S))["error"]["code"] == "invalid_request"
            assert http.get(f"/v1/sessions/{session_id}").json()["frames_received"] == 0
            # A producer over HTTP: the watcher gets its units too, then done when it flushes.
            reply = http.post(f"/v1/sessions/{session_id}/chunks", params={"flush": True},
                              content=payload(latents, embeds, mask), headers=OCTET)
            assert reply.status_code == 200
            units, events = read_until_closed(watcher)
        assert [int(meta["frame_end"]) for _, meta in units] == [1, 4]
        assert [e["type"] for e in events] == ["block", "done"]
        # Deleting a session ends its watchers with the reason.
        other = http.post("/v1/sessions").json()["session_id"]
        with connect(f"{server.ws_url}/v1/sessions/{other}/watch", open_timeout=DEADLINE_S) as watcher:
            wait_until(lambda: http.get(f"/v1/sessions/{other}").json()["watchers"] == 1, "the watcher")
            assert http.delete(f"/v1/sessions/{other}").status_code == 204
            _, events = read_until_closed(watcher)
            assert events[-1]["error"]["code"] == "session_not_found" and watcher.close_code == 1008


def test_the_session_list_pages_oldest_first(client):
    ids = [client.post("/v1/sessions").json()["session_id"] for _ in range(5)]
    first = client.get("/v1/sessions", params={"limit": 2}).json()
    assert [s["session_id"] for s in first["sessions"]] == ids[:2] and first["next"] == ids[1]
    rest = client.get("/v1/sessions", params={"limit": 10, "after": first["next"]}).json()
    assert [s["session_id"] for s in rest["sessions"]] == ids[2:] and rest["next"] is None
    line = rest["sessions"][0]
    assert {"created_at", "last_active_at", "frames_received", "frames_returned", "flushed", "streaming"} <= set(line)
    client.delete(f"/v1/sessions/{ids[0]}")
    assert [s["session_id"] for s in client.get("/v1/sessions").json()["sessions"]] == ids[1:]
    assert client.get("/v1/sessions", params={"after": "gone"}).status_code == 422
    assert client.get("/v1/sessions", params={"limit": 0}).status_code == 422


def test_a_watcher_joining_a_flushed_session_is_told_done_at_once(make_settings, tmp_path):
    """A session flushed before the watcher joined sends no more units, and its "done" went out at the flush: the
    late watcher gets "done" with the session's frames and a normal close, not a wait until the session's release
    (flushed_session_ttl_s) ended by an error. The same for a flushed session adopted after a restart."""
    latents, embeds, mask = make_clip(frames=4, seed=5)
    folder = tmp_path / "snapshots"
    folder.mkdir()
    settings = make_settings(snapshot_dir=folder, flushed_session_ttl_s=600)
    with LiveServer(settings) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        session_id = http.post("/v1/sessions").json()["session_id"]
        reply = http.post(f"/v1/sessions/{session_id}/chunks", params={"flush": True},
                          content=payload(latents, embeds, mask), headers=OCTET)
        assert reply.status_code == 200, reply.text
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/watch", open_timeout=DEADLINE_S) as watcher:
            units, events = read_until_closed(watcher)
            assert units == [] and events == [{"type": "done", "frames": 4}], events
            assert watcher.close_code == 1000
        # Not one of its watchers any more: the session holds none.
        wait_until(lambda: http.get(f"/v1/sessions/{session_id}").json()["watchers"] == 0, "the watcher gone")
    with LiveServer(settings) as server:  # the drain saved it; this replica adopts it at the watch
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/watch", open_timeout=DEADLINE_S) as watcher:
            units, events = read_until_closed(watcher)
            assert units == [] and events == [{"type": "done", "frames": 4}], events
            assert watcher.close_code == 1000
