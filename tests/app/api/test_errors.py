"""Every row of api.md's error table: the status, the envelope, and that the session is left exactly as it was
(its state is unchanged and the next good chunk still returns the right bytes)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from starlette.testclient import WebSocketDenialResponse

from app.core.settings import Settings

from tests.app.conftest import (
    DEADLINE_S,
    OCTET,
    EngineHold,
    expected_clip,
    make_clip,
    payload,
    read_latents,
    running_app,
    session_state,
    wait_until,
)

LIMITS = dict(max_body_bytes=200_000, max_ws_message_bytes=200_000, max_frames_per_chunk=8, max_prompt_tokens=16)
LATENTS, EMBEDS, MASK = make_clip(frames=8, seed=3)


@pytest.fixture(scope="module")
def client(checkpoint_dir, tmp_path_factory):
    # Room for every session the tests on this one app create (flushed ones stay for flushed_session_ttl_s).
    settings = Settings(
        model=str(checkpoint_dir), device="cpu", dtype="float32", cache_dir=tmp_path_factory.mktemp("cache"),
        max_sessions=64, **LIMITS
    )
    with running_app(settings) as client:
        yield client


@pytest.fixture(scope="module")
def expected(refiner):
    return expected_clip(refiner, LATENTS, EMBEDS, MASK)


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) >= {"error"} and body["error"]["code"] == code, body
    assert len(body["error"]["message"]) > 20, "the message should say what was wrong and what to send"
    if status == 503:
        assert int(response.headers["retry-after"]) >= 1
    return body


def new_session(client, **config) -> str:
    response = client.post("/v1/sessions", json=config)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


def post_chunk(client, session_id, body: bytes, headers=OCTET, **params):
    return client.post(f"/v1/sessions/{session_id}/chunks", params=params, content=body, headers=headers)


def started_session(client) -> str:
    """A session that has taken frames 0..4 (seq 0) and returned 0..3."""
    session_id = new_session(client)
    response = post_chunk(client, session_id, payload(LATENTS[:, :, :5], EMBEDS, MASK), seq=0)
    assert response.status_code == 200, response.text
    return session_id


def finish_and_check(client, session_id, expected) -> None:
    """The next good chunk (seq 1, flushing) returns frames 4..7 exactly as an untroubled session would."""
    response = post_chunk(client, session_id, payload(LATENTS[:, :, 5:8]), seq=1, flush="true")
    assert response.status_code == 200, response.text
    latents, meta = read_latents(response.content)
    assert (meta["frame_start"], meta["frame_end"]) == ("4", "8")
    assert torch.equal(latents, expected[:, :, 4:8])
    client.delete(f"/v1/sessions/{session_id}")


def garbage() -> bytes:
    return b"definitely not a safetensors file"


def truncated() -> bytes:
    return payload(LATENTS[:, :, 5:6])[:-10]


# (id, request body, extra headers, query params, status, code)
CHUNK_CASES = [
    ("not-safetensors", garbage(), OCTET, {}, 400, "invalid_payload"),
    ("truncated", truncated(), OCTET, {}, 400, "invalid_payload"),
    ("empty-body", b"", OCTET, {}, 400, "invalid_payload"),
    ("no-latents", payload(embeds=EMBEDS), OCTET, {}, 400, "missing_input"),
    ("unknown-tensor", payload(LATENTS[:, :, 5:6], prompt_embed=EMBEDS), OCTET, {}, 400, "invalid_payload"),
    ("mask-without-embeds", payload(LATENTS[:, :, 5:6], mask=MASK), OCTET, {}, 400, "missing_input"),
    ("rank-4", payload(LATENTS[0, :, 5:6]), OCTET, {}, 422, "invalid_input"),
    ("dtype-int32", payload(LATENTS[:, :, 5:6].to(torch.int32)), OCTET, {}, 422, "invalid_input"),
    ("dtype-float64", payload(LATENTS[:, :, 5:6].double()), OCTET, {}, 422, "invalid_input"),
    ("channels-64", payload(LATENTS[:, :64, 5:6]), OCTET, {}, 422, "invalid_input"),
    ("width-differs", payload(torch.randn(1, 128, 1, 4, 5)), OCTET, {}, 422, "invalid_input"),
    ("batch-differs", payload(torch.randn(2, 128, 1, 4, 4)), OCTET, {}, 422, "invalid_input"),
    ("nan", payload(LATENTS[:, :, 5:6].clone().index_fill_(3, torch.tensor([1]), float("nan"))), OCTET, {}, 422,
     "invalid_input"),
    ("inf", payload(LATENTS[:, :, 5:6].clone().fill_(float("inf"))), OCTET, {}, 422, "invalid_input"),
    ("prompt-channels", payload(LATENTS[:, :, 5:6], torch.randn(1, 4, 16)), OCTET, {}, 422, "invalid_input"),
    ("prompt-nan", payload(LATENTS[:, :, 5:6], torch.full((1, 4, 32), float("nan"))), OCTET, {}, 422,
     "invalid_input"),
    ("too-many-frames", payload(torch.randn(1, 128, 9, 4, 4)), OCTET, {}, 413, "too_many_frames"),
    ("prompt-too-long", payload(LATENTS[:, :, 5:6], torch.randn(1, 17, 32)), OCTET, {}, 413, "prompt_too_long"),
    ("body-too-large", payload(torch.randn(1, 128, 8, 8, 8)), OCTET, {}, 413, "payload_too_large"),
    ("content-type-json", payload(LATENTS[:, :, 5:6]), {"content-type": "application/json"}, {}, 415,
     "unsupported_media_type"),
    ("content-type-text", payload(LATENTS[:, :, 5:6]), {"content-type": "text/plain"}, {}, 415,
     "unsupported_media_type"),
    ("seq-ahead", payload(LATENTS[:, :, 5:6]), OCTET, {"seq": 5}, 409, "seq_conflict"),
    ("seq-negative", payload(LATENTS[:, :, 5:6]), OCTET, {"seq": -1}, 422, "invalid_request"),
    ("flush-not-bool", payload(LATENTS[:, :, 5:6]), OCTET, {"flush": "maybe"}, 422, "invalid_request"),
]


@pytest.mark.parametrize("body,headers,params,status,code", [c[1:] for c in CHUNK_CASES], ids=[c[0] for c in CHUNK_CASES])
def test_rejected_chunk_changes_nothing(client, expected, body, headers, params, status, code):
    session_id = started_session(client)
    before = session_state(client, session_id)
    assert_error(post_chunk(client, session_id, body, headers=headers, **params), status, code)
    assert session_state(client, session_id) == before
    finish_and_check(client, session_id, expected)


def test_body_over_the_limit_is_refused_while_streaming(client, expected):
    """No Content-Length (chunked upload): the server counts while reading and stops at the limit."""
    session_id = started_session(client)
    before = session_state(client, session_id)
    sent = []

    def body():
        for _ in range(100):  # 100 x 10 kB, five times the limit
            sent.append(1)
            yield b"\0" * 10_000

    assert_error(post_chunk(client, session_id, body()), 413, "payload_too_large")
    assert session_state(client, session_id) == before
    finish_and_check(client, session_id, expected)


def test_first_chunk_without_prompt_is_400_and_changes_nothing(client, expected):
    session_id = new_session(client)
    before = session_state(client, session_id)
    assert_error(post_chunk(client, session_id, payload(LATENTS[:, :, :5]), seq=0), 400, "missing_input")
    assert session_state(client, session_id) == before
    response = post_chunk(client, session_id, payload(LATENTS[:, :, :5], EMBEDS, MASK), seq=0)
    assert response.status_code == 200
    finish_and_check(client, session_id, expected)


def test_repeated_and_stale_seq(client, expected):
    session_id = started_session(client)
    before = session_state(client, session_id)
    first = post_chunk(client, session_id, payload(LATENTS[:, :, :5], EMBEDS, MASK), seq=0)
    assert first.status_code == 200 and first.headers["x-replayed"] == "true"
    assert session_state(client, session_id) == before, "a replay must not recompute or append"
    body = assert_error(post_chunk(client, session_id, payload(LATENTS[:, :, 5:6]), seq=7), 409, "seq_conflict")
    assert "seq=1" in body["error"]["message"], "the 409 names the expected seq"
    finish_and_check(client, session_id, expected)


def test_after_a_stream_message_the_last_http_seq_is_not_repeated(client, expected):
    """Only the last accepted chunk's seq can be repeated (api.md). A stream message after HTTP seq=0 is the last
    chunk then (it takes seq 1 and has no response to repeat), so seq=0 again is 409 naming seq=2; it used to get
    seq 0's stored response, as if nothing had come since."""
    session_id = started_session(client)  # seq 0 over HTTP: frames 0..4, 0..3 returned
    with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
        ws.send_bytes(payload(LATENTS[:, :, 5:8]))  # seq 1: frames 5..7, block [4, 7) refined
        wait_until(lambda: session_state(client, session_id)["next_seq"] == 2, "the stream message to be accepted")
    before = session_state(client, session_id)
    body = assert_error(post_chunk(client, session_id, payload(LATENTS[:, :, :5], EMBEDS, MASK), seq=0), 409,
                        "seq_conflict")
    message = body["error"]["message"]
    assert "expects seq=2" in message and "seq=0 was accepted already" in message, message
    assert "to get the last response again" not in message, message
    assert session_state(client, session_id) == before
    last = post_chunk(client, session_id, b"", seq=2, flush="true")
    assert last.status_code == 200 and "x-replayed" not in last.headers, last.text
    latents, meta = read_latents(last.content)
    assert (meta["frame_start"], meta["frame_end"], meta["seq"]) == ("7", "8", "2")
    assert torch.equal(latents, expected[:, :, 7:8])


