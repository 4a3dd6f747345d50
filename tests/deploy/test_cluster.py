"""Three replicas behind the real HAProxy (deploy/local-cluster.sh), eight sessions streaming through it over
WebSockets and HTTP; one replica gets SIGTERM mid-stream. Its sessions are saved to the shared folder by its drain,
their ids hash to the other replicas once it leaves the ring, those adopt them on the clients' next request, and
every client ends with exactly the frames of an uninterrupted single-server run: none lost, none twice."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.sync.client import connect

from app.codec import decode_response
from models import load_refiner
from tests.app.conftest import OCTET, expected_clip, make_clip, payload

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0
pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy (apt-get install haproxy)")


class Cluster:
    def __init__(self, state_dir: Path, replicas: int, *options: str):
        self.state_dir = state_dir
        port = _free_port()
        self.process = subprocess.Popen(
            ["bash", str(ROOT / "deploy" / "local-cluster.sh"), "--replicas", str(replicas), "--port", str(port),
             "--state-dir", str(state_dir), *options],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        deadline = time.monotonic() + 600
        info = state_dir / "cluster.json"
        while not info.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the cluster did not start:\n{self.process.stdout.read()}")
            time.sleep(0.1)
        self.info = json.loads(info.read_text())
        self.url = f"http://127.0.0.1:{self.info['router_port']}"
        self.ws_url = f"ws://127.0.0.1:{self.info['router_port']}"

    def replica(self, replica_id: str) -> dict:
        return next(r for r in self.info["replicas"] if r["replica_id"] == replica_id)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


def _free_port() -> int:
    from bench.live import free_port

    return free_port()


class Units:
    """A client's refined frames in order: a unit it already has (sent again after a move) is skipped, a gap fails."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.received = 0
        self.duplicates = 0

    def add(self, latents: torch.Tensor, start: int, end: int) -> None:
        if end <= self.received:
            self.duplicates += 1
            return
        assert start == self.received, f"a gap: got [{start}, {end}) after {self.received} frames"
        self.parts.append(latents)
        self.received = end

    def clip(self) -> torch.Tensor:
        return torch.cat(self.parts, dim=2)


def ws_client(cluster: Cluster, session_id: str, latents, embeds, mask, units: Units, progress: threading.Event):
    """Closed loop over the stream: a chunk, then its block; after a close or a failed connect, reconnect through
    the router with ?resume_from=<frames received> and resend from the frames the session says it has."""
    frames = latents.shape[2]
    deadline = time.monotonic() + DEADLINE_S

    def read_until(ws, frame: int) -> None:
        while units.received < frame:
            message = ws.recv(timeout=30)
            if isinstance(message, str):
                event = json.loads(message)
                # A message refused because the replica is draining was not taken: the close (1012) follows, and
                # the session event after the reconnect says what to send again.
                assert event["type"] != "error" or event["error"]["code"] == "draining", message
                continue
            tensors, meta = decode_response(message)
            units.add(tensors["latents"], int(meta["frame_start"]), int(meta["frame_end"]))
            if units.received >= 4:
                progress.set()

    while True:
        assert time.monotonic() < deadline, f"{session_id}: gave up"
        try:
            url = f"{cluster.ws_url}/v1/sessions/{session_id}/stream?resume_from={units.received}"
            with connect(url, open_timeout=10, max_size=None) as ws:
                event = json.loads(ws.recv(timeout=30))
                assert event["type"] == "session", event
                cursor = event["frames_received"]
                while cursor < frames:
                    end = 4 if cursor == 0 else min(cursor + 3, frames)
                    ws.send(payload(latents[:, :, cursor:end], *((embeds, mask) if cursor == 0 else ())))
                    cursor = end
                    read_until(ws, cursor)  # the chunks follow the block grid: each one completes its block
                    time.sleep(0.05)
                read_until(ws, frames)
                ws.send(json.dumps({"type": "flush"}))
                while not (isinstance(message := ws.recv(timeout=30), str) and json.loads(message)["type"] == "done"):
                    pass
                return
        except (ConnectionClosed, InvalidHandshake, OSError, TimeoutError):
            time.sleep(0.2)  # draining (503), moving (404 until adopted), or gone: try again through the router


def _holds(port: int, session_id: str):
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v1/sessions/{session_id}", timeout=5).status_code
    except httpx.HTTPError as exc:
        return repr(exc)


def http_client(cluster: Cluster, session_id: str, latents, embeds, mask, units: Units, progress: threading.Event):
    frames = latents.shape[2]
    bounds = [0, 4, *range(7, frames, 3), frames]
    deadline = time.monotonic() + DEADLINE_S
    last = None
    with httpx.Client(base_url=cluster.url, timeout=30) as http:
        for seq, (start, end) in enumerate(zip(bounds, bounds[1:])):
            body = payload(latents[:, :, start:end], *((embeds, mask) if seq == 0 else ()))
            while True:
                if time.monotonic() > deadline:
                    where = {r["replica_id"]: _holds(r["port"], session_id) for r in cluster.info["replicas"]}
                    raise AssertionError(f"{session_id}: gave up at seq {seq}; last answer "
                                         f"{last and (last.status_code, last.headers.get('x-replica'), last.text[:200])}; "
                                         f"held by {where}; files {sorted(p.name for p in (cluster.state_dir / 'snapshots').iterdir())}")
                try:
                    reply = http.post(f"/v1/sessions/{session_id}/chunks", params={"seq": seq, "flush": end == frames},
                                      content=body, headers=OCTET)
                except httpx.HTTPError:
                    time.sleep(0.2)
                    continue
                last = reply
                if reply.status_code in (503, 404):  # draining, or the session is on its way to another replica
                    time.sleep(0.2)
                    continue
                assert reply.status_code == 200, reply.text
                break
            tensors, meta = decode_response(reply.content)
            if tensors["latents"].shape[2]:
                units.add(tensors["latents"], int(meta["frame_start"]), int(meta["frame_end"]))
            if units.received >= 4:
                progress.set()
            time.sleep(0.05)


