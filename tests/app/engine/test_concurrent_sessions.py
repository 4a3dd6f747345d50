"""Engine v2 through the service: concurrent sessions of mixed configs batched together and checked against
diffusers' reference, the compiled step, a drain that stops work in the middle, a drain a stuck client cannot
hold up, deliveries that fail, and clips admitted like sessions."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from app.api.factory import create_app
from models.checkpoints import build_model
from tests.reference import REBASED_TOLERANCE, assert_parity, reference_refine

from tests.app.conftest import (
    DEADLINE_S,
    OCTET,
    LiveServer,
    expected_clip,
    make_clip,
    metric_value,
    payload,
    read_latents,
    running_app,
    wait_until,
)

FLUSH = json.dumps({"type": "flush"})


def stream_clip(server, session_id: str, latents, embeds, mask, split: int, units: list) -> None:
    """A WebSocket client: the clip in messages of ``split`` frames, then flush; units appended as they come."""
    with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", open_timeout=DEADLINE_S, max_size=None) as ws:
        for start in range(0, latents.shape[2], split):
            prompt = (embeds, mask) if start == 0 else (None, None)
            ws.send(payload(latents[:, :, start : start + split], *prompt))
        ws.send(FLUSH)
        while isinstance(message := ws.recv(timeout=DEADLINE_S), bytes):
            units.append(read_latents(message))
        assert json.loads(message)["type"] == "done"


def model_calls(server) -> tuple[float, float]:
    """(model calls, rows) the server's engine ran so far, from its metrics."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=DEADLINE_S).text
    values = {}
    for line in text.splitlines():
        if line.startswith("refiner_batch_rows_count") or line.startswith("refiner_batch_rows_sum"):
            name, value = line.split()
            values[name] = float(value)
    return values.get("refiner_batch_rows_count", 0.0), values.get("refiner_batch_rows_sum", 0.0)


def test_concurrent_mixed_config_sessions_are_batched_and_each_equals_the_reference(make_settings, checkpoint_dir):
    """Five sessions at once over WebSockets and HTTP, with different seeds, windows, block sizes, positions,
    prompt lengths and batch: the engine shares model calls between them, and every session's frames equal
    diffusers' SanaWMLTX2Refiner on its own clip (absolute: within the parity tolerance, 1e-5; rebased: 1e-4)."""
    configs = [
        dict(seed=1),
        dict(seed=2, kv_max_frames=7),
        dict(seed=3, positions="rebased"),
        dict(seed=4, block_size=2, kv_max_frames=6),
        dict(seed=5, sink_frames=2, kv_max_frames=8),
    ]
    clips = [make_clip(frames=12 + i, prompt_len=4 + i, seed=10 + i) for i in range(len(configs))]
    outputs: list[list] = [[] for _ in configs]
    with LiveServer(make_settings()) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        ids = [http.post("/v1/sessions", json=config).json()["session_id"] for config in configs]
        calls_before = model_calls(server)

        def over_http(index: int) -> None:
            latents, embeds, mask = clips[index]
            with httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as client:
                for seq, start in enumerate(range(0, latents.shape[2], 5)):
                    last = start + 5 >= latents.shape[2]
                    prompt = (embeds, mask) if seq == 0 else (None, None)
                    reply = client.post(f"/v1/sessions/{ids[index]}/chunks",
                                        params={"seq": seq, "flush": str(last).lower()},
                                        content=payload(latents[:, :, start : start + 5], *prompt), headers=OCTET)
                    assert reply.status_code == 200, reply.text
                    outputs[index].append(read_latents(reply.content))

        threads = [threading.Thread(target=over_http, args=(4,))] + [
            threading.Thread(target=stream_clip, args=(server, ids[i], *clips[i], 3 + i, outputs[i]))
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE_S)
        calls, rows = (after - before for after, before in zip(model_calls(server), calls_before))
        http.close()
    assert rows > calls, "no model call carried more than one session"
    for index, (config, (latents, embeds, mask)) in enumerate(zip(configs, clips)):
        got = torch.cat([units for units, _ in outputs[index] if units.shape[2]], dim=2)
        expected = reference_refine(
            build_model("tiny"), latents, embeds, mask, seed=config["seed"], sink=config.get("sink_frames", 1),
            block=config.get("block_size", 3), kv_max=config.get("kv_max_frames", 11),
        )
        if config.get("positions") == "rebased":
            assert_parity(got, expected, f"session {index} (rebased)", REBASED_TOLERANCE)
        else:
            assert_parity(got, expected, f"session {index}")


