"""The client against a broken or hostile server (in-process fakes, no refiner): every failure is a
``wm_refiner_client`` error naming what was wrong, within a bounded time and memory, never a bare
``JSONDecodeError``/``KeyError`` or a hang."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from wm_refiner_client import AsyncClient, Client, ProtocolError, RetryPolicy

SID = "abcdefgh1234"


class FakeHTTP:
    """A loopback HTTP server answering every request with ``answer(method, path) -> (status, headers, body)``."""

    def __init__(self, answer):
        outer = self
        self.answer = answer
        self.requests: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                outer.requests.append(f"{self.command} {self.path}")
                status, headers, body = outer.answer(self.command, self.path)
                if isinstance(body, (dict, list)):
                    body = json.dumps(body).encode()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


JSON = {"content-type": "application/json"}
FAST = RetryPolicy(attempts=2, backoff_s=0.01, max_backoff_s=0.01)


def both(url, call):
    """``call(client)`` with the sync and the asyncio client: the errors they raise."""
    errors = []
    with Client(url, retry=FAST, timeout=5) as client:
        with pytest.raises(ProtocolError) as sync_error:
            call(client)
        errors.append(str(sync_error.value))

    async def run():
        client = AsyncClient(url, retry=FAST, timeout=5)
        try:
            with pytest.raises(ProtocolError) as async_error:
                await call(client)
            errors.append(str(async_error.value))
        finally:
            await client.aclose()

    asyncio.run(run())
    return errors


@pytest.mark.parametrize("answer, op, said", [
    ((200, {"content-type": "text/html"}, b"<html>a proxy's page</html>"), "info", "not JSON"),
    ((201, JSON, {"config": {}}), "create", "lacks session_id"),
    ((200, JSON, [1, 2]), "list", "not an object"),
    ((200, JSON, {"session_id": SID}), "state", "frames_received"),
    ((302, {"location": "/v1/sessions"}, b""), "list", "redirect to /v1/sessions"),
    ((307, {"location": "http://elsewhere.invalid/v1/sessions"}, b""), "create", "redirect to http://elsewhere"),
])
def test_an_answer_that_is_not_the_services_is_a_protocol_error(answer, op, said):
    calls = {"info": lambda c: c.info(), "create": lambda c: c.create_session(), "list": lambda c: c.sessions(),
             "state": lambda c: c.get_session(SID)}
    with FakeHTTP(lambda method, path: answer) as fake:
        for message in both(fake.url, calls[op]):
            assert said in message


@pytest.mark.parametrize("cursors", [["same"], ["a", "b", "c", "a"]])
def test_a_listing_whose_pages_cycle_ends_with_a_protocol_error(cursors):
    """GET /v1/sessions whose ``next`` repeats (or cycles) would page for ever, the list growing."""
    state = {"page": 0}

    def answer(method, path):
        cursor = cursors[state["page"] % len(cursors)]
        state["page"] += 1
        return 200, JSON, {"sessions": [{"session_id": SID}], "next": cursor}

    with FakeHTTP(answer) as fake:
        for message in both(fake.url, lambda c: c.sessions()):
            assert "was given before" in message
        assert len(fake.requests) <= 2 * (len(cursors) + 1)


def _safetensors(metadata, tensors):
    """safetensors bytes written by hand (shapes that do not match the data included)."""
    import struct

    header, offset, blobs = {"__metadata__": metadata}, 0, []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


FLOATS = b"\0" * 16  # four float32 zeros
BAD_UNITS = {
    "truncated": _safetensors({"frame_start": "0", "frame_end": "4"}, {"latents": ("F32", [1, 1, 4, 1, 1], FLOATS)})[:-6],
    "absurd shape": _safetensors({"frame_start": "0", "frame_end": "4"},
                                 {"latents": ("F32", [1 << 20, 1 << 20, 4, 1, 1], FLOATS)}),
    "header of 2^40 bytes": (1 << 40).to_bytes(8, "little") + b"{}",
    "not safetensors": b"<html>oops</html>",
    "no frame metadata": _safetensors({}, {"latents": ("F32", [1, 1, 4, 1, 1], FLOATS)}),
    "frame_start not a number": _safetensors({"frame_start": "zero", "frame_end": "4"},
                                             {"latents": ("F32", [1, 1, 4, 1, 1], FLOATS)}),
    "frames disagree with latents": _safetensors({"frame_start": "0", "frame_end": "9"},
                                                 {"latents": ("F32", [1, 1, 4, 1, 1], FLOATS)}),
    "frames backwards": _safetensors({"frame_start": "4", "frame_end": "0"}, {}),
}


@pytest.mark.parametrize("name", list(BAD_UNITS))
def test_a_unit_that_cannot_be_read_is_a_protocol_error(name):
    """POST /v1/refine (the same reader serves chunks, streams and watchers) answered 200 with a broken unit."""
    import numpy as np

    def answer(method, path):
        return 200, {"content-type": "application/octet-stream"}, BAD_UNITS[name]

    clip = np.zeros((1, 1, 4, 1, 1), np.float32)
    with FakeHTTP(answer) as fake:
        for message in both(fake.url, lambda c: c.refine(clip, np.zeros((1, 1, 2), np.float32))):
            assert "the server sent a unit" in message


class FakeWS:
    """A loopback WebSocket server running ``handler(ws)`` for every connection, on a loop in a thread."""

    def __init__(self, handler):
        from websockets.asyncio.server import serve

        self.connections = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def counted(ws):
            self.connections += 1
            await handler(ws)

        async def start():
            return await serve(counted, "127.0.0.1", 0)

        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result()
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        async def stop():  # the handlers sleep: cancelled, not waited for
            self.server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def stream_both(url, timeout=5.0):
    """A stream of 4 frames with the sync and the asyncio client: the errors they end with (bounded by ``timeout``
    per connection and two connections)."""
    import numpy as np

    from wm_refiner_client import WmRefinerError
    from wm_refiner_client.aio import AsyncSession
    from wm_refiner_client.client import Session

    chunks = [np.zeros((1, 1, 4, 1, 1), np.float32)]
    config = {"sink_frames": 1, "block_size": 3}
    errors = []
    with Client(url, retry=FAST, timeout=timeout) as client:
        with pytest.raises(WmRefinerError) as sync_error:
            list(Session(client, SID, config).stream(chunks))
        errors.append(sync_error.value)

    async def run():
        client = AsyncClient(url, retry=FAST, timeout=timeout)
        try:
            with pytest.raises(WmRefinerError) as async_error:
                async for _ in AsyncSession(client, SID, config).stream(chunks):
                    pass
            errors.append(async_error.value)
        finally:
            await client.aclose()

    asyncio.run(run())
    assert len(errors) == 2
    return errors


def test_a_stream_whose_server_never_sends_the_session_event_gives_up():
    """Accepted, then silence (pings answered): each connection waits the client's timeout, not for ever."""
    import time

    from wm_refiner_client import TransportError

    async def silent(ws):
        await asyncio.sleep(60)

    with FakeWS(silent) as fake:
        started = time.monotonic()
        errors = stream_both(fake.url, timeout=0.5)
        assert time.monotonic() - started < 10
        assert fake.connections == 4  # FAST: two tries each
    for error in errors:
        assert isinstance(error, TransportError) and "no session event within 0.5 s" in str(error)


@pytest.mark.parametrize("event", [{"type": "session"}, {"type": "session", "frames_received": -5},
                                   {"type": "session", "frames_received": "x", "flushed": False},
                                   {"type": "session", "frames_received": 0, "durable_frames": [1]}])
def test_a_session_event_without_a_frame_count_is_a_protocol_error(event):
    async def handler(ws):
        await ws.send(json.dumps({"session_id": SID, "flushed": False, **event}))
        await asyncio.sleep(60)

    with FakeWS(handler) as fake:
        for error in stream_both(fake.url):
            assert isinstance(error, ProtocolError) and "not a frame count" in str(error)
