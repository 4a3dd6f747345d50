"""Sessions by memory (app.sessions.parking): their bytes as reported match their tensors; admission by bytes parks idle
sessions to make room and refuses what still does not fit; idle sessions park, spill to snapshot_dir and are
deleted only after session_retention_s; and whatever brings one back (an HTTP chunk, a stream message, a stream
reattach, a watcher), it continues bit-identically, with batching on and a second session sharing the calls."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
import torch
from websockets.sync.client import connect

from app.persistence.leases import read_floor
from models import SessionConfig
from models.session import Geometry
from models.session_bytes import session_bytes_estimate

from tests.app.conftest import (DEADLINE_S, OCTET, EngineHold, LiveServer, expected_clip, make_clip, payload, read_latents,
                       running_app, wait_until)
from tests.app.sessions.test_reliability import FLUSH, drop, receive_until_done, receive_units

LATENTS, EMBEDS, MASK = make_clip(frames=15, seed=31)


def _metric(text: str, name: str, **labels) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}}" if labels else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _state(http, session_id):
    response = http.get(f"/v1/sessions/{session_id}")
    assert response.status_code == 200, response.text
    return response.json()


def _batched(http) -> bool:
    text = http.get("/metrics").text
    return _metric(text, "refiner_batch_rows_sum") > _metric(text, "refiner_batch_rows_count")


def _both(send):
    """Run ``send(0)`` and ``send(1)`` at the same moment (so their forwards share model calls)."""
    results, start = [None, None], threading.Barrier(2)

    def run(index):
        start.wait()
        results[index] = send(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
    return results


def test_a_sessions_bytes_are_its_tensors_in_json_listing_metrics_and_info(make_settings):
    with running_app(make_settings(park_after_s=600)) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        assert client.get(f"/v1/sessions/{session_id}").json()["bytes"]["device"] == 0
        reply = client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(LATENTS[:, :, :6], EMBEDS, MASK),
                            headers=OCTET)
        assert reply.status_code == 200
        handle = client.app.state.services.registry.handles()[0]
        session = handle.session
        owned = [t for t in vars(session.kv).values() if isinstance(t, torch.Tensor)]
        owned += [t for t in (session.state.pending,) if t is not None]
        owned += [t for t in vars(session.state.prompt).values() if isinstance(t, torch.Tensor)]
        owned += [t for t in vars(session._prepared[1]).values() if isinstance(t, torch.Tensor)]
        body = client.get(f"/v1/sessions/{session_id}").json()
        assert body["state"] == "active"
        assert body["bytes"]["device"] == sum(t.nbytes for t in owned) > 0
        assert body["bytes"]["parts"]["kv_window"] == session.kv.window.nbytes
        # The last response, kept for a repeated seq, and its units, kept for a watcher's resume_from.
        kept = [unit.payload for unit in handle.retained]
        assert [(unit.frame_start, unit.frame_end) for unit in handle.retained] == [(0, 1), (1, 4)]
        assert body["bytes"]["host"] == len(reply.content) + sum(map(len, kept))
        assert body["bytes"]["parts"]["retained_units"] == sum(map(len, kept))
        listed = client.get("/v1/sessions").json()["sessions"][0]
        assert listed["state"] == "active" and listed["bytes"]["device"] == body["bytes"]["device"]
        text = client.get("/metrics").text
        assert _metric(text, "refiner_session_bytes", state="active", where="device") == body["bytes"]["device"]
        assert _metric(text, "refiner_sessions", state="active") == 1
        memory = client.get("/v1/info").json()["memory"]
        assert memory["budget"] is None and memory["free"] is None
        # Admission reserved the session's bytes at its first chunk: what it holds, or more (a full step pending).
        assert memory["used"] == max(body["bytes"]["device"], handle.reserved_bytes) >= body["bytes"]["device"]


def _one_session_bytes(refiner, frames_shape, prompt_tokens: int = 0) -> int:
    """What admission reserves for a session whose chunk of ``frames_shape`` brings a prompt of ``prompt_tokens``."""
    batch, channels, frames, height, width = frames_shape
    return sum(session_bytes_estimate(refiner.num_layers, refiner.info.inner_dim, SessionConfig(),
                                      Geometry(batch, channels, height, width), refiner.dtype,
                                      prompt_tokens=prompt_tokens, caption_channels=refiner.info.caption_channels,
                                      chunk_frames=frames).values())


def test_admission_by_bytes_parks_idle_sessions_never_busy_ones_and_refuses_what_does_not_fit(make_settings, refiner,
                                                                                                monkeypatch):
    import app.sessions.parking as parking_module

    staged_on = []  # the threads that page-locked host memory for a park (on CUDA: seconds for a 720p window)
    real_stage = parking_module.stage_host
    monkeypatch.setattr(parking_module, "stage_host",
                        lambda session, device: staged_on.append(threading.current_thread().name)
                        or real_stage(session, device))
    one = _one_session_bytes(refiner, LATENTS[:, :, :5].shape, EMBEDS.shape[1])
    settings = make_settings(device_memory_budget=int(one * 1.5), park_after_s=600, batching=True)
    with LiveServer(settings) as server, httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        assert http.get("/v1/info").json()["memory"]["budget"] == int(one * 1.5)
        a, b = (http.post("/v1/sessions").json()["session_id"] for _ in range(2))
        chunk = lambda sid, part, seq: http.post(f"/v1/sessions/{sid}/chunks?seq={seq}", content=part, headers=OCTET)
        assert chunk(a, payload(LATENTS[:, :, :5], EMBEDS, MASK), 0).status_code == 200
        # a has work queued (the engine is held): it may not be parked, so b's first chunk does not fit.
        hold = EngineHold()
        server.on_loop(server.services.engine.call(hold))
        hold.wait_started()
        queued = threading.Thread(target=chunk, args=(a, payload(LATENTS[:, :, 5:10]), 1))
        queued.start()
        registry = server.services.registry
        wait_until(lambda: registry.existing(a).engine_session.queued == 1, "a's chunk to wait in the engine")
        refused = chunk(b, payload(LATENTS[:, :, :5], EMBEDS, MASK), 0)
        hold.release.set()
        queued.join(DEADLINE_S)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        error = refused.json()["error"]
        assert error["code"] == "insufficient_memory"
        assert f"needs {one} bytes" in error["message"] and "free" in error["message"]
        nothing = _state(http, b)
        assert (nothing["frames_received"], nothing["bytes"]["device"], nothing["kv_cache_bytes"]) == (0, 0, 0)
        # Once a is idle, admission parks it (least recently used, no work) and b fits.
        assert chunk(b, payload(LATENTS[:, :, :5], EMBEDS, MASK), 0).status_code == 200
        assert _state(http, a)["state"] == "parked" and _state(http, b)["state"] == "active"
        assert staged_on and "refiner-engine" not in staged_on, staged_on  # never the engine thread
        # A budget below one session refuses the first chunk however idle the others are.
    with running_app(make_settings(device_memory_budget=one // 2)) as client:
        sid = client.post("/v1/sessions").json()["session_id"]
        refused = client.post(f"/v1/sessions/{sid}/chunks", content=payload(LATENTS[:, :, :5], EMBEDS, MASK),
                              headers=OCTET)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "insufficient_memory"
        clip = client.post("/v1/refine", content=payload(LATENTS, EMBEDS, MASK), headers=OCTET)
        assert clip.status_code == 503 and clip.json()["error"]["code"] == "insufficient_memory"
        # On a stream: the error event, then close 1013 (its next messages would land after a hole).
        with client.websocket_connect(f"/v1/sessions/{sid}/stream") as ws:
            ws.send_bytes(payload(LATENTS[:, :, :5], EMBEDS, MASK))
            event = ws.receive_json()
            assert event["type"] == "error" and event["error"]["code"] == "insufficient_memory"
            assert ws.receive()["code"] == 1013
        assert client.get(f"/v1/sessions/{sid}").json()["frames_received"] == 0


def test_http_chunks_and_a_watcher_page_sessions_in_from_parked_and_spilled_bit_identically(make_settings, refiner,
                                                                                            tmp_path):
    folder = tmp_path / "spill"
    settings = make_settings(snapshot_dir=folder, park_after_s=0.2, spill_after_s=1.5, batching=True)
    expected = [expected_clip(refiner, LATENTS, EMBEDS, MASK, seed=seed) for seed in (0, 1)]
    ids = ["parked-session-0", "parked-session-1"]
    with LiveServer(settings) as server, httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        for index, sid in enumerate(ids):
            assert http.put(f"/v1/sessions/{sid}", json={"seed": index}).status_code == 201
        parts = [payload(LATENTS[:, :, :5], EMBEDS, MASK), payload(LATENTS[:, :, 5:10]), payload(LATENTS[:, :, 10:])]
        got: list[list[torch.Tensor]] = [[], []]

        def send(step):
            flush = "&flush=true" if step == 2 else ""
            replies = _both(lambda i: http.post(f"/v1/sessions/{ids[i]}/chunks?seq={step}{flush}",
                                                content=parts[step], headers=OCTET))
            for index, reply in enumerate(replies):
                assert reply.status_code == 200, reply.text
                got[index].append(read_latents(reply.content)[0])

        send(0)
        for sid in ids:
            wait_until(lambda: _state(http, sid)["state"] == "parked", "the idle session to park")
        parked = _state(http, ids[0])
        assert parked["bytes"]["device"] == 0 and parked["bytes"]["host"] > parked["kv_cache_bytes"] > 0
        assert _metric(http.get("/metrics").text, "refiner_sessions", state="parked") == 2
        send(1)  # back from host memory
        assert _state(http, ids[0])["state"] in ("active", "parked")
        for sid in ids:
            wait_until(lambda: _state(http, sid)["state"] == "spilled", "the parked session to spill", timeout=30)
        # Each file, and its session's floor: the generation it was written under (app.persistence.leases, issue 25 item 8).
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            [*(f"{sid}.session.safetensors" for sid in ids), *(f".{sid}.session.generation" for sid in ids)])
        assert server.services.registry.handles() == [], "spilled sessions hold no memory"
        spilled = _state(http, ids[0])  # described from the stub: the GET brings nothing back
        assert spilled["bytes"]["disk"] > 0 and spilled["frames_returned"] == 10 and spilled["next_seq"] == 2
        assert [s["state"] for s in http.get("/v1/sessions").json()["sessions"]] == ["spilled", "spilled"]
        memory = http.get("/v1/info").json()["memory"]
        assert memory["sessions"]["spilled"] == 2 and memory["disk"] > 0
        text = http.get("/metrics").text
        assert _metric(text, "refiner_session_bytes", state="spilled", where="disk") == memory["disk"]
        # A watcher brings the first session back (adopted from its file); it then sees the last chunk's units.
        with connect(f"{server.ws_url}/v1/sessions/{ids[0]}/watch", open_timeout=DEADLINE_S) as watcher:
            wait_until(lambda: _state(http, ids[0])["state"] == "active", "the watched session to come back")
            # Its file was loaded and removed; its lease is this replica's while it lives here (issue 25 item 4),
            # one generation past the spill's (the count goes on from the floor: item 8).
            assert sorted(p.name for p in folder.iterdir()) == sorted([
                f".{ids[0]}.session.generation", f".{ids[0]}.session.lease.0000000002",
                f".{ids[1]}.session.generation", f"{ids[1]}.session.safetensors"])
            send(2)  # the first one already back, the second from its file
            watched = []
            while True:
                message = watcher.recv(timeout=DEADLINE_S)
                if isinstance(message, bytes):
                    watched.append(read_latents(message)[0])
                elif json.loads(message)["type"] == "done":
                    break
        assert torch.equal(torch.cat(watched, dim=2), got[0][2])
        for index in (0, 1):
            assert torch.equal(torch.cat(got[index], dim=2), expected[index]), f"session {index}"
        text = http.get("/metrics").text
        assert _metric(text, "refiner_page_in_seconds_count", state="parked") >= 2
        assert _metric(text, "refiner_page_in_seconds_count", state="spilled") == 2
        assert _batched(http), "the two sessions' forwards shared model calls"


def test_stream_messages_and_a_reattach_page_sessions_in_bit_identically(make_settings, refiner, tmp_path):
    """A parked session with its stream open comes back for its next message; a dropped stream's session spills
    and its reattach (resume_from) adopts it back; a second session works beside it over HTTP (batching on)."""
    folder = tmp_path / "spill"
    settings = make_settings(snapshot_dir=folder, park_after_s=0.2, spill_after_s=0.6, batching=True)
    expected = expected_clip(refiner, LATENTS, EMBEDS, MASK)
    other_expected = expected_clip(refiner, LATENTS, EMBEDS, MASK, seed=1)
    with LiveServer(settings) as server, httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        sid = http.post("/v1/sessions").json()["session_id"]
        other = http.post("/v1/sessions", json={"seed": 1}).json()["session_id"]
        other_got = []

        def other_chunk(part, flush=False):
            reply = http.post(f"/v1/sessions/{other}/chunks{'?flush=true' if flush else ''}", content=part,
                              headers=OCTET)
            assert reply.status_code == 200, reply.text
            other_got.append(read_latents(reply.content)[0])

        url = f"{server.ws_url}/v1/sessions/{sid}/stream"
        ws = connect(url, open_timeout=DEADLINE_S)
        ws.send(payload(LATENTS[:, :, :4], EMBEDS, MASK))  # the sink [0, 1) and the block [1, 4)
        units = receive_units(ws, 2)
        wait_until(lambda: _state(http, sid)["state"] == "parked", "the streaming session to park")
        time.sleep(0.8)
        assert _state(http, sid)["state"] == "parked", "a session with its stream open never spills"
        helper = threading.Thread(target=other_chunk, args=(payload(LATENTS[:, :, :7], EMBEDS, MASK),))
        helper.start()
        ws.send(payload(LATENTS[:, :, 4:7]))  # a message of a parked session: paged in first
        units += receive_units(ws, 1)
        helper.join(DEADLINE_S)
        drop(ws)
        wait_until(lambda: _state(http, sid)["state"] == "spilled", "the dropped session to spill", timeout=30)
        with connect(f"{url}?resume_from=4", open_timeout=DEADLINE_S) as ws:
            event = json.loads(ws.recv(timeout=DEADLINE_S))
            assert (event["type"], event["frames_returned"], event["resent_from"]) == ("session", 7, 4)
            receive_units(ws, 1)  # [4, 7) again: the client asked from 4
            assert _state(http, sid)["state"] == "active" and not (folder / f"{sid}.session.safetensors").exists()
            helper = threading.Thread(target=other_chunk, args=(payload(LATENTS[:, :, 7:]), True))
            helper.start()
            ws.send(payload(LATENTS[:, :, 7:]))
            ws.send(FLUSH)
            more, done = receive_until_done(ws)
            helper.join(DEADLINE_S)
        assert done == {"type": "done", "frames": 15}
        units += more
        assert torch.equal(torch.cat([u for u, _, _ in units], dim=2), expected)
        assert torch.equal(torch.cat(other_got, dim=2), other_expected)


def test_without_a_snapshot_dir_sessions_stay_parked_and_only_retention_deletes(make_settings, tmp_path):
    with running_app(make_settings(park_after_s=0.05, spill_after_s=0.1, session_retention_s=1.0)) as client:
        sid = client.post("/v1/sessions").json()["session_id"]
        client.post(f"/v1/sessions/{sid}/chunks", content=payload(LATENTS[:, :, :4], EMBEDS, MASK), headers=OCTET)
        assert client.get("/v1/info").json()["memory"]["spill_after_s"] is None
        wait_until(lambda: client.get(f"/v1/sessions/{sid}").json()["state"] == "parked", "the session to park")
        time.sleep(0.3)
        assert client.get(f"/v1/sessions/{sid}").json()["state"] == "parked", "nowhere to spill to"
        registry = client.app.state.services.registry
        wait_until(lambda: len(registry) == 0, "retention to end the session")  # a GET would count as activity
        assert client.get(f"/v1/sessions/{sid}").status_code == 410
        assert "session_retention_s" in client.get(f"/v1/sessions/{sid}").json()["error"]["message"]
    folder = tmp_path / "spill"
    with running_app(make_settings(snapshot_dir=folder, park_after_s=0.05, spill_after_s=0.1,
                                   session_retention_s=1.0)) as client:
        sid = client.post("/v1/sessions").json()["session_id"]
        client.post(f"/v1/sessions/{sid}/chunks", content=payload(LATENTS[:, :, :4], EMBEDS, MASK), headers=OCTET)
        # Polled by GETs all along, it spills all the same: a GET is not work, and reads the spilled one in place.
        wait_until(lambda: client.get(f"/v1/sessions/{sid}").json()["state"] == "spilled", "the session to spill")
        assert list(folder.glob("*.session.safetensors")) and len(client.app.state.services.registry) == 0
        # Its floor stays, one past the spill's generation: a copy of the file put back is not adopted (item 8).
        wait_until(lambda: [p.name for p in folder.iterdir()] == [f".{sid}.session.generation"],
                   "retention to end the spilled one and remove its file", timeout=30)
        assert read_floor(folder, sid) == 2
        gone = client.get(f"/v1/sessions/{sid}")
        assert gone.status_code == 410 and "session_retention_s" in gone.json()["error"]["message"]
        other = client.post("/v1/sessions").json()["session_id"]
        client.post(f"/v1/sessions/{other}/chunks", content=payload(LATENTS[:, :, :4], EMBEDS, MASK), headers=OCTET)
        wait_until(lambda: client.get(f"/v1/sessions/{other}").json()["state"] == "spilled", "the second to spill")
        assert client.delete(f"/v1/sessions/{other}").status_code == 204
        assert sorted(p.name for p in folder.iterdir()) == sorted(f".{i}.session.generation" for i in (sid, other))
        assert read_floor(folder, other) == 2 and client.get(f"/v1/sessions/{other}").status_code == 404


def test_memory_settings_read_units_and_keep_the_old_idle_timeout_name(make_settings):
    assert make_settings(device_memory_budget="40GiB").device_memory_budget == 40 * 2**30
    assert make_settings(device_memory_budget="1.5e9").device_memory_budget == 1_500_000_000
    assert make_settings(device_memory_budget="auto").device_memory_budget == "auto"
    assert make_settings().device_memory_budget is None
    with pytest.raises(ValueError, match="not a number of bytes.*40GiB"):
        make_settings(device_memory_budget="lots")
    assert make_settings(session_idle_timeout_s=90).retention_s == 90, "the older name still sets the retention"
    assert make_settings(session_idle_timeout_s=90, session_retention_s=5).retention_s == 5


def test_an_auto_budget_counts_the_allocators_unused_cache_as_free(make_settings, monkeypatch):
    """``device_memory_budget: auto`` on CUDA: the caching allocator's unused blocks (the warm-up's activations)
    are handed back before the free memory is read, so the budget is not short by them. torch.cuda's two calls
    are stubbed: the order is what is tested."""
    from app.sessions.parking import Parking

    calls, cached = [], [6 * 2**30]

    def empty_cache():
        calls.append("empty_cache")
        cached[0] = 0

    def mem_get_info(device):
        calls.append(("mem_get_info", str(device)))
        return 100 * 2**30 - cached[0], 141 * 2**30  # free: less what the cache still holds

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    parking = Parking.__new__(Parking)  # only its settings take part in resolving the budget
    parking.settings = make_settings(device_memory_budget="auto", device_memory_reserve="2GiB")
    parking.resolve_budget(torch.device("cuda", 1))
    assert calls == ["empty_cache", ("mem_get_info", "cuda:1")]
    assert parking.budget == 98 * 2**30


def test_a_spill_gives_way_to_a_request_that_arrives_while_it_is_written(make_settings, refiner, tmp_path):
    """The spill's file is written while a chunk arrives for the session: the spill is abandoned (its file removed,
    so no replica can adopt a copy that is about to be stale), the session stays here and the chunk continues it."""
    folder = tmp_path / "spill"
    expected = expected_clip(refiner, LATENTS, EMBEDS, MASK)
    with LiveServer(make_settings(snapshot_dir=folder, park_after_s=600, spill_after_s=600)) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        sid = http.post("/v1/sessions").json()["session_id"]
        first = http.post(f"/v1/sessions/{sid}/chunks", content=payload(LATENTS[:, :, :7], EMBEDS, MASK), headers=OCTET)
        services = server.services
        handle, parking = services.registry.existing(sid), services.store.parking
        assert server.on_loop(parking.park(handle)).result(DEADLINE_S)
        hold = EngineHold()
        server.on_loop(services.engine.call(hold))
        hold.wait_started()
        spill = server.on_loop(parking.spill(handle))
        wait_until(lambda: len(services.engine._inbox) == 1, "the spill to wait for the engine to read the session")
        replies = []
        sender = threading.Thread(target=lambda: replies.append(http.post(
            f"/v1/sessions/{sid}/chunks?flush=true", content=payload(LATENTS[:, :, 7:]), headers=OCTET)))
        sender.start()
        wait_until(lambda: handle.chunks.waiting == 1, "the chunk to wait for the session")
        hold.release.set()
        assert spill.result(DEADLINE_S) is False, "the spill gave way"
        sender.join(DEADLINE_S)
        assert replies[0].status_code == 200, replies[0].text
        # The file is removed; the live session keeps its lease (issue 25 item 4: checkpoints or not); the floor
        # is the abandoned write's generation, the lease's own (item 8): its later writes are not below it.
        assert sorted(p.name for p in folder.iterdir()) == [f".{sid}.session.generation",
                                                            f".{sid}.session.lease.0000000001"]
        assert services.registry.existing(sid) is handle
        assert _state(http, sid)["state"] == "active"
        refined = torch.cat([read_latents(first.content)[0], read_latents(replies[0].content)[0]], dim=2)
        assert torch.equal(refined, expected)


def test_session_files_nobody_asked_for_within_retention_are_deleted_unless_leased(make_settings, tmp_path):
    """A replica that spilled or drained sessions and then restarted no longer tracks them: their files must not
    stay forever. At start-up (and every sweep) a session file older than session_retention_s with no lease goes;
    a leased one (a live session's checkpoint on another replica) and a recent one stay."""
    import os

    from app.persistence import leases

    folder = tmp_path / "snapshots"
    folder.mkdir()
    old = time.time() - 1000
    for name in ("forgotten-session", "leased-session", "recent-session"):
        path = folder / f"{name}.session.safetensors"
        path.write_bytes(b"x")  # the sweep reads names, times and leases only
        if name != "recent-session":
            os.utime(path, (old, old))
    leases.acquire(folder, "leased-session", "replica-elsewhere", 10_000.0)
    settings = make_settings(warmup=False, snapshot_dir=folder, session_retention_s=100)
    with running_app(settings):
        left = sorted(p.name for p in folder.glob("*.session.safetensors"))
    assert left == ["leased-session.session.safetensors", "recent-session.session.safetensors"]


@pytest.mark.parametrize("shape", [(1, 128, 1, 3, 1, 1), (1, 128, 2, 4), (1, 128, 2, 0, 4)])
def test_latents_of_no_session_geometry_are_the_sessions_422_not_an_estimate_crash(make_settings, shape):
    """The bytes estimate runs before the session's own checks (admission precedes allocation): latents of another
    rank or with an empty axis must still get the session's clear 422, on a clip and on a session's first chunk."""
    latents = torch.zeros(shape)
    with running_app(make_settings(warmup=False, device_memory_budget="1GiB")) as client:
        clip = client.post("/v1/refine", content=payload(latents, EMBEDS, MASK), headers=OCTET)
        sid = client.post("/v1/sessions").json()["session_id"]
        chunk = client.post(f"/v1/sessions/{sid}/chunks?seq=0", content=payload(latents, EMBEDS, MASK), headers=OCTET)
    for reply in (clip, chunk):
        assert reply.status_code == 422, reply.text
        assert reply.json()["error"]["code"] == "invalid_input"


def _the_one_session(client) -> str:
    """A session with its first chunk (so it may be parked and spilled), taking a server's one place."""
    sid = client.post("/v1/sessions").json()["session_id"]
    reply = client.post(f"/v1/sessions/{sid}/chunks", content=payload(LATENTS[:, :, :4], EMBEDS, MASK), headers=OCTET)
    assert reply.status_code == 200, reply.text
    return sid


def test_a_full_server_s_retry_after_counts_the_spill_that_frees_a_place(make_settings, tmp_path):
    """At max_sessions, a 503 too_many_sessions says when a place frees: an idle session is spilled to snapshot_dir
    (spilled ones hold no place) long before it is released, so its Retry-After is the spill's time, not the
    retention's (it said about session_retention_s, 600 s here, while a place freed within seconds)."""
    settings = make_settings(snapshot_dir=tmp_path / "spill", max_sessions=1, park_after_s=1.0, spill_after_s=3.0,
                             session_retention_s=600.0)
    with running_app(settings) as client:
        sid = _the_one_session(client)
        sent = time.monotonic()  # its work ended (before the reply): the spill is due at most 3 s + a round from now
        full = client.post("/v1/sessions")
        assert full.status_code == 503 and full.json()["error"]["code"] == "too_many_sessions", full.text
        spilled_in = 3.0 + settings.upkeep_interval_s - (time.monotonic() - sent)
        assert int(full.headers["retry-after"]) <= spilled_in + 2, full.headers["retry-after"]  # (rounded up)
        assert "spilled to snapshot_dir" in full.json()["error"]["message"]
        wait_until(lambda: client.get(f"/v1/sessions/{sid}").json()["state"] == "spilled", "the session to spill")
        assert client.post("/v1/sessions").status_code == 201


def test_a_spill_that_failed_is_not_counted_on_by_the_retry_after(make_settings, tmp_path, monkeypatch):
    """The timer tried to spill the idle session and could not (a full disk): until its next work, a full server's
    Retry-After no longer counts on that spill (it said 0 s, again and again, so clients spent their tries in
    seconds) but on the session's release."""
    import app.sessions.parking as parking_module

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(parking_module, "write_fenced", full_disk)
    settings = make_settings(snapshot_dir=tmp_path / "spill", max_sessions=1, park_after_s=0.2, spill_after_s=0.5,
                             session_retention_s=600.0)
    with running_app(settings) as client:
        sid = _the_one_session(client)
        handle = client.app.state.services.registry.existing(sid)
        wait_until(lambda: handle.spill_declined_at is not None, "the timer's spill to fail")
        full = client.post("/v1/sessions")
        assert full.status_code == 503 and full.json()["error"]["code"] == "too_many_sessions", full.text
        assert int(full.headers["retry-after"]) >= 590, full.headers["retry-after"]
        assert "is released in" in full.json()["error"]["message"]


def test_a_spill_that_failed_is_tried_again_only_spill_after_s_later(make_settings, tmp_path, monkeypatch):
    """A full or read-only snapshot_dir: each try of a spill reads the whole session on the engine thread and writes
    it, and fails. The timer tries a parked session whose spill failed again only spill_after_s after that failure
    (it tried at every round, every upkeep_interval_s: a session's bytes copied and a traceback logged per parked
    session per round for as long as the disk stayed full)."""
    import errno

    import app.sessions.parking as parking_module

    tries = []

    def full_disk(*args, **kwargs):
        tries.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(parking_module, "write_fenced", full_disk)
    settings = make_settings(snapshot_dir=tmp_path / "spill", park_after_s=60.0, spill_after_s=120.0,
                             session_retention_s=6000.0)
    with running_app(settings) as client:
        services = client.app.state.services
        parking, now = services.store.parking, [time.monotonic()]
        services.registry.clock = lambda: now[0]  # the timer's rounds are run here, at the times this test says
        sid = _the_one_session(client)
        now[0] += 200.0
        client.portal.call(parking.tick)
        assert len(tries) == 1 and client.get(f"/v1/sessions/{sid}").json()["state"] == "parked"
        for _ in range(3):  # the next rounds, within spill_after_s of the failure
            now[0] += 10.0
            client.portal.call(parking.tick)
        assert len(tries) == 1, "a failed spill was tried again at every round of the timer"
        now[0] += 120.0
        client.portal.call(parking.tick)
        assert len(tries) == 2, "a failed spill was never tried again"
        assert client.get(f"/v1/sessions/{sid}").json()["state"] == "parked"
