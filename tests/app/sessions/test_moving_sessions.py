"""Client-named sessions (PUT /v1/sessions/{id}), finished sessions released after flushed_session_ttl_s, and
sessions that move between replicas through a shared snapshot folder: adopted on their first request, claimed
by exactly one replica, continued bit-identically."""

from __future__ import annotations

import threading
import time

import httpx
import torch

from app.persistence.leases import read_floor

from tests.app.conftest import DEADLINE_S, OCTET, LiveServer, expected_clip, make_clip, payload, read_latents, running_app


def test_put_creates_under_the_clients_id_and_is_idempotent(client):
    session_id = "client-chosen_id-0001"
    created = client.put(f"/v1/sessions/{session_id}", json={"seed": 9, "block_size": 2})
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["session_id"] == session_id and body["config"]["seed"] == 9
    again = client.put(f"/v1/sessions/{session_id}", json={"seed": 9, "block_size": 2})
    assert again.status_code == 200 and again.json() == body, "the same id and config: a safe retry"
    other = client.put(f"/v1/sessions/{session_id}", json={"seed": 10, "block_size": 2})
    assert other.status_code == 409 and other.json()["error"]["code"] == "session_exists"
    assert "seed" in other.json()["error"]["message"]
    for bad in ("short", "has space in it", "x" * 65, "dots.are.not.ok"):
        response = client.put(f"/v1/sessions/{bad}", json={})
        assert response.status_code in (404, 422), bad  # a path with '/' never reaches the route
        if response.status_code == 422:
            assert "8 to 64" in response.json()["error"]["message"]
    assert client.get(f"/v1/sessions/{session_id}").json()["config"]["block_size"] == 2
    assert client.get("/v1/sessions").json()["sessions"][0]["session_id"] == session_id
    assert client.get("/health").headers["x-replica"] == client.app.state.services.settings.replica_id


def test_a_finished_session_is_released_after_its_ttl_and_answers_410(make_settings):
    latents, embeds, mask = make_clip(frames=4)
    with running_app(make_settings(flushed_session_ttl_s=0.3, max_sessions=1)) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        done = client.post(f"/v1/sessions/{session_id}/chunks?flush=true&seq=0",
                           content=payload(latents, embeds, mask), headers=OCTET)
        assert done.status_code == 200
        # Within the TTL the last seq can be repeated.
        again = client.post(f"/v1/sessions/{session_id}/chunks?flush=true&seq=0",
                            content=payload(latents, embeds, mask), headers=OCTET)
        assert again.content == done.content
        time.sleep(0.5)
        # Finished sessions never hold a place: a new one fits although max_sessions is 1.
        assert client.post("/v1/sessions").status_code == 201
        gone = client.get(f"/v1/sessions/{session_id}")
        assert gone.status_code == 410 and "flushed_session_ttl_s" in gone.json()["error"]["message"]
        assert client.put(f"/v1/sessions/{session_id}", json={}).status_code == 410


