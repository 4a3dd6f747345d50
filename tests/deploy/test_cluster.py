"""Three replicas behind the real HAProxy (deploy/local-cluster.sh), eight sessions streaming through it over
WebSockets and HTTP; one replica gets SIGTERM mid-stream. Its sessions are saved to the shared folder by its drain,
their ids hash to the other replicas once it leaves the ring, those adopt them on the clients' next request, and
every client ends with exactly the frames of an uninterrupted single-server run: none lost, none twice."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections import Counter

import httpx
import pytest
import torch

from bench.cluster import Cluster, Units, http_client, ws_client
from models import load_refiner
from tests.app.conftest import expected_clip, make_clip

DEADLINE_S = 60.0
pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy (apt-get install haproxy)")


def settled_get(http: httpx.Client, path: str) -> httpx.Response:
    """GET as the docs ask a client to: a 503 (a replica the router's checks have just taken off the ring or put
    back, a lease being handed over: ``session_moved``) is retried after its Retry-After, for up to DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while (reply := http.get(path)).status_code == 503 and time.monotonic() < deadline:
        time.sleep(min(float(reply.headers.get("retry-after", 1)), 1.0))
    return reply


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
        # Every session ended on a replica that is still up, and the deployment's list (whichever replica the
        # router asks) shows each once, where it is.
        with httpx.Client(base_url=cluster.url, timeout=30) as http:
            where = {}
            for session_id in clips:
                state = settled_get(http, f"/v1/sessions/{session_id}")
                assert state.status_code == 200 and state.headers["x-replica"] != victim, (state.status_code,
                                                                                          state.text)
                assert state.json()["flushed"]
                where[session_id] = state.headers["x-replica"]
            listed = http.get("/v1/sessions").json()
            assert {e["session_id"]: e["replica"] for e in listed["sessions"]} == where
            assert listed["unreachable"] == [f"http://127.0.0.1:{cluster.replica(victim)['port']}"]
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
                state = settled_get(http, f"/v1/sessions/{session_id}")
                assert state.status_code == 200 and state.headers["x-replica"] != victim, (state.status_code,
                                                                                          state.text)
    finally:
        cluster.stop()
    refiner = load_refiner(tmp_path / "cluster" / "cache" / "tiny", device="cpu", dtype="float32")
    for index, (session_id, clip) in enumerate(clips.items()):
        assert units[session_id].received == 25
        assert torch.equal(units[session_id].clip(), expected_clip(refiner, *clip, seed=index)), session_id