def test_a_used_seq_with_another_body_or_flush_is_409_and_changes_nothing(client, expected):
    """A repeat of the last seq is a retry only when it is the same request: the same body bytes and flush. It used to
    be answered with the stored response whatever it held, so seq=0&flush=true did not flush and a client that
    reused a seq for new frames lost them without a word."""
    session_id = started_session(client)  # seq 0: frames 0..4 with the prompt, flush=false
    before = session_state(client, session_id)
    cases = [
        ({"seq": 0, "flush": "true"}, payload(LATENTS[:, :, :5], EMBEDS, MASK), ["flush=true where it had flush=false"]),
        ({"seq": 0}, payload(LATENTS[:, :, 5:8]), ["a body of", "bytes where it had"]),
        ({"seq": 0}, payload(LATENTS[:, :, :5] + 1, EMBEDS, MASK), ["other body bytes (the same length"]),
        ({"seq": 0, "flush": "true"}, b"", ["flush=true where it had flush=false", "a body of 0 bytes"]),
    ]
    for params, body, differences in cases:
        error = assert_error(post_chunk(client, session_id, body, **params), 409, "seq_conflict")
        message = error["error"]["message"]
        assert "seq=0 was accepted already for another request" in message, message
        assert all(words in message for words in differences), message
        assert "use seq=1" in message and "same body bytes with the same flush" in message, message
        assert session_state(client, session_id) == before, params
    again = post_chunk(client, session_id, payload(LATENTS[:, :, :5], EMBEDS, MASK), seq=0)
    assert again.status_code == 200 and again.headers["x-replayed"] == "true", "the same request is still a retry"
    # The flushing chunk: its retry is replayed, the same body without flush is not its retry.
    last = post_chunk(client, session_id, payload(LATENTS[:, :, 5:8]), seq=1, flush="true")
    assert last.status_code == 200, last.text
    assert torch.equal(read_latents(last.content)[0], expected[:, :, 4:8]), "the refused requests changed nothing"
    retry = post_chunk(client, session_id, payload(LATENTS[:, :, 5:8]), seq=1, flush="true")
    assert retry.headers["x-replayed"] == "true" and retry.content == last.content
    error = assert_error(post_chunk(client, session_id, payload(LATENTS[:, :, 5:8]), seq=1), 409, "seq_conflict")
    assert "flush=false where it had flush=true" in error["error"]["message"]


