"""The WebSocket half of the hostile-client pass (issue 16): a stream message whose block refines to NaN/Inf
(item 6), and the protocol details of item 7 (refused handshakes, invalid UTF-8, websockets' own header limit,
subprotocol selection from a real browser, the watch route's pool)."""

from __future__ import annotations

import json
import os

import torch

from tests.app.conftest import make_clip, payload, read_latents, running_app, session_state, wait_until


# --- item 6: a poisoned stream message ------------------------------------------------------------------------
def _poisoned(latents: torch.Tensor) -> torch.Tensor:
    bad = latents.clone()
    bad[:, :, :, 0, 0] = 3e38  # finite: passes the input checks, overflows in the model
    return bad


def _units_until(ws, frames: int) -> list[torch.Tensor]:
    """Binary units until ``frames`` frames came back; a text event on the way fails the test."""
    units, got = [], 0
    while got < frames:
        message = ws.receive()
        assert message.get("bytes") is not None, f"expected a unit, got {message}"
        unit = read_latents(message["bytes"])[0]
        units.append(unit)
        got += unit.shape[2]
    return units


def _event(ws) -> dict:
    message = ws.receive()
    assert message.get("text") is not None, f"expected an event, got {message}"
    return json.loads(message["text"])


def _flush(ws, frames: int) -> list[torch.Tensor]:
    ws.send_text('{"type": "flush"}')
    units = []
    while True:
        message = ws.receive()
        if message.get("bytes") is not None:
            units.append(read_latents(message["bytes"])[0])
            continue
        assert json.loads(message["text"]) == {"type": "done", "frames": frames}
        return units


def test_a_stream_message_that_refines_to_non_finite_values_is_refused_and_rolled_back(make_settings, refiner):
    """Poisoned latents, then a poisoned prompt: each message gets an error event, commits nothing, and the
    connection goes on; the good messages that follow give the bytes an untroubled session gives."""
    from tests.app.conftest import expected_clip

    latents, embeds, mask = make_clip(frames=10, seed=5)
    with running_app(make_settings()) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
            ws.send_bytes(payload(latents[:, :, :4], embeds, mask))
            units = _units_until(ws, 4)
            # Its units can arrive before the message is counted (next_seq) and checkpointed.
            before = wait_until(lambda: (lambda state: state["next_seq"] == 1 and state)(
                session_state(client, session_id)), "the first message to be counted")

            ws.send_bytes(payload(_poisoned(latents[:, :, 4:7])))
            error = _event(ws)["error"]
            assert error["code"] == "invalid_input" and "NaN or Inf" in error["message"], error
            assert "3e+38" in error["message"] and "send latents and prompt_embeds" in error["message"]
            assert session_state(client, session_id) == before

            huge_prompt = embeds.clone()
            huge_prompt[:, :, 0] = 3e38
            ws.send_bytes(payload(latents[:, :, 4:7], huge_prompt, mask))
            error = _event(ws)["error"]
            assert error["code"] == "invalid_input" and "prompt_embeds |x| = 3e+38" in error["message"], error
            assert session_state(client, session_id) == before

            ws.send_bytes(payload(latents[:, :, 4:7]))
            units += _units_until(ws, 3)
            ws.send_bytes(payload(latents[:, :, 7:]))
            units += _flush(ws, 10)
    assert torch.equal(torch.cat(units, dim=2), expected_clip(refiner, latents, embeds, mask))


def test_poisoned_frames_pending_from_an_earlier_message_are_dropped_not_kept(make_settings, refiner):
    """One poisoned frame, too few for a block, is taken; the good message completing the block fails on it. The
    session then drops every frame not yet refined (it cannot tell whose frame broke the block) and says from
    which frame to send again, so the stream recovers instead of failing every following block."""
    from tests.app.conftest import expected_clip

    latents, embeds, mask = make_clip(frames=10, seed=5)
    with running_app(make_settings()) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
            ws.send_bytes(payload(latents[:, :, :4], embeds, mask))
            units = _units_until(ws, 4)
            ws.send_bytes(payload(_poisoned(latents[:, :, 4:5])))  # pending: no event
            ws.send_bytes(payload(latents[:, :, 5:7]))
            event = _event(ws)
            assert event["error"]["code"] == "invalid_input", event
            assert event["frames_received"] == 4, event
            assert "frames [4, 7) were dropped" in event["error"]["message"], event
            state = session_state(client, session_id)
            assert (state["frames_received"], state["frames_returned"]) == (4, 4)

            ws.send_bytes(payload(latents[:, :, 4:]))
            units += _flush(ws, 10)
    assert torch.equal(torch.cat(units, dim=2), expected_clip(refiner, latents, embeds, mask))


