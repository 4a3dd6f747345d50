"""The client against a broken or hostile server (in-process fakes, no refiner): every failure is a
``wm_refiner_client`` error naming what was wrong, within a bounded time and memory, never a bare
``JSONDecodeError``/``KeyError`` or a hang."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from wm_refiner_client import AsyncClient, Client, ProtocolError, RetryPolicy, Unit

SID = "abcdefgh1234"


class FakeHTTP:
    """A loopback HTTP server answering every request with ``answer(method, path) -> (status, headers, body)``.
    ``body``: bytes (sent with its content-length), a dict or list (as JSON), or ``write(wfile)``, which sends the
    body itself after ``headers`` (an endless one: until the client cuts the connection, which ``cut`` records)."""

    def __init__(self, answer):
        outer = self
        self.answer = answer
        self.requests: list[str] = []
        self.cut = threading.Event()  # a ``write`` body found the connection closed by the client

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
                if callable(body):
                    self.close_connection = True
                    self.end_headers()
                    try:
                        body(self.wfile)
                    except (BrokenPipeError, ConnectionResetError):
                        outer.cut.set()
                    return
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


def both(url, call, error=ProtocolError, retry=FAST, timeout=5.0):
    """``call(client)`` with the sync and the asyncio client: the messages of the ``error`` they raise."""
    errors = []
    with Client(url, retry=retry, timeout=timeout) as client:
        with pytest.raises(error) as sync_error:
            call(client)
        errors.append(str(sync_error.value))

    async def run():
        client = AsyncClient(url, retry=retry, timeout=timeout)
        try:
            with pytest.raises(error) as async_error:
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
    """A loopback WebSocket server running ``handler(ws)`` for every connection, on a loop in a thread; ``info``: the
    JSON it answers a plain ``GET /v1/info`` with (None: that request fails its handshake); ``routes``: more paths a
    plain GET gets JSON from (a value, or a function called for each request)."""

    def __init__(self, handler, info=None, routes=None):
        from websockets.asyncio.server import serve

        self.connections = 0
        self.info_requests = 0
        answers = dict(routes or {})
        if info is not None:
            answers["/v1/info"] = info

        def process_request(connection, request):
            if request.path in answers and "upgrade" not in request.headers:
                self.info_requests += request.path == "/v1/info"
                answer = answers[request.path]
                return connection.respond(200, json.dumps(answer() if callable(answer) else answer))
            return None
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def counted(ws):
            self.connections += 1
            await handler(ws)

        async def start():
            return await serve(counted, "127.0.0.1", 0, process_request=process_request)

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


def errors_of_both(url, config, call, retry=FAST, timeout=5.0):
    """``call(session)`` (an iterator: a stream, a watch) with the sync and the asyncio client, over a handle made
    without a request: the errors they end with."""
    from wm_refiner_client import WmRefinerError
    from wm_refiner_client.aio import AsyncSession
    from wm_refiner_client.client import Session

    errors = []
    with Client(url, retry=retry, timeout=timeout) as client:
        with pytest.raises(WmRefinerError) as sync_error:
            list(call(Session(client, SID, config)))
        errors.append(sync_error.value)

    async def run():
        client = AsyncClient(url, retry=retry, timeout=timeout)
        try:
            with pytest.raises(WmRefinerError) as async_error:
                async for _ in call(AsyncSession(client, SID, config)):
                    pass
            errors.append(async_error.value)
        finally:
            await client.aclose()

    asyncio.run(run())
    assert len(errors) == 2
    return errors


def stream_both(url, timeout=5.0, config=None, retry=FAST):
    """A stream of 4 frames with the sync and the asyncio client: the errors they end with (bounded by ``timeout``
    per connection and two connections)."""
    import numpy as np

    chunks = [np.zeros((1, 1, 4, 1, 1), np.float32)]
    return errors_of_both(url, config or {"sink_frames": 1, "block_size": 3}, lambda session: session.stream(chunks),
                          retry, timeout)


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


@pytest.mark.parametrize("flushed", ["missing", "no", 0, None])
def test_a_session_event_whose_flushed_is_not_a_boolean_is_a_protocol_error(flushed):
    """Without "flushed" the stream ended with a bare KeyError; "no" (truthy) read as flushed made it a
    StreamClosedError 409 saying the session takes no more frames."""
    event = {"type": "session", "session_id": SID, "frames_received": 0}
    if flushed != "missing":
        event["flushed"] = flushed

    async def handler(ws):
        await ws.send(json.dumps(event))
        await asyncio.sleep(60)

    with FakeWS(handler) as fake:
        for error in stream_both(fake.url):
            assert isinstance(error, ProtocolError), error
            assert f"the session event's flushed is {flushed!r}, not true or false" in str(error)


# --- answers that do not end, or end too late --------------------------------------------------------------------
def endless(piece=b" " * 65536, pause=0.0):
    """A body that never ends: ``piece`` after ``piece`` (``pause`` s apart) until the client closes."""
    import time

    def write(wfile):
        while True:
            wfile.write(piece)
            wfile.flush()
            if pause:
                time.sleep(pause)

    return write


def test_an_endless_json_answer_is_cut_at_its_limit():
    """httpx's timeout is per read: a JSON answer that streams for ever grew the client's memory without bound.
    It stops at 16 MiB (MAX_JSON_ANSWER_BYTES), naming the size and the limit, and the connection is closed."""
    from wm_refiner_client._common import MAX_JSON_ANSWER_BYTES

    with FakeHTTP(lambda method, path: (200, JSON, endless(b"[" * 65536))) as fake:
        for message in both(fake.url, lambda c: c.info()):
            assert "GET /v1/info" in message and f"over this answer's limit of {MAX_JSON_ANSWER_BYTES} bytes" in message
            assert f"ran past {MAX_JSON_ANSWER_BYTES} bytes" in message
        assert fake.cut.wait(10)
        assert len(fake.requests) == 2  # not retried: one request per client


def test_an_answer_declaring_more_than_its_limit_is_not_read():
    def answer(method, path):
        return 200, {**JSON, "content-length": str(1 << 40)}, endless()

    with FakeHTTP(answer) as fake:
        for message in both(fake.url, lambda c: c.sessions()):
            assert f"declares {1 << 40} bytes" in message and "limit of 16777216 bytes" in message
        assert fake.cut.wait(10)


def test_an_endless_chunk_answer_is_cut_at_what_the_frames_sent_can_weigh():
    """A chunk's answer holds the units of the frames sent and of those the session held back: its limit follows
    from them (unit_answer_limit), far below the JSON answers' 16 MiB for a small chunk."""
    import numpy as np

    from wm_refiner_client._common import unit_answer_limit
    from wm_refiner_client.aio import AsyncSession
    from wm_refiner_client.client import Session

    config = {"sink_frames": 1, "block_size": 3, "outputs": ["latents"]}
    latents = np.zeros((1, 128, 4, 4, 4), np.float32)
    limit = unit_answer_limit(latents.shape, config)
    assert limit == 2 * (4 + 1 + 3) * 4 * 4 * 128 * 4 + 2**20  # 8 frames of float32 latents, twice, and a header

    def call(client):
        session = (AsyncSession if isinstance(client, AsyncClient) else Session)(client, SID, config, next_seq=0)
        return session.send(latents)

    octet = {"content-type": "application/octet-stream"}
    with FakeHTTP(lambda method, path: (200, octet, endless())) as fake:
        for message in both(fake.url, call):
            assert f"POST /v1/sessions/{SID}/chunks" in message and f"limit of {limit} bytes" in message
        assert fake.cut.wait(10)