def test_chunk_after_flush_is_409(client, expected):
    session_id = started_session(client)
    finish = post_chunk(client, session_id, payload(LATENTS[:, :, 5:8]), seq=1, flush="true")
    assert finish.status_code == 200
    before = session_state(client, session_id)
    assert_error(post_chunk(client, session_id, payload(LATENTS[:, :, 5:6]), seq=2), 409, "stream_closed")
    assert session_state(client, session_id) == before
    again = post_chunk(client, session_id, payload(LATENTS[:, :, 5:8]), seq=1, flush="true")
    assert again.content == finish.content, "the flushing chunk is a safe retry too"


def test_unknown_session_is_404(client):
    assert_error(client.get("/v1/sessions/nope"), 404, "session_not_found")
    assert_error(client.delete("/v1/sessions/nope"), 404, "session_not_found")
    assert_error(post_chunk(client, "nope", payload(LATENTS[:, :, :1], EMBEDS)), 404, "session_not_found")
    with pytest.raises(WebSocketDenialResponse) as denied:
        with client.websocket_connect("/v1/sessions/nope/stream"):
            pass
    assert denied.value.status_code == 404
    assert denied.value.json()["error"]["code"] == "session_not_found"


def test_deleted_session_is_404(client):
    session_id = started_session(client)
    assert client.delete(f"/v1/sessions/{session_id}").status_code == 204
    assert_error(client.get(f"/v1/sessions/{session_id}"), 404, "session_not_found")


