"""Metrics count what happened; shutdown drains (in-flight blocks delivered, then close 1001 with a reason)."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from tests.app.conftest import (
    DEADLINE_S,
    OCTET,
    EngineHold,
    LiveServer,
    expected_clip,
    make_clip,
    payload,
    read_latents,
    running_app,
    wait_until,
)


def scrape(client) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_blocks_frames_and_sessions(make_settings):
    with running_app(make_settings()) as client:
        start = scrape(client)
        assert value(start, "refiner_blocks_refined_total") == 0, "the warm-up is not a client's block"
        assert value(start, "refiner_active_sessions") == 0

        latents, embeds, mask = make_clip(frames=8)
        a = client.post("/v1/sessions").json()["session_id"]
        b = client.post("/v1/sessions").json()["session_id"]
        # a: 8 frames over HTTP, flushed -> the sink, blocks [1, 4) [4, 7) and the short [7, 8).
        client.post(f"/v1/sessions/{a}/chunks", content=payload(latents[:, :, :5], embeds, mask), headers=OCTET)
        client.post(f"/v1/sessions/{a}/chunks?flush=true", content=payload(latents[:, :, 5:]), headers=OCTET)
        # b: 7 frames over the WebSocket, not flushed -> the sink and two blocks.
        with client.websocket_connect(f"/v1/sessions/{b}/stream") as ws:
            ws.send_bytes(payload(latents[:, :, :7], embeds))
            for _ in range(3):
                assert ws.receive().get("bytes")
        # The stream's job settles just after its last unit went out.
        wait_until(lambda: client.app.state.services.engine.outstanding == 0, "the stream's job to settle")
        # A rejected chunk counts as rejected, not as frames.
        assert client.post(f"/v1/sessions/{a}/chunks", content=b"junk", headers=OCTET).status_code == 400

        samples = scrape(client)
        assert value(samples, "refiner_blocks_refined_total") == 5
        assert value(samples, "refiner_block_latency_seconds_count") == 5
        assert value(samples, "refiner_time_to_first_block_seconds_count") == 2
        assert value(samples, "refiner_frames_in_total") == 15
        assert value(samples, "refiner_frames_out_total") == 15
        assert value(samples, "refiner_active_sessions") == 2
        assert value(samples, "refiner_engine_queue_depth") == 0
        assert value(samples, "refiner_rejected_requests_total", reason="invalid_payload") == 1
        states = [client.get(f"/v1/sessions/{s}").json() for s in (a, b)]
        assert value(samples, "refiner_kv_cache_bytes") == sum(s["kv_cache_bytes"] for s in states) > 0
        chunk_requests = value(
            samples,
            "refiner_http_request_duration_seconds_count",
            route="/v1/sessions/{session_id}/chunks",
            method="POST",
            status="200",
        )
        assert chunk_requests == 2
        text = client.get("/metrics").text
        assert a not in text and b not in text, "no per-session labels"

        assert client.delete(f"/v1/sessions/{a}").status_code == 204
        samples = scrape(client)
        assert value(samples, "refiner_active_sessions") == 1
        assert value(samples, "refiner_kv_cache_bytes") == states[1]["kv_cache_bytes"]

        # A one-shot clip's frames count in and out as a session's do.
        assert client.post("/v1/refine", content=payload(latents, embeds, mask), headers=OCTET).status_code == 200
        samples = scrape(client)
        assert value(samples, "refiner_frames_in_total") == 15 + 8
        assert value(samples, "refiner_frames_out_total") == 15 + 8


def test_shutdown_finishes_in_flight_blocks_then_closes_streams_with_1001(make_settings, refiner):
    server = LiveServer(make_settings())
    with server:
        services = server.services
        latents, embeds, mask = make_clip(frames=7)
        with httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
            session_id = http.post("/v1/sessions").json()["session_id"]
        hold = EngineHold()
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", open_timeout=DEADLINE_S) as ws:
            # Hold the engine so the chunk is provably in flight when the shutdown starts.
            blocker = server.on_loop(services.engine.call(hold))
            hold.wait_started()
            ws.send(payload(latents, embeds, mask))
            wait_until(lambda: services.engine.outstanding == 1, "the chunk to reach the engine")
            server.server.should_exit = True
            wait_until(lambda: services.draining, "the drain to start")
            hold.release.set()
            blocker.result(DEADLINE_S)
            units = []
            with pytest.raises(Exception):
                while True:
                    message = ws.recv(timeout=DEADLINE_S)
                    assert isinstance(message, bytes), message
                    units.append(read_latents(message)[0])
            assert ws.close_code == 1001
            assert "shutting down" in ws.close_reason
        server.thread.join(DEADLINE_S)
        assert not server.thread.is_alive()
    refined = torch.cat(units, dim=2)
    assert torch.equal(refined, expected_clip(refiner, latents, embeds, mask)[:, :, :7])


def test_draining_refuses_new_streams(make_settings):
    with running_app(make_settings()) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        client.portal.call(client.app.state.services.drain)
        from starlette.testclient import WebSocketDenialResponse

        with pytest.raises(WebSocketDenialResponse) as denied:
            with client.websocket_connect(f"/v1/sessions/{session_id}/stream"):
                pass
        assert denied.value.status_code == 503
        assert denied.value.headers["retry-after"]


def test_second_stream_on_a_session_is_refused(make_settings):
    with running_app(make_settings()) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        from starlette.testclient import WebSocketDenialResponse

        with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
            with pytest.raises(WebSocketDenialResponse) as denied:
                with client.websocket_connect(f"/v1/sessions/{session_id}/stream"):
                    pass
            assert denied.value.status_code == 409
            ws.send_text(json.dumps({"type": "flush"}))
            assert json.loads(ws.receive_text()) == {"type": "done", "frames": 0}


def test_info_reports_model_defaults_and_limits(make_settings):
    with running_app(make_settings(max_frames_per_chunk=5, default_block_size=2)) as client:
        info = client.get("/v1/info").json()
        assert info["model"]["class"] == "SanaWMLTX2RefinerTransformer3DModel"
        assert (info["model"]["layers"], info["model"]["channels"], info["model"]["caption_channels"]) == (2, 128, 32)
        assert (info["model"]["dtype"], info["model"]["device"]) == ("float32", "cpu")
        assert info["default_session_config"]["block_size"] == 2
        assert info["limits"]["max_frames_per_chunk"] == 5
        created = client.post("/v1/sessions", json={"seed": 5}).json()
        assert created["config"]["block_size"] == 2 and created["config"]["seed"] == 5


class StalledClient:
    """A WebSocket peer that sends its messages but never reads: every send blocks until ``unblock``."""

    def __init__(self, messages):
        import asyncio

        self.messages = list(messages)
        self.received = 0
        self.sent = []
        self.sending = False
        self.unblock = asyncio.Event()
        self.scope = {}

    async def receive(self):
        if self.received < len(self.messages):
            self.received += 1
            return {"type": "websocket.receive", "bytes": self.messages[self.received - 1]}
        await self.unblock.wait()
        return {"type": "websocket.disconnect", "code": 1000}

    async def send_bytes(self, data):
        self.sending = True
        await self.unblock.wait()
        self.sent.append(data)

    async def send_text(self, text):
        await self.unblock.wait()

    async def close(self, code=1000, reason=""):
        pass


def test_a_slow_reader_stalls_only_its_own_stream(make_settings, refiner):
    from app.api.routes.stream import StreamConnection

    with running_app(make_settings(ws_outbound_queue=1)) as client:
        services = client.app.state.services
        latents, embeds, mask = make_clip(frames=13)
        slow_id = client.post("/v1/sessions").json()["session_id"]
        messages = [payload(latents[:, :, :4], embeds, mask)] + [
            payload(latents[:, :, i : i + 3]) for i in (4, 7, 10)
        ]
        peer = client.portal.call(lambda: _make_peer(messages))
        handle = services.registry.get(slow_id)
        running = client.portal.start_task_soon(lambda: StreamConnection(peer, services.sessions.stream_for(handle), services).run())

        # The first message yields two units; the writer is stuck on the first, so the reader holds back.
        wait_until(lambda: peer.sending and peer.received == 2, "the slow stream to stall")
        # Meanwhile another session is served in full, and the engine has nothing stuck in it.
        other = client.post("/v1/sessions").json()["session_id"]
        response = client.post(
            f"/v1/sessions/{other}/chunks?flush=true", content=payload(latents, embeds, mask), headers=OCTET
        )
        assert response.status_code == 200
        assert torch.equal(read_latents(response.content)[0], expected_clip(refiner, latents, embeds, mask))
        assert services.engine.outstanding == 0
        assert peer.received == 2, "the stalled stream must not read (and queue) more input"

        client.portal.call(lambda: peer.unblock.set())
        running.result(DEADLINE_S)
        assert peer.received == 4
        units = [read_latents(data)[0] for data in peer.sent]
        assert [u.shape[2] for u in units] == [1, 3, 3, 3, 3]
        assert torch.equal(torch.cat(units, dim=2), expected_clip(refiner, latents, embeds, mask)[:, :, :13])


async def _make_peer(messages):
    return StalledClient(messages)


def test_a_client_that_floods_bad_messages_and_never_reads_cannot_grow_the_server(make_settings):
    """Each bad text message queues an error event. A client that sends tens of thousands without reading meets the
    same bound as a chunk does (ws_outbound_queue: the server stops reading it, TCP pushes back), instead of an
    outbound queue that grows with every message (issue 16, item 1)."""
    import socket as socket_module

    limit = 4
    with LiveServer(make_settings(ws_outbound_queue=limit)) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=DEADLINE_S).json()["session_id"]
        raw = socket_module.create_connection(("127.0.0.1", server.port))
        raw.setsockopt(socket_module.SOL_SOCKET, socket_module.SO_RCVBUF, 4096)
        flood = connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", sock=raw, open_timeout=DEADLINE_S,
                           max_queue=1, ping_interval=None, compression=None)
        stop = threading.Event()

        def send_forever():
            with contextlib.suppress(Exception):
                for _ in range(60_000):
                    if stop.is_set():
                        return
                    flood.send("x")

        sender = threading.Thread(target=send_forever, daemon=True)
        sender.start()
        deepest = 0
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline and sender.is_alive():
            for connection in list(server.services.store.connections):
                outbox = getattr(connection, "outbox", None)
                if outbox is not None:
                    deepest = max(deepest, outbox.qsize())
            time.sleep(0.005)
        stop.set()
        raw.close()
    assert deepest <= limit + 2, f"the stream's outbound queue reached {deepest} messages (limit {limit})"