def test_an_answers_limit_follows_from_what_was_asked():
    from wm_refiner_client._common import unit_answer_limit

    latents = {"sink_frames": 1, "block_size": 3, "outputs": ["latents"]}
    small, wide, longer = (1, 128, 3, 4, 4), (1, 128, 3, 8, 8), (1, 128, 12, 4, 4)
    assert unit_answer_limit(wide, latents) > unit_answer_limit(small, latents)
    assert unit_answer_limit(longer, latents) > unit_answer_limit(small, latents)
    video = {**latents, "outputs": ["latents", "video"], "video_format": "uint8"}
    assert unit_answer_limit(small, {**video, "video_format": "float32"}) > unit_answer_limit(small, video) \
        > unit_answer_limit(small, latents)
    # The whole clip of /v1/refine: its own frames, nothing held back; unknown outputs: the spec's default (latents).
    assert unit_answer_limit(small, {}, whole_clip=True) == 2 * 3 * 16 * 128 * 4 + 2**20
    assert unit_answer_limit(small, {"outputs": "latents,video"}, whole_clip=True) > \
        unit_answer_limit(small, {}, whole_clip=True)
    # A handle not given the session's outputs (``Session(client, id, {})``) or video format: any, the widest assumed.
    assert unit_answer_limit(small, {**latents, "outputs": None}) >= \
        unit_answer_limit(small, {**video, "video_format": None}) == \
        unit_answer_limit(small, {**video, "video_format": "float32"})
    assert unit_answer_limit((1, 128, 4, 4), latents) == 16 * 2**20  # no unit answers those: an error's JSON does


DEADLINE = RetryPolicy(attempts=10, backoff_s=0.01, max_backoff_s=0.01, deadline_s=1.0)