def test_routes_and_methods_that_do_not_exist_use_the_envelope(client):
    assert_error(client.get("/v2/nothing"), 404, "not_found")
    assert_error(client.put("/v1/sessions"), 405, "method_not_allowed")


def test_allow_names_every_method_of_a_path_and_head_answers_like_get(client):
    """Several routes share a path (GET and POST /v1/sessions): a 405 and OPTIONS name all of their methods, not the
    first route's; HEAD answers like GET wherever GET is, without a body."""
    refused = client.put("/v1/sessions")
    assert refused.headers["allow"] == "GET, HEAD, OPTIONS, POST" and "allowed: GET, HEAD, OPTIONS, POST" in refused.text
    options = client.options("/v1/sessions")
    assert options.status_code == 204 and options.headers["allow"] == "GET, HEAD, OPTIONS, POST"
    assert client.options("/v1/sessions/abcdefgh").headers["allow"] == "DELETE, GET, HEAD, OPTIONS, PUT"
    for path in ("/health", "/ready"):
        head = client.head(path)
        assert head.status_code == 200 and head.content == b"" and head.headers["content-type"] == "application/json"
    # Every GET route answers HEAD as Allow says: the GET's status and headers, no body.
    session_id = new_session(client)
    for path in (f"/v1/sessions/{session_id}", "/v1/sessions", "/v1/info", "/metrics", "/v1/sessions/nosuchone"):
        head, get = client.head(path), client.get(path)
        assert head.status_code == get.status_code and head.content == b"", (path, head.status_code)
        assert head.headers["content-type"] == get.headers["content-type"], path
    assert client.head("/v1/sessions?limit=1&limit=2").status_code == 422  # the query rule, as for GET
    metrics = client.get("/metrics").text  # labelled by the route it was answered by, as GET is
    assert 'method="HEAD",route="/v1/info",status="200"' in metrics
    assert 'method="HEAD",route="unmatched"' not in metrics
    refused = client.head("/v1/refine")  # POST only: no GET to answer like
    assert refused.status_code == 405 and refused.headers["allow"] == "OPTIONS, POST"


