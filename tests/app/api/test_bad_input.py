"""The bad-input matrix, beyond the rows test_errors.py already covers: each bad request gets its documented
status and changes nothing, neither its own session nor another live one (compared through GET
/v1/sessions/{id}), and the next good chunk of each still returns exactly the bytes of an untroubled run. Over
HTTP and, where a payload can travel there, over the WebSocket; and for oversized input, on a real uvicorn, that
the refusal comes before the body is read.
"""

from __future__ import annotations

import json
import re
import socket
import struct

import httpx
import pytest
import torch
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from app.core.codec import MAX_HEADER_BYTES
from app.core.settings import Settings

from tests.faults import failing_forwards

from tests.app.conftest import (
    DEADLINE_S,
    OCTET,
    LiveServer,
    expected_clip,
    payload,
    read_latents,
    wait_until,
)
from tests.app.api.test_errors import (  # noqa: F401 (client: the same module-scoped app with the same limits)
    CHUNK_CASES,
    client,
    EMBEDS,
    LATENTS,
    MASK,
    assert_error,
    finish_and_check,
    new_session,
    post_chunk,
    receive_until_event,
    started_session,
)

# What a rejected request must leave exactly as it was. Connection bookkeeping (whether a stream is attached)
# is left out: opening a WebSocket to send the bad message is itself a change, and not one the request made.
STABLE_FIELDS = (
    "config",
    "frames_received",
    "frames_returned",
    "pending_frames",
    "history_frames",
    "blocks_refined",
    "flushed",
    "next_seq",
    "kv_cache_bytes",
    "pending_bytes",
)


@pytest.fixture(autouse=True)
def _no_sessions_left(request):
    """Each test ends every session it made, also when it fails, so one failure cannot fill the server for the
    next tests (max_sessions)."""
    yield
    if "client" in request.fixturenames:
        client = request.getfixturevalue("client")
        for handle in client.app.state.services.registry.handles():
            client.delete(f"/v1/sessions/{handle.id}")


@pytest.fixture(scope="module")
def expected(refiner):
    return expected_clip(refiner, LATENTS, EMBEDS, MASK)


def stable_state(client, session_id: str) -> dict:
    response = client.get(f"/v1/sessions/{session_id}")
    assert response.status_code == 200, response.text
    state = response.json()
    return {name: state[name] for name in STABLE_FIELDS}


class Sessions:
    """The session a bad request targets and a bystander, both mid-stream (frames 0..4 sent, 0..3 returned)."""

    def __init__(self, client):
        self.client = client
        self.target = started_session(client)
        self.bystander = started_session(client)
        self.count = len(client.app.state.services.registry)
        self.before = {sid: stable_state(client, sid) for sid in (self.target, self.bystander)}

    def assert_unchanged(self) -> None:
        assert len(self.client.app.state.services.registry) == self.count, "a rejected request created a session"
        for session_id, before in self.before.items():
            assert stable_state(self.client, session_id) == before, session_id

    def finish(self, expected) -> None:
        """Both streams complete with exactly the bytes of an untroubled run."""
        for session_id in (self.target, self.bystander):
            finish_and_check(self.client, session_id, expected)


# --- payloads ------------------------------------------------------------------------------------------------
ONE = LATENTS[:, :, 5:6].contiguous()  # one good frame, the session's geometry (1, 128, 1, 4, 4)


def poisoned(tensor: torch.Tensor, value: float, at: int = 3) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[at] = value
    return tensor


def header_lies_about_its_size() -> bytes:
    good = payload(ONE)
    return struct.pack("<Q", 2**63) + good[8:]


def header_not_json() -> bytes:
    junk = b"{not json at all}"
    return struct.pack("<Q", len(junk)) + junk


