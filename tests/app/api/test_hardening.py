"""Hostile inputs that must be bounded: snapshot files whose metadata lies, request bodies held open, slow and
huge requests, inputs that turn a session's output non-finite (issue 16, items 2, 4, 5 and 6)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from app.api.deps import until_client_leaves
from tests.app.conftest import DEADLINE_S, OCTET, EngineHold, make_clip, payload, running_app


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _saved_session(make_settings, folder: Path) -> Path:
    """A real drain snapshot of a session that has its sink and some history."""
    latents, embeds, mask = make_clip(frames=8)
    with running_app(make_settings(snapshot_dir=folder)) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        reply = client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(latents, embeds, mask),
                            headers=OCTET)
        assert reply.status_code == 200, reply.text
    return folder / f"{session_id}.session.safetensors"


def _rewrite(source: Path, target_id: str, edit) -> Path:
    """A copy of ``source`` under session ``target_id`` with its metadata changed by ``edit(metadata)``."""
    tensors = load_file(str(source))
    with safe_open(str(source), framework="pt") as handle:
        metadata = dict(handle.metadata())
    app_fields = json.loads(metadata["app"])
    app_fields["session_id"] = target_id
    metadata["app"] = json.dumps(app_fields)
    edit(metadata)
    target = source.with_name(f"{target_id}.session.safetensors")
    save_file(tensors, str(target), metadata=metadata)
    return target


def _huge_geometry(metadata: dict) -> None:
    state = json.loads(metadata["state"])
    state["geometry"] = [2, 128, 256, 256]
    metadata["state"] = json.dumps(state)


def _huge_window(metadata: dict) -> None:
    config = json.loads(metadata["config"])
    config.update(kv_max_frames=1000, block_size=500, sigmas=[1.0 - i / 200 for i in range(201)])
    metadata["config"] = json.dumps(config)


def test_snapshot_metadata_is_checked_against_limits_and_tensors_before_anything_is_allocated(make_settings,
                                                                                             tmp_path):
    folder = tmp_path / "snapshots"
    saved = _saved_session(make_settings, folder)
    ids = [f"hugegeom{i}" for i in range(3)]
    for session_id in ids:
        _rewrite(saved, session_id, _huge_geometry)
    _rewrite(saved, "hugewindow", _huge_window)
    with running_app(make_settings(snapshot_dir=folder)) as client:
        before = _rss_mib()
        for session_id in ids:
            assert client.get(f"/v1/sessions/{session_id}").status_code == 404
        grown = _rss_mib() - before
        # Each file would allocate a ~800 MiB KV cache from its declared geometry alone.
        assert grown < 150, f"refused snapshots moved RSS by {grown:.0f} MiB"
        # Past max_window_frames=64 and max_denoise_steps=16: refused, as a corrupt file is.
        assert client.get("/v1/sessions/hugewindow").status_code == 404
        # The genuine snapshot is still adopted (and saved again by this app's drain).
        assert client.get(f"/v1/sessions/{saved.name.split('.')[0]}").status_code == 200
    names = sorted(p.name for p in folder.iterdir() if p != saved and not p.name.endswith(".session.generation"))
    assert names == sorted(f"{i}.session.safetensors.corrupt" for i in [*ids, "hugewindow"])


def test_a_chunk_that_refines_to_non_finite_values_is_refused_and_the_session_is_unchanged(make_settings, refiner):
    from tests.app.conftest import expected_clip, read_latents, session_state

    latents, embeds, mask = make_clip(frames=10, seed=5)
    with running_app(make_settings()) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        first = client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(latents[:, :, :4], embeds, mask),
                            headers=OCTET)
        assert first.status_code == 200
        before = session_state(client, session_id)
        poisoned = latents[:, :, 4:].clone()
        poisoned[:, :, :, 0, 0] = 3e38  # finite: passes the input checks, overflows in the model
        refused = client.post(f"/v1/sessions/{session_id}/chunks?seq=1&flush=true", content=payload(poisoned),
                              headers=OCTET)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_input" and "NaN or Inf" in error["message"]
        assert "3e+38" in error["message"] and "send latents and prompt_embeds" in error["message"]
        assert session_state(client, session_id) == before
        retry = client.post(f"/v1/sessions/{session_id}/chunks?seq=1&flush=true", content=payload(latents[:, :, 4:]),
                            headers=OCTET)
        assert retry.status_code == 200, retry.text
        refined = torch.cat([read_latents(first.content)[0], read_latents(retry.content)[0]], dim=2)
    assert torch.equal(refined, expected_clip(refiner, latents, embeds, mask))


# --- real servers on loopback: bodies in flight, huge and slow requests --------------------------------------------
import re  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402

from tests.app.conftest import LiveServer, wait_until  # noqa: E402
from bench.hostile import response_head  # noqa: E402


def _connect(server, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    return sock


def _chunk_head(session_id: str, length: int, seq: int = 0) -> bytes:
    return (f"POST /v1/sessions/{session_id}/chunks?seq={seq} HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n\r\n").encode()


def _bodies_in_flight(server) -> float:
    import httpx

    text = httpx.get(f"{server.base_url}/metrics").text
    return float(re.search(r"^refiner_request_body_bytes_in_flight (\S+)$", text, re.M).group(1))


def test_request_bodies_in_flight_are_bounded_across_connections(make_settings):
    body = 1024 * 1024
    with LiveServer(make_settings(max_body_bytes=body, max_inflight_body_bytes=4 * body)) as server:
        import httpx

        session_id = httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"]
        held = []
        for _ in range(4):  # four large bodies, each one byte short: they fill the budget
            sock = _connect(server)
            sock.sendall(_chunk_head(session_id, body) + b"\0" * (body - 1))
            held.append(sock)
        # The budget is taken when a request's head is read: wait until the server holds all four.
        wait_until(lambda: _bodies_in_flight(server) == 4 * body, "four bodies in flight")
        refused = _connect(server)
        started = time.monotonic()
        refused.sendall(_chunk_head(session_id, body))  # headers only: refused before its body is read
        head = response_head(refused)
        assert head.startswith(b"HTTP/1.1 503"), head[:200]
        assert b"retry-after: 1" in head.lower() and time.monotonic() - started < 5
        refused.close()
        held.pop().close()  # a client that goes away gives its share back
        wait_until(lambda: _bodies_in_flight(server) == 3 * body, "a closed connection's share given back")
        accepted = _connect(server)
        accepted.sendall(_chunk_head(session_id, 10) + b"\0" * 10)
        head = response_head(accepted)
        assert not head.startswith(b"HTTP/1.1 503"), head[:200]  # read, and refused for what it is
        accepted.close()
        for sock in held:
            sock.close()


def test_a_huge_header_is_refused_without_being_buffered(make_settings):
    with LiveServer(make_settings(max_header_bytes=64 * 1024)) as server:
        from tests.app.api.test_hardening import _rss_mib as rss

        before = rss()
        sock = _connect(server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent, piece = 0, b"a" * (1024 * 1024)
        try:
            while sent < 128 * 1024 * 1024:
                sock.sendall(piece)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        head = response_head(sock)
        sock.close()
        assert head.startswith(b"HTTP/1.1 431") or head == b"", head[:200]
        assert sent < 64 * 1024 * 1024, f"the server read {sent} bytes of one header"
        assert rss() - before < 100, "a refused header grew the server"


def test_slow_headers_and_trickled_bodies_are_cut_off(make_settings):
    with LiveServer(make_settings(request_header_timeout_s=1.0, request_body_timeout_s=2.0)) as server:
        idle = _connect(server)  # connects and sends nothing
        partial = _connect(server)
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
        import httpx

        session_id = httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"]
        trickle = _connect(server)
        trickle.sendall(_chunk_head(session_id, 100))
        started = time.monotonic()
        for sock in (idle, partial):
            head = response_head(sock)
            assert head.startswith(b"HTTP/1.1 408"), head[:200]
        assert time.monotonic() - started < 5
        try:
            for _ in range(16):  # one byte a second, well past the body's time (2 s)
                trickle.sendall(b"\0")
                time.sleep(1.0)
        except (BrokenPipeError, ConnectionResetError):
            pass
        head = response_head(trickle)
        assert head.startswith(b"HTTP/1.1 408") or head == b"", head[:200]
        assert time.monotonic() - started < 15, "the trickled body was not cut off"
        for sock in (idle, partial, trickle):
            sock.close()


def test_a_request_the_http_parser_refuses_gets_the_error_envelope(make_settings):
    """Framing that is not HTTP/1.1 (request smuggling's shapes among them) was answered with uvicorn's plain-text
    "Invalid HTTP request received.": now the JSON envelope every error has, saying what to send; nothing is
    created, and the server goes on."""
    framings = {
        "content-length and transfer-encoding":
            b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        "two content-lengths": b"Content-Length: 2\r\nContent-Length: 12\r\n\r\n{}",
        "a negative content-length": b"Content-Length: -2\r\n\r\n{}",
    }
    with LiveServer(make_settings()) as server:
        import httpx

        for name, rest in framings.items():
            sock = _connect(server)
            sock.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + rest)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            sock.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), (name, head)
            error = json.loads(body)["error"]
            assert error["code"] == "invalid_payload" and "send one well-formed request" in error["message"], name
        with httpx.Client(base_url=server.base_url) as http:
            assert http.get("/v1/sessions").json()["sessions"] == []  # nothing was created
            assert http.post("/v1/sessions").status_code == 201


def test_a_url_longer_than_the_http_parser_takes_is_431_saying_so(make_settings):
    """A URL over httptools' 65535 bytes (within max_header_bytes, set larger here) was answered 400 "not valid
    HTTP/1.1 (... Content-Length and Transfer-Encoding together ...)": now 431 headers_too_large naming the URL's
    length and the limit, as a WebSocket handshake's long request line is; the server goes on."""
    from app.api.guards import MAX_URL_BYTES

    with LiveServer(make_settings(max_header_bytes=256 * 1024)) as server:
        import httpx

        path = "/v1/sessions/" + "a" * (MAX_URL_BYTES + 100)
        sock = _connect(server)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        sock.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431"), head
        error = json.loads(body)["error"]
        assert error["code"] == "headers_too_large", error
        assert f"URL is {len(path)} bytes, more than the {MAX_URL_BYTES}" in error["message"], error
        with httpx.Client(base_url=server.base_url) as http:
            assert http.get("/health").status_code == 200


def test_head_through_the_real_server_answers_with_the_gets_headers_and_no_body(make_settings):
    """The test client checks no Content-Length; uvicorn does: a HEAD answered as its GET must still be a HEAD to the
    server (told GET, it refused the empty body as shorter than Content-Length, a 500 in the log)."""
    import httpx

    with LiveServer(make_settings()) as server, httpx.Client(base_url=server.base_url) as http:
        for path in ("/v1/info", "/v1/sessions", "/metrics"):
            get, head = http.get(path), http.head(path)
            assert head.status_code == get.status_code == 200 and head.content == b"", path
            assert int(head.headers["content-length"]) > 0, path
        metrics = http.get("/metrics").text
        assert 'method="HEAD",route="/v1/info",status="200"' in metrics
        assert 'status="500"' not in metrics


def test_a_clip_whose_client_goes_away_stops_and_frees_its_place(make_settings, caplog):
    """api.md: a /v1/refine "stops if its client goes away": its place (max_sessions) is free at once, and its
    throwaway session is refined no further than the block under way."""
    import httpx

    from tests.app.conftest import metric_value

    caplog.set_level(logging.INFO, logger="app")
    latents, embeds, mask = make_clip(frames=121, height=8, width=8)  # the sink and 40 blocks
    body = payload(latents, embeds, mask)
    with LiveServer(make_settings(max_sessions=1)) as server:
        registry = server.services.registry

        def calls() -> float:
            return metric_value(httpx.get(f"{server.base_url}/metrics").text, "refiner_model_call_seconds_count")

        before = calls()
        sock = _connect(server)
        sock.sendall((f"POST /v1/refine HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        wait_until(lambda: calls() > before, "the clip's first model call")
        sock.close()
        wait_until(lambda: registry.clips == 0, "the clip's place given back")
        assert httpx.post(f"{server.base_url}/v1/sessions").status_code == 201  # the one place is free again
        wait_until(lambda: metric_value(httpx.get(f"{server.base_url}/metrics").text, "refiner_engine_queue_depth") == 0,
                   "the engine to finish the block under way")
        time.sleep(0.5)
        ran = calls() - before
        assert ran < 40 * 4 / 2, f"the clip went on for {ran:g} model calls after its client left"
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert not errors, [record.getMessage() for record in errors]
    assert any("went away before its clip was refined" in record.getMessage() for record in caplog.records)


def test_a_route_cancelled_while_its_work_lets_go_is_still_cancelled():
    """The client left, so the route cancelled its work and waits for it to let go of what it holds; a
    cancellation of the route meanwhile (the server shutting down) waits for that too, then ends the route instead
    of being taken for the work's own."""
    from app.core.tasks import outlast

    class Gone:
        async def receive(self):
            return {"type": "http.disconnect"}

    async def main():
        let_go, released = asyncio.Event(), []

        async def work():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await outlast(asyncio.ensure_future(let_go.wait()))  # its engine work ends at the next block
                released.append(1)
                raise

        body_read = asyncio.Event()
        body_read.set()
        route = asyncio.ensure_future(until_client_leaves(Gone(), work(), body_read))
        for _ in range(10):
            await asyncio.sleep(0)
        route.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not route.done(), "the route ended while its work still held what it holds"
        let_go.set()
        outcome = (await asyncio.gather(route, return_exceptions=True))[0]
        assert released == [1]
        assert isinstance(outcome, asyncio.CancelledError), f"the route's cancellation was swallowed: {outcome!r}"

    asyncio.run(main())


def test_a_clip_cancelled_twice_holds_its_place_until_the_engine_drops_it(make_settings):
    """A /v1/refine whose client left, then the server's shutdown: both cancel the clip while its work is queued on
    the engine; its place (max_sessions) stays counted until the engine has let go of it, not until the second
    cancellation."""
    latents, embeds, mask = make_clip(frames=9, height=8, width=8)
    body = payload(latents, embeds, mask)
    with running_app(make_settings(max_sessions=1)) as client:
        services = client.app.state.services
        hold = EngineHold()
        held = client.portal.start_task_soon(services.engine.call, hold)
        hold.wait_started()

        async def read_payload():
            return body

        async def refine_then_cancel_twice():
            clip = asyncio.ensure_future(services.sessions.refine_clip(dict, read_payload))
            while not services.engine._inbox:  # queued behind the hold
                await asyncio.sleep(0.01)
            for _ in range(2):
                clip.cancel()
                for _ in range(5):
                    await asyncio.sleep(0)
                assert not clip.done(), "the clip ended while the engine still held its work"
                assert services.registry.clips == 1, "the clip's place was given back while the engine held it"
            hold.release.set()
            return (await asyncio.gather(clip, return_exceptions=True))[0]

        outcome = client.portal.call(refine_then_cancel_twice)
        held.result(DEADLINE_S)
        assert isinstance(outcome, asyncio.CancelledError)
        assert services.registry.clips == 0
        assert client.post("/v1/sessions").status_code == 201  # the one place is free again