@pytest.mark.parametrize(
    "body,headers,status,code",
    [
        ({"kv_max_frames": 3}, None, 422, "invalid_config"),
        ({"sigmas": [0.5, 0.7, 0.0]}, None, 422, "invalid_config"),
        ({"block_size": 0}, None, 422, "invalid_config"),
        ({"seed": -1}, None, 422, "invalid_config"),
        ({"seed": "seven"}, None, 422, "invalid_config"),
        ({"positions": "relative"}, None, 422, "invalid_config"),
        ({"blocksize": 3}, None, 422, "invalid_config"),
        ([1, 2], None, 422, "invalid_config"),
        (b"{not json", {"content-type": "application/json"}, 400, "invalid_payload"),
        (b'{"seed": 1}', {"content-type": "text/plain"}, 415, "unsupported_media_type"),
    ],
)
def test_invalid_session_config_creates_nothing(client, body, headers, status, code):
    count = len(client.app.state.services.registry)
    if isinstance(body, bytes):
        response = client.post("/v1/sessions", content=body, headers=headers)
    else:
        response = client.post("/v1/sessions", json=body)
    assert_error(response, status, code)
    assert len(client.app.state.services.registry) == count


@pytest.mark.parametrize("value", ["high", 200, True])
def test_a_value_no_branch_of_a_field_takes_is_one_line_saying_what_the_field_means(client, value):
    """video_quality is "auto" or an integer whose range depends on the format: a value that is neither is one
    problem, quoting it and what the field takes per format (it was a line per pydantic union branch, in pydantic's
    words, and said [0, 100] though jpeg takes 1-100 and h264 0-51)."""
    message = assert_error(client.post("/v1/sessions", json={"video_quality": value}), 422,
                           "invalid_config")["error"]["message"]
    problems = message.split("; the fields are")[0]
    assert problems.count("video_quality") == 1, message
    assert f"video_quality: got {value!r}" in problems and "literal" not in problems, message
    assert "jpeg: quality 1-100" in problems and "h264: CRF 0-51" in problems, message


def test_one_shot_errors(client):
    clip = payload(LATENTS, EMBEDS, MASK)
    assert_error(client.post("/v1/refine", content=payload(LATENTS[:, :, :1], EMBEDS), headers=OCTET), 422,
                 "invalid_input")
    assert_error(client.post("/v1/refine", params={"sink_frames": 8}, content=clip, headers=OCTET), 422,
                 "invalid_input")
    assert_error(client.post("/v1/refine", content=payload(LATENTS), headers=OCTET), 400, "missing_input")
    assert_error(client.post("/v1/refine", params={"kv_max_frames": 2}, content=clip, headers=OCTET), 422,
                 "invalid_config")
    assert_error(client.post("/v1/refine", params={"positions": "x"}, content=clip, headers=OCTET), 422,
                 "invalid_request")
    assert_error(client.post("/v1/refine", content=garbage(), headers=OCTET), 400, "invalid_payload")
    assert_error(client.post("/v1/refine", content=clip, headers={"content-type": "text/csv"}), 415,
                 "unsupported_media_type")
    # A clip over max_body_bytes is told the way a long clip goes (a session's chunks), not a chunk's advice.
    message = assert_error(client.post("/v1/refine", content=payload(torch.randn(1, 128, 8, 8, 8), EMBEDS),
                                       headers=OCTET), 413, "payload_too_large")["error"]["message"]
    assert "(max_body_bytes)" in message and "POST /v1/sessions" in message, message
    assert "frames per chunk" not in message, message


# --- the WebSocket: an error event, the stream goes on -------------------------------------------------------
def receive_until_event(ws):
    units = []
    while True:
        message = ws.receive()
        assert message["type"] == "websocket.send", message
        if message.get("bytes") is not None:
            units.append(read_latents(message["bytes"]))
        else:
            return units, json.loads(message["text"])