def test_a_server_that_never_answers_costs_the_deadline_not_attempts_times_timeout():
    """Accepted, then silence: 10 tries x the 5 s timeout (50 s) without a deadline; RetryPolicy.deadline_s bounds
    the whole call."""
    import time

    from wm_refiner_client import TransportError

    def answer(method, path):
        time.sleep(30)
        return 200, JSON, {}

    with FakeHTTP(answer) as fake:
        for message in both(fake.url, lambda c: c.info(), TransportError, DEADLINE):
            assert "GET /v1/info" in message and "RetryPolicy.deadline_s (1 s)" in message


def test_a_request_that_is_not_retried_names_the_deadline_that_cut_its_try():
    """POST /v1/sessions is not retried after its request left: its one try, cut to the deadline's 1 s (the client's
    timeout is 5 s), raised a bare 'ReadTimeout', as if the timeout had been 1 s."""
    import time

    from wm_refiner_client import TransportError

    def answer(method, path):
        time.sleep(30)
        return 201, JSON, {}

    with FakeHTTP(answer) as fake:
        for message in both(fake.url, lambda c: c.create_session(), TransportError, DEADLINE):
            assert message.startswith("POST /v1/sessions: RetryPolicy.deadline_s (1 s) passed without an answer "
                                      "(1 try, the last: ReadTimeout"), message


def test_an_answer_that_trickles_in_stops_at_the_deadline():
    """A byte every 0.1 s: every read is within the timeout, and a 1 KiB answer would take 100 s."""
    from wm_refiner_client import TransportError

    def answer(method, path):
        return 200, {**JSON, "content-length": "1024"}, endless(b" ", pause=0.1)

    with FakeHTTP(answer) as fake:
        for message in both(fake.url, lambda c: c.info(), TransportError, DEADLINE):
            assert "RetryPolicy.deadline_s (1 s) passed" in message and "bytes of the answer's body" in message


def test_a_503_whose_retry_after_ends_past_the_deadline_is_raised_at_once(monkeypatch):
    from wm_refiner_client import ServiceUnavailableError

    from .test_first_hour import recorded_waits

    waits = [recorded_waits(monkeypatch, "sync"), recorded_waits(monkeypatch, "async")]
    body = {"error": {"code": "too_many_sessions", "message": "full"}}
    with FakeHTTP(lambda method, path: (503, {**JSON, "retry-after": "5"}, body)) as fake:
        both(fake.url, lambda c: c.create_session(), ServiceUnavailableError, DEADLINE)
        assert len(fake.requests) == 2  # one try each: the 5 s wait would end past the 1 s deadline
    assert waits == [[], []]  # raised without waiting


def test_a_deadline_is_a_positive_number_of_seconds():
    for wrong in (0, -1.0):
        with pytest.raises(ValueError, match="deadline_s"):
            RetryPolicy(deadline_s=wrong)
    assert RetryPolicy().deadline_s is None


def test_a_stream_unit_past_the_frames_sent_is_a_protocol_error_when_it_arrives():
    """The session had no frames and the stream sent 4: a unit ending at frame 1000 is not the service's. Caught as
    it arrives (before, the caller got it, and only a ``done`` that disagreed was noticed)."""
    async def handler(ws):
        await ws.send(json.dumps({"type": "session", "session_id": SID, "frames_received": 0, "flushed": False}))
        await ws.recv()  # the client's 4 frames
        await ws.send(_safetensors({"frame_start": "0", "frame_end": "1000"}, {}))
        await asyncio.sleep(60)

    with FakeWS(handler) as fake:
        errors = stream_both(fake.url)
    for error in errors:
        assert isinstance(error, ProtocolError), error
        assert "frames [0, 1000)" in str(error) and "only 4 frames: 4 sent by this stream" in str(error)


# --- WebSocket messages that do not end --------------------------------------------------------------------------
LATENTS_ONLY = {"sink_frames": 1, "block_size": 3, "outputs": ["latents"]}
SESSION_EVENT = json.dumps({"type": "session", "session_id": SID, "frames_received": 0, "flushed": False})
ENDLESS_MIB = 40  # "endless": past every limit below, yet finite, so a client without one ends (its test fails)


async def send_endless(ws, kind):
    """One message of ``ENDLESS_MIB`` MiB, sent in 1 MiB fragments (a frame header of its own each)."""
    piece = b"\0" * 2**20 if kind == "binary" else "[" * 2**20

    async def pieces():
        for _ in range(ENDLESS_MIB):
            yield piece

    try:
        await ws.send(pieces())
    except Exception:  # the client closed the connection at its limit
        return
    await asyncio.sleep(60)