def test_compiled_step_is_compiled_before_ready_and_serves_the_same_bytes(make_settings, refiner):
    """compile_step with dynamo's eager backend (the plumbing without a C++ compiler): /ready waits for every
    batch size at every warm-up geometry to be compiled, serving compiles nothing more, and the frames equal the
    eager path's. A stream of a size the warm-up did not list compiles nothing either: it runs eagerly, counted in
    /metrics."""
    settings = make_settings(compile_step=True, compile_backend="eager", compile_mode="default", max_batch_rows=2,
                             warmup_geometries="2x6")
    with TestClient(create_app(settings)) as client:
        import torch._dynamo.utils as dynamo_utils

        reasons = []  # what /ready says while the step compiles: how far it got
        deadline = time.monotonic() + 5 * DEADLINE_S
        while (ready := client.get("/ready")).status_code == 503:
            reasons.append(ready.json()["error"]["message"])
            assert time.monotonic() < deadline and "failed" not in reasons[-1], reasons[-1]
            time.sleep(0.05)
        progress = [int(found[1]) for reason in reasons
                    if (found := re.search(r"compiling the batched step: (\d+) of (\d+) shapes", reason))]
        # 2 batch sizes x the token counts of 4x4 and 2x6 at block 3: 16 x (1, 2, 3) and 12 x (1, 2, 3) frames.
        assert progress and progress == sorted(progress) and max(progress) <= 12, reasons
        assert f"of {2 * 6} shapes" in next(r for r in reasons if "shapes" in r)
        info = client.get("/v1/info").json()["engine"]
        assert info["compile_step"] and info["batch_invariant"] is True
        assert info["compiled"] == {"batch_sizes": [1, 2], "latent_sizes": ["4x4", "2x6"], "mode": "default"}
        assert info["step"] == {"mode": "compiled", "reason": "compile_step: true; compiled during the warm-up"}
        compiled = dynamo_utils.counters["stats"]["unique_graphs"]
        assert compiled > 0
        for height, width in ((4, 4), (2, 6), (3, 3)):  # the warm-up's, a listed one, one nobody listed
            latents, embeds, mask = make_clip(frames=10, height=height, width=width)
            session_id = client.post("/v1/sessions").json()["session_id"]
            reply = client.post(f"/v1/sessions/{session_id}/chunks?flush=true",
                                content=payload(latents, embeds, mask), headers=OCTET)
            assert torch.equal(read_latents(reply.content)[0], expected_clip(refiner, latents, embeds, mask))
            assert dynamo_utils.counters["stats"]["unique_graphs"] == compiled, "a client paid for a compilation"
            uncompiled = metric_value(client.get("/metrics").text, "refiner_uncompiled_model_calls_total")
            assert (uncompiled > 0) is (height == 3), (height, width, uncompiled)


def slow_forwards(server, seconds: float):
    """Every model call of the server takes ``seconds`` longer (a big model on a small machine)."""
    return server.services.refiner.model.transformer_blocks[0].register_forward_pre_hook(
        lambda module, args: time.sleep(seconds)
    )