@pytest.mark.parametrize(
    "message,code",
    [
        (garbage(), "invalid_payload"),
        (payload(LATENTS[:, :, 5:6].double()), "invalid_input"),
        (payload(torch.randn(1, 128, 1, 5, 4)), "invalid_input"),
        (payload(embeds=EMBEDS), "missing_input"),
        (payload(torch.randn(1, 128, 9, 4, 4)), "too_many_frames"),
        ('{"type": "rewind"}', "invalid_payload"),
        ('{"type": "flush", "seed": 3}', "invalid_payload"),  # a key the flush would ignore: refused, not flushed
        ("not json", "invalid_payload"),
        ("[" * 5000, "invalid_payload"),  # nests past json's recursion limit: it killed the reader, unsaid
    ],
)
@pytest.mark.timeout(120)  # a reader that dies unsaid leaves the receive waiting for ever: fail instead
def test_bad_websocket_message_is_an_event_and_the_stream_continues(client, expected, message, code):
    session_id = started_session(client)
    before = session_state(client, session_id)
    with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
        if isinstance(message, bytes):
            ws.send_bytes(message)
        else:
            ws.send_text(message)
        units, event = receive_until_event(ws)
        assert units == []
        assert event["type"] == "error" and event["error"]["code"] == code
        state = session_state(client, session_id)
        state.pop("streaming")
        assert state == {k: v for k, v in before.items() if k != "streaming"}
        ws.send_bytes(payload(LATENTS[:, :, 5:8]))
        ws.send_text(json.dumps({"type": "flush"}))
        units, event = receive_until_event(ws)
        assert event == {"type": "done", "frames": 8}
        assert ws.receive()["code"] == 1000
    assert torch.equal(torch.cat([u for u, _ in units], dim=2), expected[:, :, 4:8])


def test_websocket_message_over_the_limit_closes_1009(client):
    session_id = started_session(client)
    before = session_state(client, session_id)
    with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
        ws.send_bytes(payload(torch.randn(1, 128, 8, 8, 8)))
        _, event = receive_until_event(ws)
        assert event["error"]["code"] == "payload_too_large"
        closing = ws.receive()
        assert closing["type"] == "websocket.close" and closing["code"] == 1009
    after = session_state(client, session_id)
    assert after == before


# --- rows that need their own server settings -----------------------------------------------------------------
def test_evicted_session_is_410(make_settings):
    with running_app(make_settings(session_idle_timeout_s=0.05)) as client:
        session_id = new_session(client)
        registry = client.app.state.services.registry
        # Polled without requests: every request on the session counts as activity.
        wait_until(lambda: len(registry) == 0, "the idle session to be evicted")
        assert_error(client.get(f"/v1/sessions/{session_id}"), 410, "session_evicted")
        assert_error(post_chunk(client, session_id, payload(LATENTS[:, :, :1], EMBEDS)), 410, "session_evicted")
        with pytest.raises(WebSocketDenialResponse) as denied:
            with client.websocket_connect(f"/v1/sessions/{session_id}/stream"):
                pass
        assert denied.value.status_code == 410
        # A PUT is a creation: its 410 says to take another id (this one stays taken while it is remembered).
        put = assert_error(client.put(f"/v1/sessions/{session_id}", json={}), 410, "session_evicted")
        assert "under another id" in put["error"]["message"]
        assert "evicted_ids_remembered" in put["error"]["message"]
        other = client.put(f"/v1/sessions/{session_id}-2", json={})
        assert other.status_code == 201, other.text


def test_too_many_sessions_is_503_with_a_retry_after_that_tells_the_truth(make_settings):
    """Retry-After is when the first idle session will be released (idle timeout, finished-session TTL), not a
    fixed guess; with every session in use there is no such time, and the message says so."""
    with running_app(make_settings(max_sessions=2, retry_after_s=3, session_idle_timeout_s=120,
                                   flushed_session_ttl_s=30)) as client:
        first = new_session(client)
        new_session(client)
        response = client.post("/v1/sessions")
        assert_error(response, 503, "too_many_sessions")
        assert 118 <= int(response.headers["retry-after"]) <= 120
        assert "released in" in response.json()["error"]["message"]
        latents, embeds, mask = make_clip(frames=4)
        flushed = client.post(f"/v1/sessions/{first}/chunks?flush=true", content=payload(latents, embeds, mask),
                              headers=OCTET)
        assert flushed.status_code == 200
        response = client.post("/v1/sessions")
        assert 28 <= int(response.headers["retry-after"]) <= 30, "a finished session goes after its TTL"
        registry = client.app.state.services.registry
        for handle in registry.handles():
            handle.requests_in_flight += 1  # every session in use
        try:
            response = client.post("/v1/sessions")
            assert response.headers["retry-after"] == "3" and "in use" in response.json()["error"]["message"]
        finally:
            for handle in registry.handles():
                handle.requests_in_flight -= 1
        assert client.delete(f"/v1/sessions/{first}").status_code == 204
        new_session(client)