@pytest.mark.parametrize("kind", ["binary", "text"])
def test_an_endless_stream_message_is_cut_at_the_connections_limit(kind):
    """websockets' max_size was None: a message that never ends grew the client's memory without bound. A stream's
    limit follows from its chunks' geometry and config (MessageLimit), at least the 16 MiB of a JSON event."""
    from wm_refiner_client._common import MAX_JSON_ANSWER_BYTES

    async def handler(ws):
        await ws.send(SESSION_EVENT)
        await ws.recv()  # the client's 4 frames
        await send_endless(ws, kind)

    with FakeWS(handler) as fake:
        errors = stream_both(fake.url, config=LATENTS_ONLY)
        assert fake.connections == 2  # not retried: one connection per client
    for error in errors:
        assert isinstance(error, ProtocolError), error
        assert f"stream of session {SID}: the server sent a message of at least" in str(error)
        assert f"over this connection's limit of {MAX_JSON_ANSWER_BYTES} bytes" in str(error)


def test_a_stream_unit_over_what_one_unit_can_weigh_is_refused():
    """Under websockets' bound (the JSON events' 16 MiB) but over one unit's: refused by its kind's limit."""
    async def handler(ws):
        await ws.send(SESSION_EVENT)
        await ws.recv()
        await ws.send(b"\0" * (2 * 2**20))
        await asyncio.sleep(60)

    with FakeWS(handler) as fake:
        errors = stream_both(fake.url, config=LATENTS_ONLY)
    for error in errors:
        assert isinstance(error, ProtocolError), error
        # One unit of one row, one channel, 1 x 1 latent pixels: a block of 3 frames' float32 values and a header.
        assert f"a binary message of {2 * 2**20} bytes, over this connection's limit of {3 * 4 + 2**16}" \
            in str(error)


@pytest.mark.parametrize("durable", ["x", "inf", "-5", "1e3"])
def test_a_stream_unit_whose_durable_frames_is_not_a_count_is_a_protocol_error(durable):
    """A unit's durable_frames (its metadata: text) went through int(): "x" ended the stream with a bare
    ValueError, "-5" was taken as a frame count."""
    async def handler(ws):
        await ws.send(SESSION_EVENT)
        await ws.recv()  # the client's 4 frames
        await ws.send(_safetensors({"frame_start": "0", "frame_end": "1", "durable_frames": durable}, {}))
        await asyncio.sleep(60)

    with FakeWS(handler) as fake:
        errors = stream_both(fake.url)
    for error in errors:
        assert isinstance(error, ProtocolError), error
        assert f"a unit whose durable_frames {durable!r} is not a frame count" in str(error)


INFO = {"model": {"channels": 8}, "limits": {"max_batch": 2, "max_frame_tokens": 16}}


def watch_both(url, config, call=lambda session: session.watch(), retry=FAST, timeout=5.0):
    """``errors_of_both`` of a watch (or of ``call``)."""
    return errors_of_both(url, config, call, retry, timeout)


@pytest.mark.parametrize("kind", ["binary", "text"])
def test_an_endless_watch_message_is_cut_at_the_widest_unit_the_server_allows(kind):
    """A watcher has sent no latents: its limit follows from the server's limits (GET /v1/info: max_batch rows of
    the model's channels, max_frame_tokens latent pixels) and the session's config."""
    from wm_refiner_client._common import MAX_JSON_ANSWER_BYTES, unit_message_limit

    config = {**LATENTS_ONLY, "sink_frames": 32768}  # a unit of up to 32768 frames: over 16 MiB
    unit_bytes = unit_message_limit((2, 8, 16, 1), config)  # a unit of 2 rows of 8 channels, 16 x 1 latent pixels
    assert unit_bytes == 2 * 32768 * 16 * 8 * 4 + 2**16 > MAX_JSON_ANSWER_BYTES

    async def handler(ws):
        await send_endless(ws, kind)

    with FakeWS(handler, info=INFO) as fake:
        errors = watch_both(fake.url, config)
        assert fake.info_requests == 2
    for error in errors:
        assert isinstance(error, ProtocolError), error
        assert f"watch of session {SID}: the server sent a message of at least" in str(error)
        assert f"over this connection's limit of {unit_bytes} bytes" in str(error)


def test_a_watch_event_over_an_events_limit_is_refused():
    """Under the connection's bound (a large unit's) but over a JSON event's 16 MiB."""
    from wm_refiner_client._common import MAX_JSON_ANSWER_BYTES

    config = {**LATENTS_ONLY, "sink_frames": 32768}
    size = MAX_JSON_ANSWER_BYTES + 2**20

    async def handler(ws):
        await ws.send("[" * size)
        await asyncio.sleep(60)

    with FakeWS(handler, info=INFO) as fake:
        errors = watch_both(fake.url, config)
    for error in errors:
        assert isinstance(error, ProtocolError), error
        assert f"a text message of {size} bytes, over this connection's limit of {MAX_JSON_ANSWER_BYTES}" \
            in str(error)