def test_a_flush_whose_final_block_refines_to_non_finite_values_leaves_the_stream_open(make_settings, refiner):
    """The poisoned frames wait for the flush (too few for a block): the flush fails, drops them and does not
    flush the session; the client resends good frames and flushes again."""
    from tests.app.conftest import expected_clip

    latents, embeds, mask = make_clip(frames=6, seed=5)
    with running_app(make_settings()) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
            ws.send_bytes(payload(latents[:, :, :4], embeds, mask))
            units = _units_until(ws, 4)
            ws.send_bytes(payload(_poisoned(latents[:, :, 4:])))
            ws.send_text('{"type": "flush"}')
            event = _event(ws)
            assert event["error"]["code"] == "invalid_input" and event["frames_received"] == 4, event
            state = session_state(client, session_id)
            assert (state["frames_received"], state["flushed"]) == (4, False)
            ws.send_bytes(payload(latents[:, :, 4:]))
            units += _flush(ws, 6)
    assert torch.equal(torch.cat(units, dim=2), expected_clip(refiner, latents, embeds, mask))


def test_the_nan_scan_runs_before_the_engine_so_a_busy_engine_does_not_delay_the_refusal(make_settings):
    """A chunk holding NaN is refused with the session's own error while the engine thread is busy with other
    work: the scan runs before submitting, not on the engine thread ahead of other sessions' forwards."""
    import threading
    import time

    from tests.app.conftest import OCTET, EngineHold

    latents, embeds, mask = make_clip(frames=4)
    bad = latents.clone()
    bad[0, 0, 0, 0, 0] = float("nan")
    with running_app(make_settings()) as client:
        services = client.app.state.services
        session_id = client.post("/v1/sessions").json()["session_id"]
        hold = EngineHold()
        held = client.portal.start_task_soon(lambda: services.engine.call(hold))
        hold.wait_started()
        # Released late, so a refusal that waited for the engine is seen to have waited.
        timer = threading.Timer(30.0, hold.release.set)
        timer.start()
        try:
            started = time.monotonic()
            refused = client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(bad, embeds, mask),
                                  headers=OCTET)
            http_s = time.monotonic() - started
            with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
                started = time.monotonic()
                ws.send_bytes(payload(bad, embeds, mask))
                event = _event(ws)
                ws_s = time.monotonic() - started
        finally:
            hold.release.set()
            timer.cancel()
        held.result(10)
        assert refused.status_code == 422, refused.text
        message = "latents holds 1 NaN or Inf values; send finite numbers only"
        assert refused.json()["error"] == {"code": "invalid_input", "message": message}
        assert event["error"]["code"] == "invalid_input" and event["error"]["message"] == message, event
        assert http_s < 15.0 and ws_s < 15.0, (http_s, ws_s)


# --- item 7: protocol details on a real server (uvicorn) ------------------------------------------------------
import base64  # noqa: E402
import logging  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from tests.app.conftest import DEADLINE_S, LiveServer  # noqa: E402

KEY = "wm>>>???key"  # base64 holds '+' and '/': the browser sends it as base64url


class _Records(logging.Handler):
    """What uvicorn logs (its loggers do not propagate to the root, so caplog would see nothing)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[str]:
        return [f"{r.levelname} {r.getMessage()}" for r in self.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.fixture
def uvicorn_log():
    """Attach with ``uvicorn_log.attach()`` once the server runs: uvicorn's logging config replaces the handlers
    of its loggers when it starts."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "app")]
    handler.attach = lambda: [logger.addHandler(handler) for logger in loggers]
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def _settled(server) -> None:
    """Every connection's ASGI task has returned (uvicorn logs a bad handshake when it does)."""
    wait_until(lambda: not server.server.server_state.tasks, "the server's connection tasks to end")