def test_full_engine_queue_is_503_and_the_queued_chunk_still_completes(make_settings, refiner):
    with running_app(make_settings(engine_queue_depth=1)) as client:
        services = client.app.state.services
        hold = EngineHold()
        blocker = client.portal.start_task_soon(services.engine.call, hold)
        hold.wait_started()
        a, b = new_session(client), new_session(client)
        result = {}
        waiting = threading.Thread(
            target=lambda: result.update(a=post_chunk(client, a, payload(LATENTS[:, :, :5], EMBEDS, MASK)))
        )
        waiting.start()
        wait_until(lambda: services.engine.outstanding == 1, "the first chunk to be queued")
        before = session_state(client, b)
        assert_error(post_chunk(client, b, payload(LATENTS[:, :, :5], EMBEDS, MASK), seq=0), 503, "engine_busy")
        assert session_state(client, b) == before
        hold.release.set()
        blocker.result(30)
        waiting.join(30)
        assert result["a"].status_code == 200
        assert post_chunk(client, b, payload(LATENTS[:, :, :5], EMBEDS, MASK), seq=0).status_code == 200


def test_not_ready_until_warm_up_is_503(make_settings):
    release = threading.Event()
    settings = make_settings()
    from fastapi.testclient import TestClient

    from app.api.factory import create_app

    with TestClient(create_app(settings, warmup_gate=lambda: release.wait(30))) as client:
        try:
            body = assert_error(client.get("/ready"), 503, "not_ready")
            assert "warming up" in body["error"]["message"]
            assert_error(client.post("/v1/sessions"), 503, "not_ready")
            assert_error(client.post("/v1/refine", content=payload(LATENTS, EMBEDS), headers=OCTET), 503, "not_ready")
            assert client.get("/health").json() == {"status": "ok"}
        finally:
            release.set()
        wait_until(lambda: client.get("/ready").status_code == 200, "/ready after warm-up")
        ready = client.get("/ready").json()
        assert ready["status"] == "ready" and 0 <= ready["ready_for_s"] < DEADLINE_S, ready
        new_session(client)


@pytest.mark.parametrize("warmup", [False, True])
def test_a_warm_up_that_ends_during_a_drain_leaves_the_server_draining(make_settings, caplog, warmup):
    """A drain that starts while the warm-up still runs (a SIGTERM during a long compile on a GPU) wins: when the
    warm-up ends afterwards, the server does not report ready again. With ``warmup: false`` what is left of the
    warm-up after the gate needs no engine work; with ``warmup: true`` the drain refuses the warm-up's work, which is
    a shutdown, not a failure: no "warm-up failed" traceback in the log."""
    from fastapi.testclient import TestClient

    from app.api.factory import create_app

    release = threading.Event()
    settings = make_settings(drain_timeout_s=5, warmup=warmup)
    with TestClient(create_app(settings, warmup_gate=lambda: release.wait(30))) as client:
        services = client.app.state.services
        drain = threading.Thread(target=lambda: client.portal.call(services.drain), daemon=True)
        try:
            drain.start()
            wait_until(lambda: services.draining, "the drain to start")
        finally:
            release.set()
        drain.join(30)
        warm_up = next(task for task in services._tasks if task.get_name() == "warm-up")
        wait_until(warm_up.done, "the warm-up to end")
        assert_error(client.get("/ready"), 503, "draining")
        assert_error(client.post("/v1/sessions"), 503, "draining")
        assert not [record for record in caplog.records if "warm-up failed" in record.getMessage()]


def test_draining_is_503(make_settings):
    with running_app(make_settings()) as client:
        session_id = started_session(client)
        client.portal.call(client.app.state.services.drain)
        assert_error(client.get("/ready"), 503, "draining")
        assert_error(client.post("/v1/sessions"), 503, "draining")
        assert_error(post_chunk(client, session_id, payload(LATENTS[:, :, 5:6]), seq=1), 503, "draining")