def test_a_drain_past_its_timeout_saves_what_clients_were_sent_and_resumes_bit_identically(make_settings, refiner,
                                                                                           tmp_path):
    """Work still running when drain_timeout_s passes is stopped between two forwards: the stream's committed
    units all reach its client before the 1012 close and the snapshot says exactly that many frames were returned;
    the HTTP chunk caught half-way is rolled back (503) and its retry after the restart gives the untroubled
    bytes. Both sessions then finish bit-identically on a new server."""
    settings = make_settings(snapshot_dir=tmp_path / "snapshots", drain_timeout_s=0.3)
    streamed, chunked = make_clip(frames=16, seed=1), make_clip(frames=13, seed=2)
    units = []
    with LiveServer(settings) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        stream_id = http.post("/v1/sessions").json()["session_id"]
        chunk_id = http.post("/v1/sessions").json()["session_id"]
        hook = slow_forwards(server, 0.05)
        ws = connect(f"{server.ws_url}/v1/sessions/{stream_id}/stream", open_timeout=DEADLINE_S)
        ws.send(payload(streamed[0][:, :, :13], streamed[1], streamed[2]))  # sink + 4 blocks: 17 forwards
        replies = {}
        request = threading.Thread(target=lambda: replies.update(first=http.post(
            f"/v1/sessions/{chunk_id}/chunks?seq=0&flush=true", content=payload(*chunked), headers=OCTET)))
        request.start()
        units.append(read_latents(ws.recv(timeout=DEADLINE_S)))  # the sink: the job is under way
        report = http.post("/v1/admin/drain").json()
        request.join(DEADLINE_S)
        events = []
        try:
            while True:
                message = ws.recv(timeout=DEADLINE_S)
                if isinstance(message, bytes):
                    units.append(read_latents(message))
                else:
                    events.append(json.loads(message))
        except ConnectionClosed:
            pass
        assert ws.close_code == 1012
        # The message whose work was stopped is told so; its frames are kept (counted in frames_received).
        assert [e["error"]["code"] for e in events] == ["draining"]
        hook.remove()
        http.close()
    assert report["work_stopped"] >= 1, report
    assert replies["first"].status_code == 503 and replies["first"].json()["error"]["code"] == "draining"
    received = int(units[-1][1]["frame_end"])
    assert received < 13, "the drain stopped the stream's work before its end"

    with LiveServer(settings) as server:
        state = httpx.get(f"{server.base_url}/v1/sessions/{stream_id}", timeout=DEADLINE_S).json()
        assert state["frames_returned"] == received, "the snapshot holds exactly what the client was sent"
        assert state["frames_received"] == 13
        with connect(f"{server.ws_url}/v1/sessions/{stream_id}/stream?resume_from={received}",
                     open_timeout=DEADLINE_S) as ws:
            event = json.loads(ws.recv(timeout=DEADLINE_S))
            assert event["type"] == "session" and event["frames_returned"] == received
            ws.send(payload(streamed[0][:, :, 13:]))
            ws.send(FLUSH)
            while isinstance(message := ws.recv(timeout=DEADLINE_S), bytes):
                units.append(read_latents(message))
        retry = httpx.post(f"{server.base_url}/v1/sessions/{chunk_id}/chunks?seq=0&flush=true",
                           content=payload(*chunked), headers=OCTET, timeout=DEADLINE_S)
        assert retry.status_code == 200 and retry.headers.get("x-replayed") is None
    starts = [int(meta["frame_start"]) for _, meta in units]
    assert starts == sorted(set(starts)) and starts[0] == 0, "nothing lost or duplicated"
    assert torch.equal(torch.cat([u for u, _ in units], dim=2), expected_clip(refiner, *streamed))
    assert torch.equal(read_latents(retry.content)[0], expected_clip(refiner, *chunked))


class NeverReads:
    """A WebSocket peer that sends one chunk and then neither reads nor closes: every send and close hangs."""

    def __init__(self, message: bytes):
        self.message = message
        self.sent_once = False
        self.scope = {}
        self.forever = asyncio.Event()

    async def receive(self):
        if not self.sent_once:
            self.sent_once = True
            return {"type": "websocket.receive", "bytes": self.message}
        await self.forever.wait()

    async def send_bytes(self, data):
        await self.forever.wait()

    async def send_text(self, text):
        await self.forever.wait()

    async def close(self, code=1000, reason=""):
        await self.forever.wait()


def test_a_client_that_neither_reads_nor_closes_cannot_hold_the_drain(make_settings):
    from app.api.routes.stream import StreamConnection

    latents, embeds, mask = make_clip(frames=7)
    with running_app(make_settings(drain_timeout_s=0.5)) as client:
        services = client.app.state.services
        session_id = client.post("/v1/sessions").json()["session_id"]
        peer = client.portal.call(lambda: _never_reads(payload(latents, embeds, mask)))
        handle = services.registry.get(session_id)
        running = client.portal.start_task_soon(lambda: StreamConnection(peer, services.sessions.stream_for(handle), services).run())
        wait_until(lambda: handle.session.state.frames_returned == 7, "the stuck stream's units to be refined")
        began = time.monotonic()
        report = client.portal.call(services.drain)
        took = time.monotonic() - began
        running.result(DEADLINE_S)
    assert report["streams_closed"] == 1
    assert took < 2 * 0.5 + 5.0, f"the drain waited {took:.1f} s for a client that never answers"


async def _never_reads(message):
    return NeverReads(message)