def test_replicas_sharing_a_folder_adopt_each_session_exactly_once_and_continue_it(make_settings, refiner,
                                                                                  tmp_path):
    """Replica A holds three sessions half-way and drains (saving them to the shared folder). Replicas B and C,
    on the same folder, are asked for every session at the same moment: each session is adopted by exactly one
    of them (the other answers 503 session_moved while the winner holds the session's lease, or 404 once the
    winner took the file), and finishing it there gives the frames of a run that never moved."""
    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=10, seed=21)
    ids = [f"moving-session-{i}" for i in range(3)]
    first_halves = {}
    with LiveServer(make_settings(snapshot_dir=folder, replica_id="replica-a")) as a:
        http = httpx.Client(base_url=a.base_url, timeout=DEADLINE_S)
        for index, session_id in enumerate(ids):
            assert http.put(f"/v1/sessions/{session_id}", json={"seed": index}).status_code == 201
            reply = http.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(latents[:, :, :5], embeds, mask),
                              headers=OCTET)
            assert reply.status_code == 200 and reply.headers["x-replica"] == "replica-a"
            first_halves[session_id] = reply
    # Each file, and its session's floor marker (app.persistence.leases: the generation it was written under, issue 25 item 8).
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".session.generation")) == sorted(
        f"{i}.session.safetensors" for i in ids)
    assert all(read_floor(folder, i) == 1 for i in ids)

    with LiveServer(make_settings(snapshot_dir=folder, replica_id="replica-b")) as b, \
            LiveServer(make_settings(snapshot_dir=folder, replica_id="replica-c")) as c:
        servers = {"replica-b": b, "replica-c": c}
        answers: dict[str, dict[str, int]] = {session_id: {} for session_id in ids}
        start = threading.Barrier(2 * len(ids))

        def ask(name: str, server, session_id: str) -> None:
            start.wait()
            response = httpx.get(f"{server.base_url}/v1/sessions/{session_id}", timeout=DEADLINE_S)
            answers[session_id][name] = response.status_code
            if response.status_code == 503:
                assert response.json()["error"]["code"] == "session_moved", response.text
                assert "held by replica" in response.json()["error"]["message"]

        threads = [threading.Thread(target=ask, args=(name, server, session_id))
                   for session_id in ids for name, server in servers.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE_S)
        for session_id, statuses in answers.items():
            assert sorted(statuses.values()) in ([200, 404], [200, 503]), (session_id, statuses)
        # Every adopted file was loaded and removed; its adopter holds the session's lease while it lives there
        # (issue 25 item 4: a live session holds its lease, checkpoints or not), one generation past the file's.
        assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".session.generation")) == sorted(
            f".{i}.session.lease.0000000002" for i in ids)
        for index, session_id in enumerate(ids):
            owner = next(name for name, status in answers[session_id].items() if status == 200)
            http = httpx.Client(base_url=servers[owner].base_url, timeout=DEADLINE_S)
            # Seq 0's request came with its stored answer: seq 0 with flush is not its retry on the adopter either.
            other = http.post(f"/v1/sessions/{session_id}/chunks?seq=0&flush=true",
                              content=payload(latents[:, :, :5], embeds, mask), headers=OCTET)
            assert other.status_code == 409 and other.json()["error"]["code"] == "seq_conflict", other.status_code
            retry = http.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(latents[:, :, :5], embeds, mask),
                              headers=OCTET)
            assert retry.headers.get("x-replayed") == "true" and retry.content == first_halves[session_id].content
            rest = http.post(f"/v1/sessions/{session_id}/chunks?seq=1&flush=true", content=payload(latents[:, :, 5:]),
                             headers=OCTET)
            assert rest.status_code == 200 and rest.headers["x-replica"] == owner
            refined = torch.cat([read_latents(first_halves[session_id].content)[0], read_latents(rest.content)[0]], dim=2)
            assert torch.equal(refined, expected_clip(refiner, latents, embeds, mask, seed=index))


def test_an_adopted_session_counts_against_max_sessions(make_settings, tmp_path):
    """A full replica does not take a session from the shared folder: 503 too_many_sessions, the file stays for
    a replica with room (or for this one once a place is free)."""
    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=4)
    with running_app(make_settings(snapshot_dir=folder)) as a:
        assert a.put("/v1/sessions/waiting-session-1", json={}).status_code == 201
        assert a.post("/v1/sessions/waiting-session-1/chunks", content=payload(latents, embeds, mask),
                      headers=OCTET).status_code == 200
    with running_app(make_settings(snapshot_dir=folder, max_sessions=1)) as b:
        local = b.post("/v1/sessions").json()["session_id"]
        refused = b.get("/v1/sessions/waiting-session-1")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_sessions"
        assert [p.name for p in folder.iterdir() if not p.name.startswith(".")] == [
            "waiting-session-1.session.safetensors"]  # beside the lease of b's local session
        assert b.delete(f"/v1/sessions/{local}").status_code == 204
        adopted = b.get("/v1/sessions/waiting-session-1")
        assert adopted.status_code == 200 and adopted.json()["frames_returned"] == 4
        # The file was loaded and removed; the lease is b's while the session lives there, one generation past
        # the file's (the floors: the file's generation, and one past the deleted local session's).
        assert sorted(p.name for p in folder.iterdir()) == sorted([
            ".waiting-session-1.session.generation", ".waiting-session-1.session.lease.0000000002",
            f".{local}.session.generation"])