@pytest.mark.parametrize("method,path,query", [
    ("POST", "/v1/refine", "seed=1&seed=2"),
    ("POST", "/v1/refine", "outputs=latents&outputs=latents"),
    ("POST", "/v1/refine", "sead=1"),
    ("POST", "/v1/sessions/{id}/chunks", "seq=0&seq=1"),
    ("POST", "/v1/sessions/{id}/chunks", "flush=true&flush=false"),
    ("GET", "/v1/sessions", "limit=1&limit=2"),
    ("POST", "/v1/sessions", "seed=7"),
])
def test_unknown_or_repeated_query_parameters_are_refused_and_change_nothing(client, method, path, query):
    """A route takes only the query parameters it documents, each at most once (the framework would keep one of two
    values without a word): 422 invalid_request naming the parameter, and nothing happens. /openapi.json says so."""
    session_id = client.post("/v1/sessions", json={}).json()["session_id"]
    tensors = "refine" in path or "chunks" in path
    body = payload(*make_clip(frames=5)) if tensors else None
    reply = client.request(method, path.replace("{id}", session_id) + "?" + query, content=body,
                           headers=OCTET if tensors else {})
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_request" and query.split("=")[0] in error["message"]
    assert client.get(f"/v1/sessions/{session_id}").json()["frames_received"] == 0
    assert "refused with 422" in client.get("/openapi.json").json()["info"]["description"]


def test_every_route_refuses_an_unknown_query_parameter_before_it_runs(make_settings):
    """The rule holds on every route the app serves, probes, WebSockets and the drain included (the last would
    drain the server if it ran): found from the app's own route table, so a route added later is covered without
    a list to keep. The view page's query is its script's (app.api.factory.BROWSER_PAGES), and is let through."""
    from fastapi.routing import iter_route_contexts

    from app.api.factory import BROWSER_PAGES

    with running_app(make_settings()) as client:
        session_id = client.post("/v1/sessions", json={}).json()["session_id"]
        checked = []
        for route in iter_route_contexts(client.app.routes):
            if getattr(route.original_route, "dependant", None) is None or route.path in BROWSER_PAGES:
                continue  # FastAPI's own /docs, /redoc, /openapi.json; the view page
            url = route.path.replace("{session_id}", session_id) + "?bogus=1"
            if route.methods is None:  # a WebSocket: refused at the handshake, with the same envelope
                with pytest.raises(WebSocketDenialResponse) as refused:
                    with client.websocket_connect(url):
                        pass
                status, body = refused.value.status_code, json.loads(refused.value.content)
            else:
                (method,) = route.methods
                reply = client.request(method, url)
                status, body = reply.status_code, (reply.json() if method != "HEAD" else None)
            assert status == 422, (route.path, route.methods, body)
            if body is not None:
                assert body["error"]["code"] == "invalid_request" and "bogus" in body["error"]["message"], body
            checked.append(route.path)
        # The probes and the WebSockets that ignored a stray parameter before are among them.
        assert {"/health", "/ready", "/metrics", "/v1/sessions/{session_id}/stream",
                "/v1/sessions/{session_id}/watch", "/v1/admin/drain"} <= set(checked)
        assert client.get("/ready").status_code == 200  # the drain did not run
        assert client.get(f"/v1/sessions/{session_id}").status_code == 200  # nor the DELETE
        # Declared parameters still pass, repeats do not; the view page's own query is let through.
        assert client.get("/health").status_code == 200
        assert_error(client.get(f"/v1/sessions/{session_id}?x=1&x=2"), 422, "invalid_request")
        with client.websocket_connect(f"/v1/sessions/{session_id}/watch?outputs=latents"):
            pass
        with pytest.raises(WebSocketDenialResponse) as repeated:
            with client.websocket_connect(f"/v1/sessions/{session_id}/watch?outputs=latents&outputs=latents"):
                pass
        assert repeated.value.status_code == 422
        assert client.get(f"/view?session={session_id}&format=h264").status_code == 200