def _handshake(server, path: str, headers: dict[str, str] | None = None, extra: bytes = b"") -> tuple[socket.socket, bytes]:
    """A raw WebSocket handshake; returns the socket and the response head (b'' when none came)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    lines = [f"GET {path} HTTP/1.1", "Host: x", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13",
             *(f"{name}: {value}" for name, value in (headers or {}).items())]
    sock.sendall("\r\n".join(lines).encode() + b"\r\n" + extra + b"\r\n")
    head = b""
    try:
        while b"\r\n\r\n" not in head:
            part = sock.recv(65536)
            if not part:
                break
            head += part
    except (socket.timeout, ConnectionResetError):
        pass
    return sock, head


def _masked(opcode: int, data: bytes) -> bytes:
    mask = b"\x01\x02\x03\x04"
    assert len(data) < 126
    return bytes([0x80 | opcode, 0x80 | len(data)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def _close_code(sock: socket.socket, data: bytes = b"") -> int:
    """The code of the close frame the server sends next (skipping other frames); ``data``: what of its frames was
    read already (with a handshake's head)."""
    while True:
        while len(data) < 2:
            part = sock.recv(65536)
            assert part, "the server closed the connection without a close frame"
            data += part
        length = data[1] & 0x7F
        header = 2 + (2 if length == 126 else 8 if length == 127 else 0)
        while len(data) < header:
            data += sock.recv(65536)
        if length >= 126:
            length = struct.unpack("!H" if length == 126 else "!Q", data[2:header])[0]
        while len(data) < header + length:
            data += sock.recv(65536)
        opcode, body, data = data[0] & 0x0F, data[header : header + length], data[header + length :]
        if opcode == 0x8:
            return struct.unpack("!H", body[:2])[0]


def test_refused_handshakes_are_answered_and_logged_without_an_error(make_settings, uvicorn_log):
    """A 401, a 404 and a 409 at the handshake: the status reaches the client and nothing is logged as an ERROR
    (uvicorn logged 'ASGI callable returned without completing handshake' for each)."""
    with LiveServer(make_settings(api_key=KEY)) as server:
        uvicorn_log.attach()
        auth = {"Authorization": f"Bearer {KEY}"}
        session_id = httpx.post(f"{server.base_url}/v1/sessions", headers=auth).json()["session_id"]
        statuses = []
        for path, headers in ((f"/v1/sessions/{session_id}/stream", {}),
                              (f"/v1/sessions/{session_id}/watch", {}),
                              ("/v1/sessions/no-such-session/stream", auth),
                              ("/v1/sessions/no-such-session/watch", auth)):
            sock, head = _handshake(server, path, headers)
            sock.close()
            statuses.append(head.split(b" ", 2)[1] if head else b"nothing")
        assert statuses == [b"401", b"401", b"404", b"404"]
        _settled(server)
        assert sum('"WebSocket /v1/sessions/' in r.getMessage() for r in uvicorn_log.records) == 4
    assert uvicorn_log.errors() == []


def test_a_text_message_that_is_not_utf8_is_closed_with_1007_without_a_traceback(make_settings, uvicorn_log):
    with LiveServer(make_settings()) as server:
        uvicorn_log.attach()
        session_id = httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"]
        sock, head = _handshake(server, f"/v1/sessions/{session_id}/stream")
        assert head.startswith(b"HTTP/1.1 101"), head
        sock.sendall(_masked(0x1, b'{"type": "\xff\xfe"}'))
        assert _close_code(sock) == 1007
        sock.close()
        # The session is untouched and takes a stream again (the dropped client may reattach).
        wait_until(lambda: not server.services.registry.get(session_id).streaming, "the stream to end")
        _settled(server)
    assert uvicorn_log.errors() == []
    assert any("not valid UTF-8" in r.getMessage() for r in uvicorn_log.records)


def _envelope(sock: socket.socket, head: bytes) -> dict:
    """The JSON error envelope of a refused handshake's response (head already read, then the body to EOF)."""
    body = head.split(b"\r\n\r\n", 1)[1]
    while part := sock.recv(65536):
        body += part
    assert b"content-type: application/json" in head.lower(), head
    return json.loads(body)["error"]


@pytest.mark.parametrize("path, extra, status, code, says", [
    ("/stream", b"X-Big: " + b"a" * 8200 + b"\r\n", 431, "headers_too_large", "header line"),
    ("/stream", b"".join(b"X-%d: a\r\n" % n for n in range(130)), 431, "headers_too_large", "headers"),
    ("/watch?outputs=" + "a" * 9000, b"", 431, "headers_too_large", "request line"),
    ("/stream", b"Transfer-Encoding: chunked\r\n", 400, "invalid_payload", "not a valid"),
])
def test_a_handshake_websockets_parser_refuses_gets_the_error_envelope(make_settings, uvicorn_log, path, extra,
                                                                      status, code, says):
    """httptools takes the head (under max_header_bytes); websockets' own parser then refuses a line over 8192
    bytes, over 128 headers, or a head it cannot read (Transfer-Encoding on a GET). The answer must reach the client
    (it otherwise waits forever) as the service's error envelope, like every other error: it was websockets' plain
    text 414/431, and no answer at all (EOF) for a head it could not read."""
    with LiveServer(make_settings()) as server:
        uvicorn_log.attach()
        session_id = httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"]
        sock, head = _handshake(server, f"/v1/sessions/{session_id}{path}", extra=extra)
        assert head.startswith(b"HTTP/1.1 %d " % status), head
        error = _envelope(sock, head)
        sock.close()
        assert error["code"] == code and says in error["message"], error
        # A handshake under the limits still opens.
        sock, head = _handshake(server, f"/v1/sessions/{session_id}/stream", extra=b"X-Big: " + b"a" * 8000 + b"\r\n")
        sock.close()
        assert head.startswith(b"HTTP/1.1 101"), head
        _settled(server)
    assert uvicorn_log.errors() == []


def test_the_watch_pool_belongs_to_the_app_and_is_shut_down_with_it(make_settings):
    with running_app(make_settings()) as first, running_app(make_settings()) as second:
        pools = first.app.state.services.encoder._watch_pool, second.app.state.services.encoder._watch_pool
        assert pools[0] is not pools[1]
    assert all(pool._shutdown for pool in pools)


# --- item 7d: a browser offering only the key's subprotocol -----------------------------------------------------
_CHROMIUM, _CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

_OPEN_SOCKET = """
const [url, protocols, send] = arguments;
window.wsLog = {protocol: null, events: [], binary: 0, closed: null, failed: false};
const ws = new WebSocket(url, protocols);
ws.binaryType = "arraybuffer";
ws.onopen = () => { window.wsLog.protocol = ws.protocol; if (send) ws.send(send); };
ws.onmessage = (m) => { if (typeof m.data === "string") window.wsLog.events.push(JSON.parse(m.data));
                        else window.wsLog.binary += 1; };
ws.onerror = () => { window.wsLog.failed = true; };
ws.onclose = (e) => { window.wsLog.closed = e.code; };
"""


@pytest.mark.skipif(not (os.path.exists(_CHROMIUM) and os.path.exists(_CHROMEDRIVER)),
                    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
def test_a_browser_offering_only_the_key_subprotocol_opens_the_stream_and_the_watch(make_settings):
    """Chromium fails a WebSocket whose 101 names none of the subprotocols it offered: with only
    ``wm-refiner.bearer.<key>`` offered, both routes must answer with it, and the sockets get their events."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking"):
        options.add_argument(flag)
    bearer = "wm-refiner.bearer." + base64.urlsafe_b64encode(KEY.encode()).decode().rstrip("=")
    auth = {"Authorization": f"Bearer {KEY}"}
    latents, embeds, mask = make_clip(frames=4)
    with LiveServer(make_settings(api_key=KEY)) as server:
        browser = webdriver.Chrome(options=options, service=Service(_CHROMEDRIVER))
        try:
            browser.get(f"{server.base_url}/health")
            log = lambda: browser.execute_script("return window.wsLog")  # noqa: E731
            watched = httpx.post(f"{server.base_url}/v1/sessions", headers=auth).json()["session_id"]
            browser.execute_script(_OPEN_SOCKET, f"{server.ws_url}/v1/sessions/{watched}/watch", [bearer], None)
            wait_until(lambda: log()["protocol"] is not None or log()["closed"] is not None, "the watch to open")
            assert log()["protocol"] == bearer, log()
            response = httpx.post(f"{server.base_url}/v1/sessions/{watched}/chunks?seq=0&flush=true",
                                  content=payload(latents, embeds, mask),
                                  headers={**auth, "content-type": "application/octet-stream"}, timeout=DEADLINE_S)
            assert response.status_code == 200, response.text
            wait_until(lambda: log()["closed"] is not None, "the watch to end")
            watch = log()
            assert not watch["failed"] and watch["closed"] == 1000, watch
            assert watch["events"][-1] == {"type": "done", "frames": 4} and watch["binary"] >= 2, watch

            streamed = httpx.post(f"{server.base_url}/v1/sessions", headers=auth).json()["session_id"]
            browser.execute_script(_OPEN_SOCKET, f"{server.ws_url}/v1/sessions/{streamed}/stream", [bearer],
                                   '{"type": "flush"}')
            wait_until(lambda: log()["closed"] is not None, "the stream to end")
            stream = log()
            assert stream["protocol"] == bearer and not stream["failed"], stream
            assert stream["events"] == [{"type": "done", "frames": 0}] and stream["closed"] == 1000, stream

            # Offered beside the plain subprotocol, the key is not echoed back.
            other = httpx.post(f"{server.base_url}/v1/sessions", headers=auth).json()["session_id"]
            browser.execute_script(_OPEN_SOCKET, f"{server.ws_url}/v1/sessions/{other}/stream",
                                   ["wm-refiner", bearer], '{"type": "flush"}')
            wait_until(lambda: log()["closed"] is not None, "the second stream to end")
            assert log()["protocol"] == "wm-refiner" and log()["events"] == [{"type": "done", "frames": 0}], log()
        finally:
            browser.quit()


def test_the_subprotocol_selected_is_one_the_client_offered():
    from app.api.auth import select_subprotocol

    bearer = "wm-refiner.bearer." + base64.urlsafe_b64encode(KEY.encode()).decode().rstrip("=")
    assert select_subprotocol(["wm-refiner", bearer]) == "wm-refiner"  # the key is not echoed when avoidable
    assert select_subprotocol([bearer, "wm-refiner"]) == "wm-refiner"
    assert select_subprotocol(["chat", bearer]) == bearer
    # Nothing of ours offered (or a malformed key): no subprotocol, as before.
    assert select_subprotocol([]) is None
    assert select_subprotocol(["chat", "wm-refiner.bearer.", "wm-refiner.bearer.a", "wm-refiner.bearer.\u00e9"]) is None


def test_unfinished_websocket_messages_count_against_the_bytes_in_flight_budget(make_settings, uvicorn_log):
    """Each connection buffers at most one message, but connections are not capped: six clients each holding 60 MiB
    unfinished held 390 MiB. What messages still arriving hold counts against max_inflight_body_bytes with the HTTP
    bodies; a connection that would pass it is closed with 1013 (a stream reconnects and resends), and what it held
    is given back, as is a message's once it is whole."""
    from tests.app.conftest import metric_value

    settings = make_settings(max_body_bytes=200_000, max_ws_message_bytes=400_000, max_inflight_body_bytes=300_000)
    with LiveServer(settings) as server:
        uvicorn_log.attach()
        held = lambda: metric_value(httpx.get(f"{server.base_url}/metrics").text,  # noqa: E731
                                    "refiner_request_body_bytes_in_flight")
        sessions = [httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"] for _ in range(2)]
        first, second = (_handshake(server, f"/v1/sessions/{sid}/stream") for sid in sessions)
        assert first[1].startswith(b"HTTP/1.1 101") and second[1].startswith(b"HTTP/1.1 101")
        first, second = first[0], second[0]
        # A binary frame of 190,000 bytes (masked with a zero key: the payload as sent), 180,000 of them sent.
        header = bytes([0x82, 0x80 | 127]) + struct.pack("!Q", 190_000) + b"\0\0\0\0"
        first.sendall(header + b"\0" * 180_000)
        wait_until(lambda: held() >= 180_000, "the first connection's unfinished message to count")
        second.sendall(header + b"\0" * 180_000)
        assert _close_code(second) == 1013  # 360,000 would pass the 300,000 budget
        second.close()
        wait_until(lambda: held() < 200_000, "the refused connection's bytes to be given back")
        first.sendall(b"\0" * 10_000)  # the message is whole (not safetensors: an error event, the stream goes on)
        wait_until(lambda: held() == 0, "the whole message's bytes to be given back")
        # Alone, a message over the budget (max_ws_message_bytes is 400,000) still arrives.
        first.sendall(bytes([0x82, 0x80 | 127]) + struct.pack("!Q", 350_000) + b"\0\0\0\0" + b"\0" * 350_000)
        refused = 'refiner_rejected_requests_total{reason="invalid_payload"}'
        wait_until(lambda: metric_value(httpx.get(f"{server.base_url}/metrics").text, refused) == 2,
                   "the lone message to arrive whole (refused as not safetensors, as the first one was)")
        assert held() == 0
        first.close()
        assert httpx.post(f"{server.base_url}/v1/sessions").status_code == 201
        _settled(server)
    assert sum("closed with 1013" in r.getMessage() for r in uvicorn_log.records) == 1  # the second only
    assert uvicorn_log.errors() == []


def test_messages_sent_after_the_servers_close_frame_count_against_the_budget_too(make_settings, uvicorn_log):
    """After its close frame (here a refused resume: an error event, close 1008) the server reads the connection
    until the client's close frame or the close timeout, and a message sent meanwhile was held uncounted: four such
    connections each held 380 KB past a 300 KB budget (by default 64 MiB each, any number of them). It counts now;
    one whose next read would pass the budget is dropped (it was told goodbye already), and a stream is refused
    1013 beside one that holds the budget."""
    from tests.app.conftest import metric_value

    settings = make_settings(max_body_bytes=200_000, max_ws_message_bytes=400_000, max_inflight_body_bytes=300_000)
    with LiveServer(settings) as server:
        uvicorn_log.attach()
        held = lambda: metric_value(httpx.get(f"{server.base_url}/metrics").text,  # noqa: E731
                                    "refiner_request_body_bytes_in_flight")
        session_id = httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"]
        header = bytes([0x82, 0x80 | 127]) + struct.pack("!Q", 190_000) + b"\0\0\0\0"
        refused = []
        for _ in range(2):
            sock, head = _handshake(server, f"/v1/sessions/{session_id}/stream?resume_from=x")
            assert head.startswith(b"HTTP/1.1 101")
            # The server's goodbye (its frames may come with the head); the client does not answer it.
            assert _close_code(sock, head.partition(b"\r\n\r\n")[2]) == 1008
            refused.append(sock)
        refused[0].sendall(header + b"\0" * 180_000)
        wait_until(lambda: held() >= 180_000, "the message sent after the close frame to count")
        stream, head = _handshake(server, f"/v1/sessions/{session_id}/stream")
        assert head.startswith(b"HTTP/1.1 101")
        stream.sendall(header + b"\0" * 180_000)
        assert _close_code(stream) == 1013
        stream.close()
        refused[1].sendall(header + b"\0" * 180_000)
        with pytest.raises(ConnectionResetError):
            while refused[1].recv(65536):  # dropped: nothing more is sent, and what was sent is not read
                pass
        # What the first one sent (counted as it came on the wire, its frame header included) is all that is held.
        wait_until(lambda: held() == len(header) + 180_000, "the dropped connection's bytes to be given back")
        for sock in refused:
            sock.close()
        wait_until(lambda: held() == 0, "every connection's bytes to be given back")
        _settled(server)
    assert sum("dropped after its close frame" in r.getMessage() for r in uvicorn_log.records) == 1
    assert uvicorn_log.errors() == []


def test_a_websocket_message_trickled_past_the_body_timeout_is_closed(make_settings, uvicorn_log):
    """A message has request_body_timeout_s from its first byte to its last, as an HTTP body has: trickled in while
    the client answers the keep-alive pings, it held its share of the bytes-in-flight budget for ever."""
    import time

    from tests.app.conftest import metric_value

    with LiveServer(make_settings(request_body_timeout_s=1.5)) as server:
        uvicorn_log.attach()
        session_id = httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"]
        sock, head = _handshake(server, f"/v1/sessions/{session_id}/stream")
        assert head.startswith(b"HTTP/1.1 101"), head
        # Whole messages, however many, never meet the limit: two pings 1 s apart, then a message 1 s after them.
        for _ in range(2):
            sock.sendall(_masked(0x9, b"ping"))
            time.sleep(1.0)
        sock.sendall(bytes([0x82, 0x80 | 127]) + struct.pack("!Q", 1000) + b"\0\0\0\0" + b"\0" * 10)
        started = time.monotonic()
        for _ in range(24):  # two bytes a second, for 12 s unless the server cuts it off
            try:
                sock.sendall(b"\0")
            except OSError:
                break
            time.sleep(0.5)
        assert _close_code(sock) == 1013
        assert time.monotonic() - started < 10
        sock.close()
        held = metric_value(httpx.get(f"{server.base_url}/metrics").text, "refiner_request_body_bytes_in_flight")
        assert held == 0
        _settled(server)
    assert any("not whole 1.5 s after its first byte" in r.getMessage() for r in uvicorn_log.records)
    assert uvicorn_log.errors() == []


async def _fragments_held(server) -> list[tuple[int, int]]:
    """(buffers, bytes) each WebSocket connection holds of the message it is receiving."""
    from app.api.uvicorn_websocket import GuardedWebSocketProtocol

    return [(len(c.frames), sum(len(part) for part in c.frames)) for c in server.server.server_state.connections
            if isinstance(c, GuardedWebSocketProtocol)]


def test_a_message_sent_in_many_tiny_fragments_is_held_as_one_buffer_and_refined(make_settings, refiner):
    """uvicorn kept each fragment of a message as its own bytes object until the last: a client sending 1-byte
    continuation frames (7 bytes on the wire) made the server hold about 44 bytes per payload byte (21 MB sent grew a
    server by 133 MB), past what max_ws_message_bytes and max_inflight_body_bytes (counted on the wire) say it
    holds, and empty fragments cost memory with no payload at all. The fragments now go into one buffer, and the
    message still arrives whole: a chunk sent a byte per frame is refined as if sent at once."""
    from websockets.frames import Frame, Opcode

    from tests.app.conftest import expected_clip, raw_websocket

    latents, embeds, mask = make_clip(frames=4, seed=3)
    body = payload(latents, embeds, mask)
    with LiveServer(make_settings(warmup=False)) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions").json()["session_id"]
        sock, client = raw_websocket("127.0.0.1", server.port, f"/v1/sessions/{session_id}/stream")
        try:
            client.send_binary(body[:1], fin=False)
            for i in range(1, len(body) - 1):
                client.send_continuation(body[i:i + 1], fin=False)
                if i % 1000 == 0:
                    client.send_continuation(b"", fin=False)  # empty fragments too
            sock.sendall(b"".join(client.data_to_send()))
            held = wait_until(lambda: [h for h in server.on_loop(_fragments_held(server)).result(DEADLINE_S)
                                       if h[1] == len(body) - 1], "the fragments sent to arrive")
            assert held == [(1, len(body) - 1)], held

            client.send_continuation(body[-1:], fin=True)
            client.send_text(b'{"type": "flush"}')
            sock.sendall(b"".join(client.data_to_send()))
            units, done = [], None
            while done is None:
                data = sock.recv(65536)
                assert data, "the server closed the stream before its done event"
                client.receive_data(data)
                for frame in client.events_received():
                    if not isinstance(frame, Frame):  # the handshake's response, which opened the stream
                        continue
                    if frame.opcode == Opcode.BINARY:
                        units.append(read_latents(bytes(frame.data))[0])
                    elif frame.opcode == Opcode.TEXT:
                        done = json.loads(frame.data)
        finally:
            sock.close()
    assert done == {"type": "done", "frames": 4}
    assert torch.equal(torch.cat(units, dim=2), expected_clip(refiner, latents, embeds, mask))