def test_a_unit_whose_hand_over_fails_still_reaches_its_client(make_settings, refiner, monkeypatch):
    """The engine's hand-over of a committed unit raises (the loop refused the callback): the unit is still in
    the work's result, and the stream delivers it, in order, before the next ones."""
    from app.outputs import delivery

    original = delivery.Deliveries.hand_over
    calls = {"n": 0}

    def flaky_hand_over(self, received, seq):
        deliver = original(self, received, seq)

        def on_unit(unit):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("event loop is closed (injected)")
            deliver(unit)

        return on_unit

    monkeypatch.setattr(delivery.Deliveries, "hand_over", flaky_hand_over)
    latents, embeds, mask = make_clip(frames=10)
    units = []
    with LiveServer(make_settings()) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=DEADLINE_S).json()["session_id"]
        stream_clip(server, session_id, latents, embeds, mask, 10, units)
    assert calls["n"] >= 2
    assert [int(meta["frame_start"]) for _, meta in units] == [0, 1, 4, 7]
    assert torch.equal(torch.cat([u for u, _ in units], dim=2), expected_clip(refiner, latents, embeds, mask))


def test_a_unit_that_cannot_be_encoded_is_kept_and_sent_on_the_resume(make_settings, refiner, monkeypatch):
    """Encoding a unit fails once: the unit is retained as a tensor, the stream says so and closes (1011), and
    the client's resume gets the unit, encoded then, with nothing lost."""
    from app.outputs import delivery

    original = delivery.Encoder.unit_bytes
    calls = {"n": 0}

    def flaky(self, unit, latents, received, *rest):
        calls["n"] += 1
        if calls["n"] in (2, 3):  # the encoder thread, then the connection's own retry
            raise MemoryError("injected")
        return original(self, unit, latents, received, *rest)

    monkeypatch.setattr(delivery.Encoder, "unit_bytes", flaky)
    latents, embeds, mask = make_clip(frames=7)
    units = []
    with LiveServer(make_settings()) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=DEADLINE_S).json()["session_id"]
        url = f"{server.ws_url}/v1/sessions/{session_id}/stream"
        with connect(url, open_timeout=DEADLINE_S) as ws:
            ws.send(payload(latents, embeds, mask))
            units.append(read_latents(ws.recv(timeout=DEADLINE_S)))
            event = json.loads(ws.recv(timeout=DEADLINE_S))
            assert event["type"] == "error" and event["error"]["code"] == "internal_error"
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=DEADLINE_S)
            assert ws.close_code == 1011
        with connect(f"{url}?resume_from=1", open_timeout=DEADLINE_S) as ws:
            assert json.loads(ws.recv(timeout=DEADLINE_S))["type"] == "session"
            ws.send(FLUSH)
            while isinstance(message := ws.recv(timeout=DEADLINE_S), bytes):
                units.append(read_latents(message))
    assert [int(meta["frame_start"]) for _, meta in units] == [0, 1, 4]
    assert torch.equal(torch.cat([u for u, _ in units], dim=2), expected_clip(refiner, latents, embeds, mask))


def test_clips_hold_session_places_while_they_run_and_share_the_engine(make_settings, refiner):
    """A one-shot clip counts against max_sessions while it is refined (503 too_many_sessions for a new session
    meanwhile), and its forwards share model calls with a stream's instead of holding the engine."""
    latents, embeds, mask = make_clip(frames=40, seed=4)
    with LiveServer(make_settings(max_sessions=2, max_clip_frames=64)) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        stream_id = http.post("/v1/sessions").json()["session_id"]
        hook = slow_forwards(server, 0.02)
        calls_before = model_calls(server)
        clip = {}
        worker = threading.Thread(target=lambda: clip.update(reply=httpx.post(
            f"{server.base_url}/v1/refine", content=payload(latents, embeds, mask), headers=OCTET,
            timeout=DEADLINE_S)))
        worker.start()
        wait_until(lambda: server.services.registry.clips == 1, "the clip to be admitted")
        refused = http.post("/v1/sessions")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_sessions"
        assert "one-shot clips" in refused.json()["error"]["message"]
        units = []
        stream_clip(server, stream_id, *make_clip(frames=10, seed=5), 10, units)
        worker.join(DEADLINE_S)
        hook.remove()
        calls, rows = (after - before for after, before in zip(model_calls(server), calls_before))
        assert server.services.registry.clips == 0
        assert http.post("/v1/sessions").status_code == 201, "the place is free again"
        http.close()
    assert clip["reply"].status_code == 200
    assert torch.equal(read_latents(clip["reply"].content)[0], expected_clip(refiner, latents, embeds, mask))
    assert rows > calls, "the stream's forwards rode along with the clip's"