@pytest.mark.parametrize("event", ['{"type": "block", "frame_start": Infinity, "frame_end": 1}',
                                   '{"type": "dropped", "units": -Infinity}', '{"type": "dropped", "units": -3}',
                                   '{"type": "block", "frame_start": "1", "frame_end": 4.5}'])
def test_a_watch_event_whose_counts_are_not_counts_is_a_protocol_error(event):
    """Infinity (which Python's json reads) ended the watch with a bare OverflowError; a negative or fractional
    count, or one in a string, was handed on as a frame number."""
    async def handler(ws):
        await ws.send(event)
        await asyncio.sleep(60)

    with FakeWS(handler, info=INFO) as fake:
        errors = watch_both(fake.url, LATENTS_ONLY)
    for error in errors:
        assert isinstance(error, ProtocolError), error
        assert f"event that is not the service's: {event!r}" in str(error)


@pytest.mark.parametrize("info, said", [({"model": {}, "limits": {"max_batch": 2, "max_frame_tokens": 16}},
                                         "model.channels is None"),
                                        ({**INFO, "limits": {"max_batch": "2", "max_frame_tokens": 16}},
                                         "limits.max_batch is '2'")])
def test_a_watch_of_a_server_whose_info_has_no_limits_is_a_protocol_error(info, said):
    async def handler(ws):
        await asyncio.sleep(60)

    with FakeWS(handler, info=info) as fake:
        errors = watch_both(fake.url, LATENTS_ONLY)
        assert fake.connections == 0  # refused before connecting
    for error in errors:
        assert isinstance(error, ProtocolError) and said in str(error), error


# --- a stream's reconnects within RetryPolicy.deadline_s -------------------------------------------------------------
def test_a_streams_reconnects_stop_at_the_deadline():
    """Every connection closes before the session event: without a deadline the stream reconnects ``attempts``
    times (and for ``restart_timeout_s`` while a server restarts); ``deadline_s`` bounds the time without a
    connection, as it bounds an HTTP call."""
    from wm_refiner_client import TransportError

    attempts = 200

    async def handler(ws):
        await ws.close(1011, "internal error")

    policy = RetryPolicy(attempts=attempts, backoff_s=0.01, max_backoff_s=0.01, deadline_s=0.5)
    with FakeWS(handler) as fake:
        errors = stream_both(fake.url, config=LATENTS_ONLY, retry=policy)
        assert fake.connections < 2 * attempts  # gave up before its attempts were spent
    for error in errors:
        assert isinstance(error, TransportError), error
        assert str(error).startswith(f"stream of session {SID}: RetryPolicy.deadline_s (0.5 s) passed without a "
                                     "connection ("), error


def _unit(start, end):
    return _safetensors({"frame_start": str(start), "frame_end": str(end)},
                        {"latents": ("F32", [1, 1, end - start, 1, 1], b"\0" * 4 * (end - start))})


def test_a_deadline_that_passes_before_a_connection_opens_is_said_once():
    """A stream that has sent no chunk learns its message limit from GET /v1/info before each connection; when that
    answer is slow, the deadline can pass between the wait and the connection. That was taken for a refused
    connection (one more failed try) and the stream ended with the deadline's error wrapped in itself: "passed
    without a connection (2 failed tries, the last: ... passed without a connection (1 failed try ...))"."""
    import time

    from wm_refiner_client import TransportError

    def slow_info():
        time.sleep(1.2)  # two of them pass the deadline, one does not
        return INFO

    async def handler(ws):
        await ws.close(1011, "internal error")  # before the session event: the stream connects again

    policy = RetryPolicy(attempts=50, backoff_s=0.01, max_backoff_s=0.01, deadline_s=2.0)
    with FakeWS(handler, routes={"/v1/info": slow_info}) as fake:
        errors = watch_both(fake.url, LATENTS_ONLY, call=lambda session: session.stream([]), retry=policy)
        assert fake.connections == 2  # one per client: its second try was cut before it connected
    for error in errors:
        assert isinstance(error, TransportError), error
        message = str(error)
        assert message.startswith(f"stream of session {SID}: RetryPolicy.deadline_s (2 s) passed without a "
                                  "connection (1 failed try, the last: TransportError (the stream closed before the "
                                  "session event"), message
        assert message.count("RetryPolicy.deadline_s") == 1, message


