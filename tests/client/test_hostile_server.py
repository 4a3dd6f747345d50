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
