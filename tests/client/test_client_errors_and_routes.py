"""The service fixes issue 10 lists (found trying the README as a new user), each checked where it can fail, and
the client's view of the session routes added with it (PUT, the error table)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

import wm_refiner_client as wm
from app.core.error_kinds import ERRORS
from app.core.settings import Settings
from bench.live import ThreadServer
from wm_refiner_client import Client, RetryPolicy
from wm_refiner_client.errors import ERROR_CLASSES

from .conftest import clip

LATENTS, PROMPT, MASK = clip(8)
ONCE = RetryPolicy(attempts=1)


def test_info_reports_every_limit_a_request_can_hit(server):
    limits = httpx.get(f"{server.base_url}/v1/info").json()["limits"]
    caps = [name for name in Settings.model_fields if name.startswith("max_")]
    assert {"max_window_frames", "max_denoise_steps", "max_frame_tokens", "max_batch"} <= set(caps)
    missing = [name for name in caps if name not in limits]
    assert not missing, f"/v1/info limits omit {missing}"
    assert all(limits[name] == getattr(server.settings, name) for name in caps)


def test_swapped_time_and_channel_axes_are_named_on_every_route(server):
    swapped = np.ascontiguousarray(np.swapaxes(LATENTS, 1, 2))  # (B, t, C, H, W): 128 "frames"
    with Client(server.base_url, retry=ONCE) as client:
        with pytest.raises(wm.InvalidInputError) as http_error:
            client.create_session().send(swapped, PROMPT)
        with pytest.raises(wm.InvalidInputError) as stream_error:
            list(client.create_session().stream([swapped], prompt=PROMPT))
        with pytest.raises(wm.InvalidInputError) as refine_error:
            client.refine(swapped, PROMPT)
    for error in (http_error.value, stream_error.value, refine_error.value):
        assert "time and channel axes look swapped" in error.message, error.message
        assert "too_many_frames" not in error.code
    other = np.zeros((1, 64, 4, 4, 4), np.float32)  # wrong channels, not swapped: said without the swap hint
    with Client(server.base_url, retry=ONCE) as client, pytest.raises(wm.InvalidInputError) as plain:
        client.create_session().send(other, PROMPT)
    assert "64 channels on axis 1 but the model takes 128" in plain.value.message
    assert "swapped" not in plain.value.message


def test_draining_does_not_promise_a_retry_in_one_second(make_settings):
    with ThreadServer(make_settings(warmup=False)) as live, Client(live.base_url, retry=ONCE) as client:
        session = client.create_session()
        assert httpx.post(f"{live.base_url}/v1/admin/drain", timeout=60).status_code == 200
        with pytest.raises(wm.DrainingError) as drained:
            session.send(LATENTS, PROMPT)
        assert drained.value.retry_after is not None  # the header stays: it paces a client's retries
        with pytest.raises(InvalidStatus) as refused:
            connect(f"{live.ws_url}/v1/sessions/{session.id}/stream")
    for message in (drained.value.message, refused.value.response.body.decode()):
        assert "retry in" not in message
        assert "shutting down" in message and "once it is back" in message


def test_a_stream_on_a_flushed_session_without_resume_from_is_refused(server):
    with Client(server.base_url) as client:
        session = client.create_session()
        units = [session.send(LATENTS, PROMPT, MASK, flush=True)]
    url = f"{server.ws_url}/v1/sessions/{session.id}/stream"
    with pytest.raises(InvalidStatus) as refused:
        connect(url)
    assert refused.value.response.status_code == 409
    assert b'"stream_closed"' in refused.value.response.body and b"resume_from" in refused.value.response.body
    with connect(f"{url}?resume_from=8") as ws:  # a client that lost the done event can still reconnect
        assert '"flushed": true' in ws.recv(timeout=30)
        ws.send('{"type": "flush"}')
        assert ws.recv(timeout=30) == '{"type": "done", "frames": 8}'
    assert units[0].frame_end == 8


def test_named_sessions_with_put(server):
    with Client(server.base_url) as client:
        session = client.session("client-test-0001", block_size=2, kv_max_frames=7)
        first = session.send(LATENTS[:, :, :5], PROMPT, MASK)
        again = client.session("client-test-0001", block_size=2, kv_max_frames=7)  # a safe retry: the same one
        assert again.id == session.id and again.frames_returned == first.frame_end
        rest = again.send(LATENTS[:, :, 5:], flush=True)
        assert rest.seq == 1
        with pytest.raises(wm.SessionExistsError):
            client.session("client-test-0001", block_size=3)
        with pytest.raises(ValueError):
            client.session("no spaces allowed")
        expected = client.refine(LATENTS, PROMPT, MASK, block_size=2, kv_max_frames=7).latents
    assert np.array_equal(wm.concat([first, rest]), expected)


def test_every_server_error_code_has_its_typed_error():
    for code, kind in ERRORS.items():
        assert code in ERROR_CLASSES, f"wm_refiner_client has no error class for {code!r}"
        cls = ERROR_CLASSES[code]
        assert cls.status == kind.status, code
        assert issubclass(cls, wm.APIError)
    error = wm.errors.error_from(503, {"error": {"code": "engine_busy", "message": "full"}}, retry_after=2.0)
    assert isinstance(error, wm.EngineBusyError) and isinstance(error, wm.ServiceUnavailableError)
    assert (error.status, error.retry_after, str(error)) == (503, 2.0, "503 engine_busy: full")
    unknown = wm.errors.error_from(409, {"error": {"code": "something_new", "message": "m"}})
    assert type(unknown) is wm.ConflictError and unknown.code == "something_new"


def test_a_chunk_that_is_not_an_array_is_refused_before_sending(server):
    with Client(server.base_url) as client, pytest.raises(TypeError):
        client.create_session().send([[1.0]], PROMPT)