def test_a_connected_stream_outlasts_its_deadline_and_reconnects_within_it():
    """deadline_s bounds each reconnection, not the stream: a block that takes longer than it to come back, on a
    connection that stays open, is waited for; the connection dropped after it is opened again."""
    from wm_refiner_client.aio import AsyncSession
    from wm_refiner_client.client import Session

    import numpy as np

    async def handler(ws):
        if fake.connections % 2 == 1:  # the first connection of each client: one unit, a long block, then a drop
            await ws.send(SESSION_EVENT)
            await ws.recv()
            await ws.send(_unit(0, 1))
            await asyncio.sleep(1.0)  # twice the deadline, connected
            ws.transport.abort()
            return
        await ws.send(json.dumps({"type": "session", "session_id": SID, "frames_received": 4, "flushed": False}))
        await ws.send(_unit(1, 4))
        assert json.loads(await ws.recv()) == {"type": "flush"}
        await ws.send(json.dumps({"type": "done", "frames": 4}))
        await ws.close()

    policy = RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.01, deadline_s=0.5)
    chunks = [np.zeros((1, 1, 4, 1, 1), np.float32)]
    with FakeWS(handler) as fake:
        with Client(fake.url, retry=policy, timeout=5.0) as client:
            units = list(Session(client, SID, LATENTS_ONLY).stream(chunks))
            assert [(u.frame_start, u.frame_end) for u in units] == [(0, 1), (1, 4)]

        async def run():
            async with AsyncClient(fake.url, retry=policy, timeout=5.0) as client:
                return [u async for u in AsyncSession(client, SID, LATENTS_ONLY).stream(chunks)]

        assert [(u.frame_start, u.frame_end) for u in asyncio.run(run())] == [(0, 1), (1, 4)]
        assert fake.connections == 4


# --- what a watch cannot have seen -----------------------------------------------------------------------------------
def _done_after(units):
    async def handler(ws):
        for start, end in units:
            await ws.send(_unit(start, end))
            await ws.send(json.dumps({"type": "block", "frame_start": start, "frame_end": end, "latency_ms": 1.0}))
        await ws.send(json.dumps({"type": "done", "frames": 7}))
        await ws.close()
    return handler


def test_a_watch_says_the_frames_the_session_returned_in_all():
    """The done event's count was dropped: a watch that missed the session's last units (finalized before it
    joined again) could not tell. ``frames`` against ``frame_end`` names them."""
    from wm_refiner_client.aio import AsyncSession
    from wm_refiner_client.client import Session

    with FakeWS(_done_after([(4, 5)]), info=INFO) as fake:
        with Client(fake.url, retry=FAST) as client:
            watch = Session(client, SID, LATENTS_ONLY).watch()
            assert (watch.frames, watch.frame_end) == (None, None)
            assert [type(item).__name__ for item in watch] == ["Unit", "BlockEvent"]
            assert (watch.frames, watch.frame_end) == (7, 5)

        async def run():
            async with AsyncClient(fake.url, retry=FAST) as client:
                watch = AsyncSession(client, SID, LATENTS_ONLY).watch()
                items = [type(item).__name__ async for item in watch]
                return items, watch.frames, watch.frame_end

        assert asyncio.run(run()) == (["Unit", "BlockEvent"], 7, 5)


@pytest.mark.parametrize("returned, flushed", [(4, False), (7, False), (7, True)])
def test_python_m_app_watch_names_the_frames_a_restart_cost_it(tmp_path, returned, flushed):
    """``python -m app watch`` rides out a restart of the session's replica (close 1012) and watches again with
    resume_from = the frames it holds (4), whether the session answers with frames already returned or flushed. A
    server that then sends none of the frames it returned meanwhile (only the flush's done, 7 frames) cost it
    [4, 7): they were lost silently before; it names them and exits 2, the file holding the frames before them."""
    from safetensors.numpy import load_file

    from .test_cli import run_cli

    states = []

    def state():
        states.append(1)
        first = len(states) == 1  # get_session, before the watch; later: the session after the restart
        return {"session_id": SID, "config": LATENTS_ONLY, "frames_received": 7, "next_seq": 2,
                "frames_returned": 0 if first else returned, "flushed": False if first else flushed}

    paths = []

    async def handler(ws):
        paths.append(ws.request.path)
        if fake.connections == 1:
            for start, end in [(0, 1), (1, 4)]:
                await ws.send(_unit(start, end))
            await ws.close(1012, "service restart")
            return
        await _done_after([])(ws)

    output = tmp_path / "watched.safetensors"
    with FakeWS(handler, info=INFO, routes={f"/v1/sessions/{SID}": state}) as fake:
        result = run_cli("watch", SID, "--server", fake.url, "--output", str(output))
        assert fake.connections == 2
    from urllib.parse import parse_qs, urlsplit

    assert [parse_qs(urlsplit(path).query) for path in paths] == [
        {"outputs": ["latents"]}, {"outputs": ["latents"], "resume_from": ["4"]}]
    assert result.returncode == 2, result
    assert "error: frames [4, 7)" in result.stderr, result.stderr
    assert load_file(str(output))["latents"].shape[2] == 4  # frames [0, 4)