def offsets_past_the_end() -> bytes:
    header = json.dumps({"latents": {"dtype": "F32", "shape": [1, 128, 1, 4, 4], "data_offsets": [0, 8192]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 64


def offsets_disagree_with_the_shape() -> bytes:
    header = json.dumps({"latents": {"dtype": "F32", "shape": [1, 128, 1, 4, 4], "data_offsets": [0, 16]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 16


def header_of(size: int, latents: torch.Tensor) -> bytes:
    """``latents`` as safetensors bytes whose header is exactly ``size`` bytes (padded with spaces, which the format
    allows), the rest of it string metadata."""
    data = latents.contiguous().numpy().tobytes()
    entry = {"latents": {"dtype": "F32", "shape": list(latents.shape), "data_offsets": [0, len(data)]}}
    header = json.dumps({"__metadata__": {"note": "x" * max(0, size - 200)}, **entry}).encode()
    assert len(header) <= size
    return struct.pack("<Q", size) + header + b" " * (size - len(header)) + data


def latents_named_twice() -> bytes:
    """'latents' twice over the same 8192 bytes: one frame of float32 or two of float16, whichever entry a reader
    keeps (safetensors' parser kept one without a word)."""
    entry = '{"dtype": "%s", "shape": [1, 128, %d, 4, 4], "data_offsets": [0, 8192]}'
    header = ('{"latents": %s, "latents": %s}' % (entry % ("F32", 1), entry % ("F16", 2))).encode()
    return struct.pack("<Q", len(header)) + header + ONE.numpy().tobytes()


# (id, body, status, code): payload rows test_errors.CHUNK_CASES does not have. Every one is also sent over
# the WebSocket, where it must produce the same error code as an event.
PAYLOAD_CASES = [
    # Not a safetensors file, in ways a parser could trip over.
    ("eight-bytes-only", b"\x10\0\0\0\0\0\0\0", 400, "invalid_payload"),
    ("header-size-lies", header_lies_about_its_size(), 400, "invalid_payload"),
    ("header-not-json", header_not_json(), 400, "invalid_payload"),
    ("offsets-past-the-end", offsets_past_the_end(), 400, "invalid_payload"),
    ("offsets-disagree-with-shape", offsets_disagree_with_the_shape(), 400, "invalid_payload"),
    # A good chunk but for a header over the 64 KiB the server reads (safetensors' parser would take one of up to
    # 100 MB, for seconds on the event loop).
    ("header-over-the-limit", header_of(MAX_HEADER_BYTES + 1, ONE), 400, "invalid_payload"),
    ("random-bytes", torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
     .numpy().tobytes(), 400, "invalid_payload"),
    # Names.
    ("name-case", payload(Latents=ONE), 400, "invalid_payload"),
    ("name-twice", latents_named_twice(), 400, "invalid_payload"),
    ("only-unknown-names", payload(frames=ONE, text=EMBEDS.contiguous()), 400, "invalid_payload"),
    ("mask-misspelt", payload(ONE, EMBEDS, prompt_mask=MASK.contiguous()), 400, "invalid_payload"),
    # Ranks.
    ("latents-rank-0", payload(torch.tensor(1.0)), 422, "invalid_input"),
    ("latents-rank-1", payload(ONE.reshape(-1)), 422, "invalid_input"),
    ("latents-rank-6", payload(ONE.unsqueeze(0)), 422, "invalid_input"),
    ("prompt-rank-2", payload(ONE, EMBEDS[0]), 422, "invalid_input"),
    ("prompt-rank-4", payload(ONE, EMBEDS.unsqueeze(0)), 422, "invalid_input"),
    ("mask-rank-1", payload(ONE, EMBEDS, MASK[0]), 422, "invalid_input"),
    ("mask-rank-3", payload(ONE, EMBEDS, MASK.unsqueeze(0)), 422, "invalid_input"),
    # Dtypes.
    ("latents-bool", payload(ONE > 0), 422, "invalid_input"),
    ("latents-int8", payload(ONE.to(torch.int8)), 422, "invalid_input"),
    ("latents-uint8", payload(ONE.to(torch.uint8)), 422, "invalid_input"),
    ("latents-int64", payload(ONE.to(torch.int64)), 422, "invalid_input"),
    ("prompt-float64", payload(ONE, EMBEDS.double()), 422, "invalid_input"),
    ("prompt-int64", payload(ONE, EMBEDS.to(torch.int64)), 422, "invalid_input"),
    ("prompt-bool", payload(ONE, EMBEDS > 0), 422, "invalid_input"),
    ("mask-float64", payload(ONE, EMBEDS, MASK.double()), 422, "invalid_input"),
    # Shapes against the model and the session.
    ("channels-1", payload(ONE[:, :1]), 422, "invalid_input"),
    ("channels-129", payload(torch.randn(1, 129, 1, 4, 4)), 422, "invalid_input"),
    ("height-differs", payload(torch.randn(1, 128, 1, 5, 4)), 422, "invalid_input"),
    ("height-and-width-differ", payload(torch.randn(1, 128, 1, 2, 2)), 422, "invalid_input"),
    ("height-zero", payload(torch.randn(1, 128, 1, 0, 4)), 422, "invalid_input"),
    ("batch-zero", payload(torch.randn(0, 128, 1, 4, 4)), 422, "invalid_input"),
    ("prompt-batch-differs", payload(ONE, torch.randn(2, 4, 32)), 422, "invalid_input"),
    ("prompt-no-tokens", payload(ONE, torch.randn(1, 0, 32)), 422, "invalid_input"),
    ("mask-length-differs", payload(ONE, EMBEDS, MASK[:, :-1]), 422, "invalid_input"),
    # Values.
    ("latents-minus-inf", payload(poisoned(ONE, float("-inf"))), 422, "invalid_input"),
    ("latents-nan-float16", payload(poisoned(ONE, float("nan")).half()), 422, "invalid_input"),
    ("latents-inf-bfloat16", payload(poisoned(ONE, float("inf")).bfloat16()), 422, "invalid_input"),
    ("prompt-inf", payload(ONE, poisoned(EMBEDS, float("inf"))), 422, "invalid_input"),
    ("prompt-nan-float16", payload(ONE, poisoned(EMBEDS, float("nan")).half()), 422, "invalid_input"),
    ("mask-nan", payload(ONE, EMBEDS, poisoned(MASK.float(), float("nan"), at=0)), 422, "invalid_input"),
    # Limits (max_frames_per_chunk=8, max_prompt_tokens=16 here).
    ("frames-far-over", payload(torch.randn(1, 128, 64, 1, 1)), 413, "too_many_frames"),
    ("prompt-far-over", payload(ONE, torch.randn(1, 1000, 32)), 413, "prompt_too_long"),
    # A chunk of zero frames with a bad prompt is still checked.
    ("zero-frames-bad-prompt", payload(LATENTS[:, :, :0], EMBEDS.double()), 422, "invalid_input"),
]
PAYLOAD_IDS = [case[0] for case in PAYLOAD_CASES]
PAYLOAD_ROWS = [case[1:] for case in PAYLOAD_CASES]


@pytest.mark.parametrize("body,status,code", PAYLOAD_ROWS, ids=PAYLOAD_IDS)
def test_bad_chunk_over_http_changes_no_session(client, expected, body, status, code):
    sessions = Sessions(client)
    assert_error(post_chunk(client, sessions.target, body, seq=1), status, code)
    sessions.assert_unchanged()
    sessions.finish(expected)


def test_a_header_over_the_limit_is_refused_naming_it_and_one_at_the_limit_is_taken(client, expected):
    """A request's safetensors header is read up to MAX_HEADER_BYTES: the server never hands a larger one (a
    metadata bomb, thousands of zero-size tensors) to the parser, which takes seconds on tens of MB, on the event
    loop. The refusal says the size, the limit and what to send; a header of exactly the limit is a chunk."""
    sessions = Sessions(client)
    error = assert_error(post_chunk(client, sessions.target, header_of(MAX_HEADER_BYTES + 1, ONE), seq=1),
                         400, "invalid_payload")
    message = error["error"]["message"]
    assert f"declares {MAX_HEADER_BYTES + 1} bytes" in message, message
    assert f"more than the {MAX_HEADER_BYTES}" in message, message
    assert "safetensors.torch.save" in message, message
    sessions.assert_unchanged()
    response = post_chunk(client, sessions.target, header_of(MAX_HEADER_BYTES, ONE), seq=1)
    assert response.status_code == 200, response.text
    assert stable_state(client, sessions.target)["frames_received"] == sessions.before[sessions.target][
        "frames_received"] + 1


def test_a_compressed_body_is_415_naming_the_encoding_on_every_body_route(client, expected):
    """A gzipped chunk used to get 400 "not a safetensors file (header too large)" and a gzipped config 400 "not
    JSON", which send a client looking at its tensors; now each says the encoding is the problem, with
    Accept-Encoding: identity (RFC 9110, 15.5.16), and changes nothing. identity is the body as sent: taken."""
    import gzip

    sessions = Sessions(client)
    chunk = payload(LATENTS[:, :, 5:8])
    gzipped = {**OCTET, "content-encoding": "gzip"}
    answers = {
        "chunk": post_chunk(client, sessions.target, gzip.compress(chunk), headers=gzipped, seq=1),
        "refine": client.post("/v1/refine", content=gzip.compress(payload(LATENTS, EMBEDS, MASK)), headers=gzipped),
        "config": client.post("/v1/sessions", content=gzip.compress(b'{"seed": 7}'),
                              headers={"content-type": "application/json", "content-encoding": "gzip"}),
    }
    for route, response in answers.items():
        message = assert_error(response, 415, "unsupported_media_type")["error"]["message"]
        assert "Content-Encoding 'gzip'" in message and "uncompressed" in message, (route, message)
        assert response.headers["accept-encoding"] == "identity", route
    sessions.assert_unchanged()
    response = post_chunk(client, sessions.target, chunk, headers={**OCTET, "content-encoding": "identity"}, seq=1)
    assert response.status_code == 200, response.text
    assert stable_state(client, sessions.target)["next_seq"] == sessions.before[sessions.target]["next_seq"] + 1


def test_a_flush_before_any_frame_ends_the_session_with_an_empty_answer(client):
    """The documented answer (api.md, "To flush without new frames"): a session that never got a frame has no batch
    or frame size, so its empty flush answers latents (1, C, 0, 1, 1) with frame_start = frame_end = 0 and ends the
    session (a later chunk is 409 stream_closed); the WebSocket's flush says done with 0 frames and sends no unit."""
    session_id = new_session(client)
    response = post_chunk(client, session_id, b"", seq=0, flush="true")
    assert response.status_code == 200, response.text
    latents, metadata = read_latents(response.content)
    assert tuple(latents.shape) == (1, 128, 0, 1, 1)
    assert (metadata["frame_start"], metadata["frame_end"], metadata["seq"]) == ("0", "0", "0"), metadata
    state = client.get(f"/v1/sessions/{session_id}").json()
    assert state["flushed"] and state["frames_received"] == 0 and state["next_seq"] == 1, state
    assert_error(post_chunk(client, session_id, payload(ONE, EMBEDS)), 409, "stream_closed")
    session_id = new_session(client)
    with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
        ws.send_text(json.dumps({"type": "flush"}))
        units, event = receive_until_event(ws)
        assert units == [] and event == {"type": "done", "frames": 0}, (units, event)


SPELLINGS = [("true", True), ("True", True), ("1", True), ("yes", True), ("on", True), ("T", True), ("y", True),
             ("false", False), ("0", False), ("no", False), ("off", False), ("f", False), ("N", False)]


@pytest.mark.parametrize("spelling,flushes", SPELLINGS)
def test_flush_takes_the_documented_boolean_spellings(client, spelling, flushes):
    """Decided: the query's booleans take what pydantic's lax bool takes (api.md, query parameters), since curl
    users write 1 and Python's str(True) is "True"; every one means what it says, and anything else is 422."""
    session_id = new_session(client)
    response = post_chunk(client, session_id, payload(LATENTS[:, :, :2], EMBEDS, MASK), seq=0, flush=spelling)
    assert response.status_code == 200, response.text
    assert client.get(f"/v1/sessions/{session_id}").json()["flushed"] is flushes


# Headers and query parameters (the body itself is a good chunk).
REQUEST_CASES = [
    ("content-type-multipart", {"content-type": "multipart/form-data; boundary=x"}, {}, 415, "unsupported_media_type"),
    ("content-type-form", {"content-type": "application/x-www-form-urlencoded"}, {}, 415, "unsupported_media_type"),
    ("content-type-safetensors", {"content-type": "application/safetensors"}, {}, 415, "unsupported_media_type"),
    ("content-type-empty", {"content-type": ""}, {}, 415, "unsupported_media_type"),
    # Two Content-Type headers: the first used to win, whatever the second (a proxy may read the other one).
    ("content-type-twice", [("content-type", "application/octet-stream"), ("content-type", "application/json")], {},
     415, "unsupported_media_type"),
    # A declared Content-Encoding: the body used to be read as is (this one is not compressed at all, and was taken).
    ("content-encoding-gzip", {**OCTET, "content-encoding": "gzip"}, {}, 415, "unsupported_media_type"),
    ("content-encoding-br-after-identity", [*OCTET.items(), ("content-encoding", "identity"),
                                            ("content-encoding", "br")], {}, 415, "unsupported_media_type"),
    ("seq-not-a-number", OCTET, {"seq": "one"}, 422, "invalid_request"),
    ("seq-fraction", OCTET, {"seq": "1.5"}, 422, "invalid_request"),
    # Found by fuzzing: these used to pass as integers.
    ("seq-written-as-float", OCTET, {"seq": "1.0"}, 422, "invalid_request"),
    ("seq-signed-float", OCTET, {"seq": "+1.0"}, 422, "invalid_request"),
    ("seq-underscores", OCTET, {"seq": "0_1"}, 422, "invalid_request"),
    ("seq-huge", OCTET, {"seq": str(10**30)}, 409, "seq_conflict"),
    # seq 0 again with other frames and flush: not a retry of seq 0 (that would be the same body and flush), which
    # used to be answered with seq 0's stored response, the frames dropped and the flush not done.
    ("seq-behind-other-request", OCTET, {"seq": 0, "flush": "true"}, 409, "seq_conflict"),
    ("flush-number", OCTET, {"flush": "2"}, 422, "invalid_request"),
    # Found by fuzzing: unknown parameters used to be ignored, so a misspelt flush quietly did not flush.
    ("flush-misspelt", OCTET, {"flsuh": "true"}, 422, "invalid_request"),
    ("key-in-query", OCTET, {"api_key": "x"}, 422, "invalid_request"),
]


@pytest.mark.parametrize(
    "headers,params,status,code", [c[1:] for c in REQUEST_CASES], ids=[c[0] for c in REQUEST_CASES]
)
def test_bad_chunk_request_changes_no_session(client, expected, headers, params, status, code):
    sessions = Sessions(client)
    params = {"seq": 1, **params}
    response = post_chunk(client, sessions.target, payload(LATENTS[:, :, 5:8]), headers=headers, **params)
    if code is None:
        assert response.status_code == status and response.headers["x-replayed"] == "true", response.text
    else:
        assert_error(response, status, code)
    sessions.assert_unchanged()
    sessions.finish(expected)


def test_exactly_at_the_limits_is_accepted(client):
    """The limits are inclusive: the largest allowed chunk (8 frames) and prompt (16 tokens) go through; one
    past each is 413 (test_errors)."""
    session_id = new_session(client)
    body = payload(torch.randn(1, 128, 8, 4, 4), torch.randn(1, 16, 32))
    response = post_chunk(client, session_id, body, seq=0)
    assert response.status_code == 200, response.text
    assert read_latents(response.content)[0].shape[2] == 7  # the sink, then two blocks of 3; one frame waits


# --- session config ----------------------------------------------------------------------------------------
F = 1 << 20
CONFIG_CASES = [
    ({"seed": 2**63}, 422, "invalid_config"),
    ({"seed": 10**30}, 422, "invalid_config"),
    ({"seed": True}, 422, "invalid_config"),
    ({"seed": 7.0}, 422, "invalid_config"),
    ({"fps": 0}, 422, "invalid_config"),
    ({"fps": -16}, 422, "invalid_config"),
    ({"fps": 1000.5}, 422, "invalid_config"),
    ({"fps": "16"}, 422, "invalid_config"),
    ({"sink_frames": 0}, 422, "invalid_config"),
    ({"sink_frames": -1}, 422, "invalid_config"),
    ({"sink_frames": F + 1, "kv_max_frames": F}, 422, "invalid_config"),
    ({"block_size": -3}, 422, "invalid_config"),
    ({"block_size": 10**9}, 422, "invalid_config"),
    ({"kv_max_frames": -1}, 422, "invalid_config"),
    ({"kv_max_frames": 10**9}, 422, "invalid_config"),
    ({"sigmas": []}, 422, "invalid_config"),
    ({"sigmas": [0.0]}, 422, "invalid_config"),
    ({"sigmas": [1.5, 0.0]}, 422, "invalid_config"),
    ({"sigmas": [0.5, -0.1]}, 422, "invalid_config"),
    ({"sigmas": [0.9, 0.5]}, 422, "invalid_config"),
    ({"sigmas": ["0.9", "0.0"]}, 422, "invalid_config"),
    ({"sigmas": 0.5}, 422, "invalid_config"),
    ({"positions": None, "seed": {"nested": 1}}, 422, "invalid_config"),
    (b"null", 422, "invalid_config"),
    (b'"seed"', 422, "invalid_config"),
    (b"[" * 50_000, 400, "invalid_payload"),  # found by fuzzing: used to blow the parser's stack (500)
    (b'{"fps": NaN}', 400, "invalid_payload"),  # not JSON numbers, though Python's parser takes them
    (b'{"fps": Infinity}', 400, "invalid_payload"),
    (b'{"sigmas": [1.0, -Infinity, 0.0]}', 400, "invalid_payload"),
    (b'{"seed": 1, "seed": 2}', 422, "invalid_config"),  # was the last one, silently
    (b'{"seed": ' + b"9" * 5000 + b"}", 422, "invalid_config"),
    (b'{"\\ud800": 1}', 400, "invalid_payload"),
    (b"\xff\xfe\x00", 400, "invalid_payload"),
    (b'{"seed": 7}' + b" " * 70_000, 413, "payload_too_large"),  # over the 64 KiB a config body may take
]


def test_config_in_the_query_string_is_refused(client, expected):
    """POST /v1/sessions?seed=7 with no body used to create a session with the default seed."""
    sessions = Sessions(client)
    assert_error(client.post("/v1/sessions", params={"seed": 7}), 422, "invalid_request")
    sessions.assert_unchanged()
    sessions.finish(expected)


@pytest.mark.parametrize("body,status,code", CONFIG_CASES, ids=[str(c[0])[:40] for c in CONFIG_CASES])
def test_bad_session_config_changes_nothing(client, expected, body, status, code):
    sessions = Sessions(client)
    if isinstance(body, bytes):
        response = client.post("/v1/sessions", content=body, headers={"content-type": "application/json"})
    else:
        response = client.post("/v1/sessions", json=body)
    assert_error(response, status, code)
    sessions.assert_unchanged()
    sessions.finish(expected)


@pytest.mark.parametrize("body,said", [
    (b'{"fps": NaN}', "NaN is not a JSON number; send a finite number"),
    (b'{"seed": 1, "seed": 2}', "names 'seed' twice; send each field once"),
    (b'{"seed": ' + b"9" * 5000 + b"}", "thousands of digits; send each field's value within its range"),
    (b'{"\\ud800": 1}', "is not valid Unicode (a lone UTF-16 surrogate)"),
    (b'{"seed": 7}' + b" " * 70_000, "bytes for a session config; send only the fields you set"),
], ids=["nan", "key-twice", "5000-digits", "lone-surrogate", "over-64KiB"])
def test_a_bad_config_body_says_what_was_wrong_in_the_clients_terms(client, body, said):
    """What a hostile-client probe found said in the server's terms (its Python's sys.set_int_max_str_digits, the
    chunk limit's "send fewer frames") or not at all (a key twice, last one wins)."""
    response = client.post("/v1/sessions", content=body, headers={"content-type": "application/json"})
    message = response.json()["error"]["message"]
    assert said in message and "sys.set_int_max_str_digits" not in message and "frames" not in message, message


# --- one shot ------------------------------------------------------------------------------------------------
CLIP = payload(LATENTS, EMBEDS, MASK)
REFINE_QUERY_CASES = [
    {"seed": -1},
    {"seed": 2**63},
    {"fps": 0},
    {"fps": -1},
    {"fps": "inf"},
    {"fps": "nan"},
    {"fps": 1001},
    {"sink_frames": 0},
    {"sink_frames": -1},
    {"sink_frames": 10**9},
    {"block_size": 0},
    {"block_size": 10**9},
    {"kv_max_frames": 1},
    {"kv_max_frames": 10**9},
    {"kv_max_frames": 4, "sink_frames": 2, "block_size": 3},  # valid each, not together: the model's 422
    {"positions": "ABSOLUTE"},
    {"seed": "0x10"},
    {"seed": "7.0"},
    {"block_size": "+3.0"},
    {"sigmas": "0.5"},  # not a one-shot parameter: refused, not ignored
    {"sink_frame": 2},
]


@pytest.mark.parametrize("params", REFINE_QUERY_CASES, ids=str)
def test_bad_refine_query_is_422_and_changes_nothing(client, expected, params):
    sessions = Sessions(client)
    response = client.post("/v1/refine", params=params, content=CLIP, headers=OCTET)
    body = assert_error(response, 422, response.json()["error"]["code"])
    assert body["error"]["code"] in ("invalid_request", "invalid_config")
    sessions.assert_unchanged()
    sessions.finish(expected)


@pytest.mark.parametrize(
    "body,status,code",
    [
        (payload(poisoned(LATENTS, float("nan")), EMBEDS, MASK), 422, "invalid_input"),
        (payload(LATENTS, poisoned(EMBEDS, float("inf")), MASK), 422, "invalid_input"),
        (payload(LATENTS.double(), EMBEDS, MASK), 422, "invalid_input"),
        (payload(LATENTS[:, :64], EMBEDS, MASK), 422, "invalid_input"),
        (payload(LATENTS, torch.randn(1, 17, 32)), 413, "prompt_too_long"),
        (header_lies_about_its_size(), 400, "invalid_payload"),
    ],
    ids=["nan", "prompt-inf", "float64", "channels", "prompt-length", "header"],
)
def test_bad_clip_changes_no_session(client, expected, body, status, code):
    sessions = Sessions(client)
    assert_error(client.post("/v1/refine", content=body, headers=OCTET), status, code)
    sessions.assert_unchanged()
    sessions.finish(expected)


# --- the WebSocket ---------------------------------------------------------------------------------------------
# Every payload row above, and test_errors' rows that are about the payload alone (headers and query
# parameters do not exist on a WebSocket message) and that its own WebSocket test does not already send.
ALREADY_SENT_OVER_WS = {"not-safetensors", "dtype-float64", "no-latents", "too-many-frames", "body-too-large"}
WS_CASES = PAYLOAD_CASES + [
    (name, body, status, code)
    for name, body, headers, params, status, code in CHUNK_CASES
    if headers is OCTET and not params and name not in ALREADY_SENT_OVER_WS
]


@pytest.mark.parametrize("message,code", [(c[1], c[3]) for c in WS_CASES], ids=[c[0] for c in WS_CASES])
def test_bad_websocket_message_changes_no_session(client, expected, message, code):
    sessions = Sessions(client)
    with client.websocket_connect(f"/v1/sessions/{sessions.target}/stream") as ws:
        ws.send_bytes(message)
        units, event = receive_until_event(ws)
        assert units == [] and event["type"] == "error" and event["error"]["code"] == code, event
        sessions.assert_unchanged()
        # The same connection goes on: the rest of the clip, a flush, exactly the untroubled bytes.
        ws.send_bytes(payload(LATENTS[:, :, 5:8]))
        ws.send_text(json.dumps({"type": "flush"}))
        units, event = receive_until_event(ws)
        assert event == {"type": "done", "frames": 8}
        assert ws.receive()["code"] == 1000
    assert torch.equal(torch.cat([latents for latents, _ in units], dim=2), expected[:, :, 4:8])
    finish_and_check(client, sessions.bystander, expected)


def test_json_text_sent_as_bytes_is_told_where_it_belongs(client, expected):
    """A flush sent as a binary message (a client whose send() got bytes: json.dumps(...).encode(), a Uint8Array)
    used to be told "not a safetensors file (header too large)", its first 8 bytes read as a header length: a
    client then looks at its tensors. It is told to send it as text, and changes nothing; over HTTP, a JSON body
    sent as a chunk is told the same way what goes where."""
    sessions = Sessions(client)
    with client.websocket_connect(f"/v1/sessions/{sessions.target}/stream") as ws:
        ws.send_bytes(json.dumps({"type": "flush"}).encode())
        units, event = receive_until_event(ws)
        assert units == [] and event["error"]["code"] == "invalid_payload", event
        message = event["error"]["message"]
        assert "JSON text" in message and '{"type": "flush"} go in a text message' in message, message
        sessions.assert_unchanged()  # not flushed: the stream goes on
        ws.send_bytes(payload(LATENTS[:, :, 5:8]))
        ws.send_text(json.dumps({"type": "flush"}))
        units, event = receive_until_event(ws)
        assert event == {"type": "done", "frames": 8}
    assert torch.equal(torch.cat([latents for latents, _ in units], dim=2), expected[:, :, 4:8])
    error = assert_error(post_chunk(client, sessions.bystander, b'{"seed": 7}', seq=1), 400, "invalid_payload")
    assert "JSON text" in error["error"]["message"] and "POST /v1/sessions" in error["error"]["message"], error
    finish_and_check(client, sessions.bystander, expected)


def test_a_long_text_message_is_refused_unread(client, expected):
    """A stream's one text message is the flush: a text over MAX_COMMAND_CHARS is refused without being parsed
    (json.loads of a 50 MB object held the event loop for seconds). Even a flush padded past it: it used to be
    parsed and taken; now it is an event naming the size, the session unchanged, and the stream goes on."""
    from app.api.routes.stream import MAX_COMMAND_CHARS

    sessions = Sessions(client)
    padded = json.dumps({"type": "flush"}) + " " * MAX_COMMAND_CHARS
    with client.websocket_connect(f"/v1/sessions/{sessions.target}/stream") as ws:
        ws.send_text(padded)
        units, event = receive_until_event(ws)
        assert units == [] and event["type"] == "error" and event["error"]["code"] == "invalid_payload", event
        message = event["error"]["message"]
        assert f"a text message of {len(padded)} characters, more than the {MAX_COMMAND_CHARS}" in message, message
        sessions.assert_unchanged()  # not flushed
        ws.send_bytes(payload(LATENTS[:, :, 5:8]))
        ws.send_text(json.dumps({"type": "flush"}) + " " * (MAX_COMMAND_CHARS - 17))  # at the limit: read
        units, event = receive_until_event(ws)
        assert event == {"type": "done", "frames": 8}
    assert torch.equal(torch.cat([latents for latents, _ in units], dim=2), expected[:, :, 4:8])


def test_several_bad_websocket_messages_in_a_row(client, expected):
    """One connection, every bad payload one after the other: each is an event, none ends the stream."""
    sessions = Sessions(client)
    with client.websocket_connect(f"/v1/sessions/{sessions.target}/stream") as ws:
        for name, body, _, code in WS_CASES:
            ws.send_bytes(body)
            units, event = receive_until_event(ws)
            assert units == [] and event["error"]["code"] == code, (name, event)
        sessions.assert_unchanged()
        ws.send_bytes(payload(LATENTS[:, :, 5:8]))
        ws.send_text(json.dumps({"type": "flush"}))
        units, event = receive_until_event(ws)
        assert event == {"type": "done", "frames": 8}
    assert torch.equal(torch.cat([latents for latents, _ in units], dim=2), expected[:, :, 4:8])
    finish_and_check(client, sessions.bystander, expected)


# --- oversized input on a real server: refused before it is read ----------------------------------------------
@pytest.fixture(scope="module")
def small_server(checkpoint_dir, tmp_path_factory):
    settings = Settings(
        model=str(checkpoint_dir),
        device="cpu",
        dtype="float32",
        cache_dir=tmp_path_factory.mktemp("cache"),
        max_body_bytes=200_000,
        max_ws_message_bytes=200_000,
        max_clip_frames=12,
    )
    with LiveServer(settings) as server, httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        yield server, http


def live_started_session(http) -> str:
    session_id = http.post("/v1/sessions", json={}).json()["session_id"]
    response = http.post(
        f"/v1/sessions/{session_id}/chunks", params={"seq": 0}, content=payload(LATENTS[:, :, :5], EMBEDS, MASK),
        headers=OCTET,
    )
    assert response.status_code == 200, response.text
    return session_id


def live_state(http, session_id) -> dict:
    state = http.get(f"/v1/sessions/{session_id}").json()
    return {name: state[name] for name in STABLE_FIELDS}


def live_finish(http, session_id, expected) -> None:
    response = http.post(
        f"/v1/sessions/{session_id}/chunks", params={"seq": 1, "flush": "true"}, content=payload(LATENTS[:, :, 5:8]),
        headers=OCTET,
    )
    assert response.status_code == 200, response.text
    assert torch.equal(read_latents(response.content)[0], expected[:, :, 4:8])


@pytest.mark.parametrize("route", ["chunks", "refine", "sessions"])
def test_oversized_body_is_413_before_the_body_is_sent(small_server, expected, route):
    """A raw request that declares 1 GB and sends none of it: the answer comes without the server waiting for
    the body (a server that waited would leave this socket silent until the deadline)."""
    server, http = small_server
    target, bystander = live_started_session(http), live_started_session(http)
    before = {sid: live_state(http, sid) for sid in (target, bystander)}
    path = {
        "chunks": f"/v1/sessions/{target}/chunks?seq=1",
        "refine": "/v1/refine",
        "sessions": "/v1/sessions",
    }[route]
    content_type = "application/json" if route == "sessions" else OCTET["content-type"]
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {10**9}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S) as sock:
        sock.sendall(request)
        received = b""
        while b"payload_too_large" not in received:
            part = sock.recv(4096)
            assert part, f"the server closed the connection without the envelope: {received[:300]!r}"
            received += part
    assert received.startswith(b"HTTP/1.1 413"), received[:200]
    for session_id, state in before.items():
        assert live_state(http, session_id) == state
    live_finish(http, target, expected)
    live_finish(http, bystander, expected)


def test_oversized_websocket_message_closes_1009_and_the_session_goes_on(small_server, expected):
    server, http = small_server
    target, bystander = live_started_session(http), live_started_session(http)
    before = {sid: live_state(http, sid) for sid in (target, bystander)}
    url = f"{server.ws_url}/v1/sessions/{target}/stream"
    with connect(url, max_size=None, open_timeout=DEADLINE_S) as ws:
        ws.send(payload(torch.randn(1, 128, 8, 8, 8)))  # ~260 kB, over the 200 kB limit
        with pytest.raises(ConnectionClosed):
            while True:
                ws.recv(timeout=DEADLINE_S)
        assert ws.close_code == 1009
        # The reason names the limit (api.md's error table): the client adds which setting it is.
        assert re.fullmatch(r"frame with \d+ bytes exceeds limit of \d+ bytes", ws.close_reason), ws.close_reason
    for session_id, state in before.items():
        assert live_state(http, session_id) == state
    # A new connection to the same session carries on from where it was.
    with connect_when_free(url) as ws:
        ws.send(payload(LATENTS[:, :, 5:8]))
        ws.send(json.dumps({"type": "flush"}))
        units = []
        while True:
            message = ws.recv(timeout=DEADLINE_S)
            if isinstance(message, str):
                assert json.loads(message) == {"type": "done", "frames": 8}
                break
            units.append(read_latents(message)[0])
    assert torch.equal(torch.cat(units, dim=2), expected[:, :, 4:8])
    live_finish(http, bystander, expected)


def connect_when_free(url):
    """Connect once the server has let go of the previous connection (until then the session's stream is in
    use: 409 at the handshake)."""
    refused = []

    def attempt():
        try:
            return connect(url, max_size=None, open_timeout=DEADLINE_S)
        except InvalidStatus as exc:
            assert exc.response.status_code == 409, exc.response.status_code
            refused.append(exc)
            return None

    return wait_until(attempt, "the session's stream to be free")


def test_too_many_frames_in_a_clip_is_413(small_server, expected):
    server, http = small_server
    bystander = live_started_session(http)
    before = live_state(http, bystander)
    response = http.post("/v1/refine", content=payload(torch.randn(1, 128, 13, 1, 1), EMBEDS), headers=OCTET)
    assert_error(response, 413, "too_many_frames")
    assert live_state(http, bystander) == before
    live_finish(http, bystander, expected)


# --- a forward that fails --------------------------------------------------------------------------------------
def test_a_failing_forward_fails_only_its_request(small_server, expected):
    """Input that passes every check can still fail on the device (out of memory on a huge frame): that request
    gets 500 internal_error, its session is restored, the bystander never notices, and once the device copes
    again the same chunk returns exactly the untroubled bytes. On a real server: the bug this found was
    uvicorn closing the connection right after the 500, so the client could read a reset instead."""
    server, http = small_server
    target, bystander = live_started_session(http), live_started_session(http)
    before = {sid: live_state(http, sid) for sid in (target, bystander)}
    session = server.services.registry.handles()  # read-only look-up from the test thread; the engine is idle
    session = next(handle for handle in session if handle.id == target).session
    with failing_forwards(server.services.refiner.model, session) as calls:  # this session's forwards only
        response = http.post(
            f"/v1/sessions/{target}/chunks", params={"seq": 1, "flush": "true"}, content=payload(LATENTS[:, :, 5:8]),
            headers=OCTET,
        )
    body = assert_error(response, 500, "internal_error")
    assert calls, "the forward was never attempted"
    assert "out of memory" in body["error"]["message"]
    for session_id, state in before.items():
        assert live_state(http, session_id) == state
    live_finish(http, target, expected)
    live_finish(http, bystander, expected)


# --- server-side caps on what one session may cost ------------------------------------------------------------


def test_session_caps_are_enforced(tmp_path):
    """Configs and chunks beyond the server's per-session caps get 422 naming the setting; within them, fine."""
    from fastapi.testclient import TestClient
    from safetensors.torch import save

    from app.api.factory import create_app
    from app.core.settings import Settings
    from models.checkpoints import write_checkpoint

    folder = write_checkpoint(tmp_path / "tiny", preset="tiny")
    settings = Settings(
        model=str(folder), warmup=False, max_window_frames=8, max_denoise_steps=2, max_frame_tokens=12, max_batch=1,
        default_kv_max_frames=5,
    )
    with TestClient(create_app(settings)) as client:
        for body, setting in [
            ({"kv_max_frames": 6, "block_size": 3}, "max_window_frames"),
            ({"sigmas": [0.9, 0.6, 0.3, 0.0]}, "max_denoise_steps"),
        ]:
            response = client.post("/v1/sessions", json=body)
            assert response.status_code == 422 and setting in response.json()["error"]["message"], body
        response = client.post("/v1/refine?kv_max_frames=7&block_size=2", content=b"x",
                               headers={"content-type": "application/octet-stream"})
        assert response.status_code == 422 and "max_window_frames" in response.text
        session = client.post("/v1/sessions", json={"sigmas": [0.9, 0.5, 0.0]}).json()["session_id"]
        embeds = torch.randn(1, 4, 32)
        for latents, setting in [(torch.randn(1, 128, 2, 4, 4), "max_frame_tokens"),
                                 (torch.randn(2, 128, 2, 3, 4), "max_batch")]:
            response = client.post(f"/v1/sessions/{session}/chunks", content=save(
                {"latents": latents, "prompt_embeds": embeds.expand(latents.shape[0], -1, -1).contiguous()}),
                headers={"content-type": "application/octet-stream"})
            assert response.status_code == 422 and setting in response.json()["error"]["message"]
        assert client.get(f"/v1/sessions/{session}").json()["frames_received"] == 0
        response = client.post(f"/v1/sessions/{session}/chunks", content=save(
            {"latents": torch.randn(1, 128, 4, 3, 4), "prompt_embeds": embeds}),
            headers={"content-type": "application/octet-stream"})
        assert response.status_code == 200


def test_numpy_s_default_float64_is_told_how_to_convert(client):
    """float64 is what numpy gives by default (a new user's first chunk): the refusal says the conversion."""
    response = client.post("/v1/refine", content=payload(LATENTS.double(), EMBEDS, MASK), headers=OCTET)
    body = assert_error(response, 422, "invalid_input")
    assert "latents has dtype float64; send one of float32" in body["error"]["message"]
    assert ".astype(np.float32)" in body["error"]["message"]
