"""compile_step when compiling fails (``compile_fallback``): eager serves the step uncompiled and says so, fail stays
unready naming the reason. A real server in-process compiles the step with dynamo and inductor, which fails as when
its C++ compiler crashes (``tests.faults.crashing_compiler``)."""

from __future__ import annotations

import logging

import pytest
import torch
from fastapi.testclient import TestClient

from app.api.factory import create_app
from tests.faults import COMPILER_CRASH, crashing_compiler
from tests.app.conftest import (
    OCTET,
    expected_clip,
    make_clip,
    metric_value,
    payload,
    read_latents,
    running_app,
    wait_until,
)


@pytest.fixture
def broken_compiler():
    with crashing_compiler():
        yield


def compile_settings(make_settings, **overrides):
    return make_settings(compile_step=True, compile_mode="default", max_batch_rows=1, **overrides)


def test_a_failed_compile_serves_the_step_eagerly_and_says_so(make_settings, refiner, broken_compiler, caplog):
    """compile_fallback's default, eager: /ready answers 200; /v1/info's engine.step says the step runs eagerly and
    why (the compiler's own words), refiner_compile_failed is 1, the reason is logged once; the bytes are the eager
    path's, and admission: realtime has the eager step's measured cost per row to admit by."""
    settings = compile_settings(make_settings, admission="realtime")
    assert settings.compile_fallback == "eager"
    with caplog.at_level(logging.WARNING, logger="app"), running_app(settings) as client:
        engine = client.get("/v1/info").json()["engine"]
        assert engine["step"]["mode"] == "eager"
        reason = engine["step"]["reason"]
        assert reason.startswith("compile_step: true, but compiling failed (RuntimeError: C++ compile error")
        assert COMPILER_CRASH in reason and "compile_fallback: eager" in reason
        assert "Command:" not in reason and "TORCHDYNAMO_VERBOSE" not in reason  # one line, the compiler's words
        assert engine["compiled"] is None
        # The warm-up ran on the eager step and its calls were measured: what realtime admission reads.
        assert engine["realtime"]["seconds_per_row_by_tokens"]
        metrics = client.get("/metrics").text
        assert metric_value(metrics, "refiner_compile_failed") == 1
        latents, embeds, mask = make_clip(frames=10)
        session_id = client.post("/v1/sessions").json()["session_id"]
        reply = client.post(f"/v1/sessions/{session_id}/chunks?flush=true", content=payload(latents, embeds, mask),
                            headers=OCTET)
        assert reply.status_code == 200, reply.text
        assert torch.equal(read_latents(reply.content)[0], expected_clip(refiner, latents, embeds, mask))
        assert metric_value(client.get("/metrics").text, "refiner_uncompiled_model_calls_total") == 0
    logged = [r.getMessage() for r in caplog.records if "compiling the batched step failed" in r.getMessage()]
    assert len(logged) == 1 and COMPILER_CRASH in logged[0] and "serving the step eagerly" in logged[0], logged
    assert not any(r.exc_info for r in caplog.records if r.name == "app"), "the reason, not a traceback"


def test_a_failed_compile_with_compile_fallback_fail_stays_unready_with_the_reason(make_settings,
                                                                                   broken_compiler):
    """compile_fallback: fail: /ready's 503 names the compiler's failure and what to set instead; /v1/info's
    engine.step says nothing serves; the gauge is 1."""
    settings = compile_settings(make_settings, compile_fallback="fail")
    with TestClient(create_app(settings)) as client:
        def failed():
            ready = client.get("/ready")
            message = ready.json()["error"]["message"] if ready.status_code == 503 else ""
            return message if "failed" in message else None

        message = wait_until(failed, "/ready to say compiling failed")
        assert message.startswith("the server is not ready (compiling the batched step failed: RuntimeError: C++ "
                                  "compile error")
        assert COMPILER_CRASH in message and "set compile_fallback: eager" in message
        assert client.get("/ready").status_code == 503
        step = client.get("/v1/info").json()["engine"]["step"]
        assert step["mode"] == "none" and "compile_fallback: fail serves nothing" in step["reason"]
        assert metric_value(client.get("/metrics").text, "refiner_compile_failed") == 1


def test_without_compile_step_the_step_is_eager_by_the_setting(client):
    engine = client.get("/v1/info").json()["engine"]
    assert engine["step"] == {"mode": "eager", "reason": "compile_step: false"}
    assert metric_value(client.get("/metrics").text, "refiner_compile_failed") == 0


@pytest.mark.parametrize("fallback", ["eager", "fail"])
def test_a_torch_compile_that_refuses_at_start_up_falls_back_the_same_way(make_settings, monkeypatch, fallback):
    """torch.compile itself may refuse before anything is traced (dynamo on a Python version it does not support
    raises when the step is built, at start-up): the server still starts, and compile_fallback decides as for a
    failed compile."""
    def refuses(*args, **kwargs):
        raise RuntimeError("Dynamo is not supported on Python 3.14+")

    monkeypatch.setattr(torch, "compile", refuses)
    with TestClient(create_app(compile_settings(make_settings, compile_fallback=fallback))) as client:
        def settled():
            ready = client.get("/ready")
            return ready if ready.status_code == 200 or "failed" in ready.text else None

        ready = wait_until(settled, "/ready to be ready or to say compiling failed")
        assert ready.status_code == (200 if fallback == "eager" else 503)
        step = client.get("/v1/info").json()["engine"]["step"]
        assert step["mode"] == ("eager" if fallback == "eager" else "none")
        assert "RuntimeError: Dynamo is not supported on Python 3.14+" in step["reason"]
        assert metric_value(client.get("/metrics").text, "refiner_compile_failed") == 1
