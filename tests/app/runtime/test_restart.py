"""Drain and restore across a real restart: ``python -m app serve`` gets SIGTERM mid-stream, a new process on the
same snapshot folder brings the sessions back, and the clients finish bit-identical to runs that never stopped."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from bench.live import ServerProcess, free_port
from models import load_refiner

from tests.app.conftest import DEADLINE_S, OCTET, expected_clip, make_clip, payload, read_latents


def test_sigterm_saves_sessions_and_the_next_server_continues_them_bit_identically(tmp_path):
    port, cache, snapshots = free_port(), tmp_path / "cache", tmp_path / "snapshots"

    def server() -> ServerProcess:
        return ServerProcess(port, cache, snapshots, tmp_path / "server.log").start()

    latents, embeds, mask = make_clip(frames=16)
    first = server()
    try:
        with httpx.Client(base_url=first.base_url, timeout=DEADLINE_S) as http:
            streamed = http.post("/v1/sessions").json()["session_id"]
            chunked = http.post("/v1/sessions", json={"seed": 7}).json()["session_id"]
            reply = http.post(f"/v1/sessions/{chunked}/chunks?seq=0", content=payload(latents[:, :, :5], embeds, mask),
                              headers=OCTET)
            assert reply.status_code == 200
        url = f"{first.ws_url}/v1/sessions/{streamed}/stream"
        units = []
        with connect(url, open_timeout=DEADLINE_S) as ws:
            ws.send(payload(latents[:, :, :8], embeds, mask))  # the sink, [1, 4), [4, 7); frame 7 pending
            for _ in range(3):
                units.append(read_latents(ws.recv(timeout=DEADLINE_S)))
            # A corrupt file beside the real snapshots: the next start must set it aside, not fail.
            snapshots.mkdir(exist_ok=True)
            (snapshots / "badc0ffee.session.safetensors").write_bytes(b"\x00" * 64)
            assert first.terminate() in (0, -15), first.log()
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=DEADLINE_S)
            assert ws.close_code == 1012 and "service restart" in ws.close_reason
    finally:
        first.kill()
    saved = sorted(p.name for p in snapshots.iterdir())
    assert f"{streamed}.session.safetensors" in saved and f"{chunked}.session.safetensors" in saved

    second = server()
    try:
        # Nothing is claimed at start-up (a replica sharing the folder must not take every session): each session
        # is adopted on its first request, and its file removed then.
        assert sorted(p.name for p in snapshots.iterdir()) == saved
        with connect(f"{second.ws_url}/v1/sessions/{streamed}/stream?resume_from=7", open_timeout=DEADLINE_S) as ws:
            event = json.loads(ws.recv(timeout=DEADLINE_S))
            assert event["type"] == "session"
            assert (event["frames_received"], event["frames_returned"], event["pending_frames"]) == (8, 7, 1)
            ws.send(payload(latents[:, :, 8:]))
            ws.send(json.dumps({"type": "flush"}))
            while isinstance(message := ws.recv(timeout=DEADLINE_S), bytes):
                units.append(read_latents(message))
            assert json.loads(message) == {"type": "done", "frames": 16}
        with httpx.Client(base_url=second.base_url, timeout=DEADLINE_S) as http:
            retry = http.post(f"/v1/sessions/{chunked}/chunks?seq=0", content=payload(latents[:, :, :5], embeds, mask),
                              headers=OCTET)
            assert retry.headers.get("x-replayed") == "true" and retry.content == reply.content
            rest = http.post(f"/v1/sessions/{chunked}/chunks?seq=1&flush=true", content=payload(latents[:, :, 5:]),
                             headers=OCTET)
            assert rest.status_code == 200
            # The corrupt file costs its own session only: 404, and the file is set aside.
            assert http.get("/v1/sessions/badc0ffee").status_code == 404
        names = sorted(p.name for p in snapshots.iterdir())
        # The adopter holds the live sessions' leases (issue 25 item 4: checkpoints or not), one generation past
        # their files', beside the floor markers those files left (issue 25 item 8).
        leases = sorted(f".{sid}.session.{tail}" for sid in (streamed, chunked)
                        for tail in ("generation", "lease.0000000002"))
        assert names == [*leases, "badc0ffee.session.safetensors.corrupt"], \
            "adopted files are removed, the bad one set aside"
        assert "badc0ffee" in second.log() and "cannot be adopted" in second.log()
    finally:
        second.terminate()

    # The server built its tiny refiner in the cache folder; the expectations use that same checkpoint.
    refiner = load_refiner(cache / "tiny", device="cpu", dtype="float32")
    starts = [int(meta["frame_start"]) for _, meta in units]
    assert starts == [0, 1, 4, 7, 10, 13], "nothing lost or duplicated across the restart"
    assert torch.equal(torch.cat([u for u, _ in units], dim=2), expected_clip(refiner, latents, embeds, mask))
    refined = torch.cat([read_latents(reply.content)[0], read_latents(rest.content)[0]], dim=2)
    assert torch.equal(refined, expected_clip(refiner, latents, embeds, mask, seed=7))