def test_a_replica_drained_mid_stream_hands_its_sessions_over_bit_identically(tmp_path):
    cluster = Cluster(tmp_path / "cluster", replicas=3)
    try:
        clips, owners, units, threads = {}, Counter(), {}, []
        progress = {}
        with httpx.Client(base_url=cluster.url, timeout=30) as http:
            for index in range(8):
                created = http.post("/v1/sessions", json={"seed": index})
                assert created.status_code == 201, created.text
                session_id = created.json()["session_id"]
                owners[created.headers["x-replica"]] += 1
                clips[session_id] = make_clip(frames=25, seed=100 + index)
                units[session_id] = Units()
                progress[session_id] = threading.Event()
                client = ws_client if index % 2 == 0 else http_client
                threads.append(threading.Thread(
                    target=client, args=(cluster, session_id, *clips[session_id], units[session_id],
                                         progress[session_id]), daemon=True))
        for thread in threads:
            thread.start()
        for event in progress.values():
            assert event.wait(DEADLINE_S), "a session never got going"
        # Drain the replica holding the most sessions, mid-stream.
        victim, held = owners.most_common(1)[0]
        assert held >= 2
        os.kill(cluster.replica(victim)["pid"], signal.SIGTERM)
        for thread in threads:
            thread.join(DEADLINE_S)
            assert not thread.is_alive(), "a client did not finish"
        # Every session ended on a replica that is still up.
        with httpx.Client(base_url=cluster.url, timeout=30) as http:
            for session_id in clips:
                state = http.get(f"/v1/sessions/{session_id}")
                assert state.status_code == 200 and state.headers["x-replica"] != victim
                assert state.json()["flushed"]
    finally:
        cluster.stop()
    refiner = load_refiner(tmp_path / "cluster" / "cache" / "tiny", device="cpu", dtype="float32")
    for index, (session_id, clip) in enumerate(clips.items()):
        got = units[session_id]
        assert got.received == 25
        assert torch.equal(got.clip(), expected_clip(refiner, *clip, seed=index)), session_id


def test_a_replica_killed_mid_stream_loses_nothing_its_checkpoints_cover(tmp_path):
    """kill -9 of a replica: no drain, no goodbye. Its sessions come back on the replica their ids now hash to,
    from their last checkpoint (one per block here); each client reconnects with the frames it has, resends from
    the frame the session event names, and ends with the frames of an uninterrupted run, none twice."""
    cluster = Cluster(tmp_path / "cluster", 3, "--checkpoint-every-blocks", "1")
    try:
        clips, owners, units, progress, threads = {}, {}, {}, {}, []
        with httpx.Client(base_url=cluster.url, timeout=30) as http:
            for index in range(6):
                created = http.post("/v1/sessions", json={"seed": index})
                assert created.status_code == 201, created.text
                session_id = created.json()["session_id"]
                owners[session_id] = created.headers["x-replica"]
                clips[session_id] = make_clip(frames=25, seed=200 + index)
                units[session_id], progress[session_id] = Units(), threading.Event()
                threads.append(threading.Thread(target=ws_client, args=(cluster, session_id, *clips[session_id],
                                                                        units[session_id], progress[session_id]),
                                                daemon=True))
        for thread in threads:
            thread.start()
        for event in progress.values():
            assert event.wait(DEADLINE_S), "a session never got going"
        victim, held = Counter(owners.values()).most_common(1)[0]
        assert held >= 1
        # Killed once each of its sessions has a checkpoint (one per block; a session killed before its first
        # would be lost, as documented).
        folder = cluster.state_dir / "snapshots"
        for session_id in (s for s, owner in owners.items() if owner == victim):
            deadline = time.monotonic() + DEADLINE_S
            while not (folder / f"{session_id}.session.safetensors").exists():
                assert time.monotonic() < deadline, "no checkpoint was written"
                time.sleep(0.02)
        os.kill(cluster.replica(victim)["pid"], signal.SIGKILL)
        for thread in threads:
            thread.join(DEADLINE_S)
            assert not thread.is_alive(), "a client did not finish"
        with httpx.Client(base_url=cluster.url, timeout=30) as http:
            for session_id in clips:
                state = http.get(f"/v1/sessions/{session_id}")
                assert state.status_code == 200 and state.headers["x-replica"] != victim
    finally:
        cluster.stop()
    refiner = load_refiner(tmp_path / "cluster" / "cache" / "tiny", device="cpu", dtype="float32")
    for index, (session_id, clip) in enumerate(clips.items()):
        assert units[session_id].received == 25
        assert torch.equal(units[session_id].clip(), expected_clip(refiner, *clip, seed=index)), session_id