def np_bytes(values):
    import numpy as np

    return np.asarray(values, np.float32).tobytes()


def test_python_m_app_watchs_events_closed_early_close_the_watchs_connection():
    """``watch_command`` stops reading at a gap (or Ctrl-C) and closes its events (``_follow``) so that the watch's
    connection closes then, not when the command has written its files and returned: the server goes on offering
    units to a watcher that is still attached. ``_follow`` iterates a ``Watch`` object, whose connection closing
    the generator used to leave open."""
    from app.cli import watch
    from wm_refiner_client.client import Session

    closed = threading.Event()

    async def handler(ws):
        await ws.send(_unit(0, 1))
        await ws.wait_closed()  # the client closes; this server never does
        closed.set()

    with FakeWS(handler, info=INFO) as fake, Client(fake.url, retry=FAST) as client:
        events = watch._follow(Session(client, SID, LATENTS_ONLY), None, None)
        first = next(events)
        assert (first.frame_start, first.frame_end) == (0, 1)
        events.close()
        assert closed.wait(10), "the watch's connection is still open after its events were closed"
        assert fake.connections == 1


def test_python_m_app_watch_writes_frames_sent_again_once(tmp_path):
    """A unit that repeats frames the watch holds (a replica that adopted an older checkpoint refines them again)
    was appended whole: the file held frames [2, 4) twice. Only its new frames are kept."""
    from safetensors.numpy import load_file

    from .test_cli import run_cli

    state = {"session_id": SID, "config": LATENTS_ONLY, "frames_received": 6, "next_seq": 2, "frames_returned": 0,
             "flushed": False}

    async def handler(ws):
        await ws.send(_safetensors({"frame_start": "0", "frame_end": "4"},
                                   {"latents": ("F32", [1, 1, 4, 1, 1], np_bytes([0, 1, 2, 3]))}))
        await ws.send(_safetensors({"frame_start": "2", "frame_end": "4"},
                                   {"latents": ("F32", [1, 1, 2, 1, 1], np_bytes([2, 3]))}))
        await ws.send(_safetensors({"frame_start": "2", "frame_end": "6"},
                                   {"latents": ("F32", [1, 1, 4, 1, 1], np_bytes([2, 3, 4, 5]))}))
        await ws.send(json.dumps({"type": "done", "frames": 6}))
        await ws.close()

    output = tmp_path / "watched.safetensors"
    with FakeWS(handler, info=INFO, routes={f"/v1/sessions/{SID}": state}) as fake:
        result = run_cli("watch", SID, "--server", fake.url, "--output", str(output))
    assert result.returncode == 0, result
    assert f"frames [0, 6) -> {output}" in result.stdout, result.stdout
    assert load_file(str(output))["latents"].reshape(-1).tolist() == [0, 1, 2, 3, 4, 5]


def test_a_watchs_handshake_stops_at_the_deadline():
    """The watch's GET /v1/info was bounded by RetryPolicy.deadline_s, its handshake by the client's timeout alone:
    a server that takes the upgrade request and never answers it held the watch for the whole timeout."""
    from wm_refiner_client import TransportError

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /v1/info "):
            body = json.dumps(INFO).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            await writer.drain()
            writer.close()
            return
        await asyncio.sleep(60)  # the upgrade: never answered

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = asyncio.run_coroutine_threadsafe(asyncio.start_server(serve, "127.0.0.1", 0), loop).result()
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    policy = RetryPolicy(attempts=2, backoff_s=0.01, max_backoff_s=0.01, deadline_s=0.5)
    try:
        errors = watch_both(url, LATENTS_ONLY, retry=policy, timeout=30.0)
    finally:
        async def stop():
            server.close()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
    for error in errors:
        assert isinstance(error, TransportError), error
        assert str(error).startswith(f"watch of session {SID}: RetryPolicy.deadline_s (0.5 s) passed during the "
                                     "handshake"), error


@pytest.fixture(scope="module")
def video_server(make_settings, tmp_path_factory):
    """A real server with the tiny VAE whose widest session (``max_batch``, ``max_frame_tokens``) is the 4 x 4 clips'
    area: a watcher that has not seen the latents is bounded by what such a session's units weigh."""
    from bench.live import ThreadServer
    from models.checkpoints import write_vae_checkpoint

    vae = write_vae_checkpoint(tmp_path_factory.mktemp("watch-vae"), "tiny-vae")
    with ThreadServer(make_settings(vae=str(vae), max_batch=1, max_frame_tokens=16)) as live:
        yield live


def watched_messages(server, config) -> tuple[dict, list, list]:
    """A session of ``config`` refining a 10-frame 4 x 4 clip in one flushed chunk, watched by this client (the
    ``Unit`` s it reads, events left out) and by a bare WebSocket (every message the server sent, as sent, up to its ``done``).
    Returns the session's whole config (as a handle has it), the units and the messages."""
    import httpx
    from websockets.sync.client import connect

    from tests.client.conftest import clip

    latents, prompt, mask = clip(frames=10)
    with Client(server.base_url, retry=FAST, timeout=60.0) as client:
        session = client.create_session(**config)
        units, messages = [], []
        watcher = threading.Thread(target=lambda: units.extend(client.get_session(session.id).watch()))
        watcher.start()
        with connect(f"{server.ws_url}/v1/sessions/{session.id}/watch", max_size=None) as raw:
            pause = threading.Event()
            while httpx.get(f"{server.base_url}/v1/sessions/{session.id}").json()["watchers"] < 2:
                assert watcher.is_alive()
                pause.wait(0.02)
            session.send(latents, prompt, mask, flush=True)
            while True:
                message = raw.recv(timeout=60)
                if isinstance(message, str) and json.loads(message)["type"] == "done":
                    break
                messages.append(message)
        watcher.join(60)
        return session.config, [unit for unit in units if isinstance(unit, Unit)], messages


@pytest.mark.parametrize("video_format", ["float32", "uint8", "jpeg", "h264"])
def test_a_watch_with_video_is_bounded_by_what_its_units_weigh_and_refuses_one_byte_more(video_server, video_format):
    """A watcher's bound on one message (``MessageLimit``: ``unit_message_limit`` of the widest geometry the server
    allows, its VAE's figures from ``GET /v1/info``) for each ``video_format`` the server sends: every real unit
    passes, the bound is within a quarter of what the largest unit's frames weigh raw in the format (encoded: as
    uint8, which no encoding exceeds), and a message one byte over it is refused naming its size (the real units
    before it, replayed byte for byte, pass)."""
    pytest.importorskip("PIL" if video_format == "jpeg" else "av")
    from wm_refiner_client._common import message_limit

    config, units, messages = watched_messages(video_server, {"outputs": ["latents", "video"],
                                                              "video_format": video_format})
    binary = [m for m in messages if isinstance(m, bytes)]
    assert len(units) == len(binary) and units[-1].frame_end == 10 and units[-1].video_frame_end > 0
    with Client(video_server.base_url) as client:
        info = client.info()
    limit = message_limit("watch", config, None, info).unit_bytes
    largest = binary[-1]  # the flush's: the last block and the video's tail
    assert len(largest) == max(map(len, binary))
    # What the largest unit holds, raw in its format: its video frames (4 x 32 pixels a side, 3 values) and 3 frames
    # of float32 latents (16 latent pixels, 128 channels).
    video_frames = units[-1].video_frame_end - units[-1].video_frame_start
    raw_bytes = video_frames * (4 * 32) ** 2 * 3 * (4 if video_format == "float32" else 1) + 3 * 16 * 128 * 4
    assert len(largest) <= limit < 1.25 * raw_bytes, (len(largest), limit, raw_bytes)

    over = largest + b"\0" * (limit + 1 - len(largest))
    replayed = [over if message is largest else message for message in messages]

    async def handler(ws):
        for message in replayed:
            await ws.send(message)
        await asyncio.sleep(60)

    with FakeWS(handler, info=info) as fake:
        errors = watch_both(fake.url, config)
    for error in errors:
        assert isinstance(error, ProtocolError), error
        assert f"a binary message of {limit + 1} bytes, over this connection's limit of {limit} bytes" in str(error)


def test_a_preview_without_video_is_bounded_by_its_jpeg_not_by_video_frames():
    """A session with a preview and no video decodes its video but sends only one JPEG a row per unit: its units are
    bounded by the latents and that JPEG (``preview_width`` wide, the video's aspect), not by the video's frames."""
    from wm_refiner_client._common import unit_message_limit

    config = {"sink_frames": 1, "block_size": 3, "video_lookahead": "exact", "preview_width": 160}
    latents = 3 * 4 * 4 * 128 * 4  # a block's float32 latents, 4 x 4 latent pixels, 128 channels
    preview = unit_message_limit((1, 128, 4, 4), {**config, "outputs": ["latents", "preview"]})
    assert preview == latents + 3 * 160 * 160 + 4096 + 2**16  # a 160 x 160 JPEG at most raw, its headers, the header
    # 2 x 8 latent pixels: 160 x 40 previews; with video, its frames come on top.
    assert unit_message_limit((1, 128, 2, 8), {**config, "outputs": ["preview"]}) == 3 * 160 * 40 + 4096 + 2**16
    assert unit_message_limit((1, 128, 4, 4), {**config, "outputs": ["latents", "video", "preview"],
                                               "video_format": "uint8"}) > preview + 8 * 3 * (4 * 32) ** 2
