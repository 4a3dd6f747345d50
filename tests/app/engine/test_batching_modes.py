"""``batching``: auto (the default) batches a class of model call only once the batch-invariance probe passed for it
on the loaded model here; true forces it with a warning; false never batches. A class seen for the first time is
probed then. The probe is shown to catch what it must with an injected kernel whose rounding depends on the batch
size. And at the service level, sessions batched on one server equal each of them run alone on the same server, bit
for bit, wherever the probe passed (elsewhere the server does not batch them)."""

from __future__ import annotations

import logging
import math
import threading

import httpx
import pytest
import torch

import models.step
from models.checkpoints import write_checkpoint
from models.determinism import InvarianceProbe

from tests.app.conftest import DEADLINE_S, LiveServer, running_app, wait_until
from tests.app.engine.test_concurrent_sessions import model_calls, stream_clip


def engine_info(client) -> dict:
    return client.get("/v1/info").json()["engine"]


def failing_probe(monkeypatch) -> list:
    """The probe answers 'not invariant'; returns the list of its calls."""
    calls = []

    def probe(*args, **kwargs):
        calls.append(kwargs)
        return InvarianceProbe(False, 1, (1,), "a row stacked at position 1 of 2 differs (injected)")

    monkeypatch.setattr("app.runtime.services.probe_batch_invariance", probe)
    return calls


def batch_dependent_rounding(monkeypatch) -> None:
    """An M-dependent kernel, injected: a model call of several rows rounds every output one unit in the last place
    up, as a BLAS that picks its kernel by M may (MKL on an AMD EPYC, cuBLAS). Solo calls are untouched."""
    real = models.step.forward_body

    def body(model, tokens, *args):
        velocity = real(model, tokens, *args)
        if tokens.shape[0] > 1:
            velocity = torch.nextafter(velocity, torch.full_like(velocity, math.inf))
        return velocity

    monkeypatch.setattr("models.step.forward_body", body)


def settled_classes(http) -> list[dict]:
    """``engine.batch_classes`` once no class waits for its probe (the engine probes them when idle)."""
    wait_until(lambda: all(c["invariant"] is not None for c in http.get("/v1/info").json()["engine"]["batch_classes"]),
               "every class seen to be probed")
    return http.get("/v1/info").json()["engine"]["batch_classes"]


def test_auto_is_the_default_and_batches_when_the_probe_passes(make_settings):
    settings = make_settings()
    assert settings.batching == "auto"
    with running_app(settings) as client:
        engine = engine_info(client)
    assert engine["batching"] == "auto" and engine["batched"] is True and engine["batch_invariant"] is True
    assert engine["batch_probe"].startswith("invariant over")


def test_every_class_of_the_warm_up_size_is_probed_before_ready(make_settings):
    """The warm-up's block (4x4 latents, blocks of 3: 48 tokens per row), its sink (1 frame: 16) and a short last
    block of each length (16, 32) are probed before /ready: none of them holds the engine for a probe when a
    client's first sink or flush meets it (a new user saw each first call of a size wait ~20 s on a loaded CPU)."""
    settings = make_settings()
    defaults = settings.session_defaults()
    assert (defaults.block_size, defaults.sink_frames, settings.warmup_height, settings.warmup_width) == (3, 1, 4, 4)
    with running_app(settings) as client:
        classes = engine_info(client)["batch_classes"]
    assert sorted(c["tokens_per_row"] for c in classes) == [16, 32, 48], classes
    assert all(c["invariant"] is True for c in classes), classes


def test_every_class_of_each_listed_warm_up_size_is_probed_before_ready(make_settings):
    """warmup_geometries warms up more latent sizes than warmup_height x warmup_width: each one's classes are probed
    before /ready too (8x8: blocks of 3 are 192 tokens per row, its sink and short blocks 64 and 128), so a
    real-time client streaming at a listed size never has its first blocks held by a probe."""
    with running_app(make_settings(warmup_geometries="8x8")) as client:
        classes = engine_info(client)["batch_classes"]
    assert sorted(c["tokens_per_row"] for c in classes) == [16, 32, 48, 64, 128, 192], classes
    assert all(c["invariant"] is True for c in classes), classes


def test_without_the_warm_up_it_is_ready_at_once_and_batches_once_the_probe_passed(make_settings):
    """``warmup: false`` means ready without waiting: the probe then runs after, and calls hold one session until it
    has passed."""
    with running_app(make_settings(warmup=False)) as client:
        wait_until(lambda: engine_info(client)["batched"], "the probe to pass and batching to start")
        assert engine_info(client)["batch_invariant"] is True


def test_auto_serves_one_session_per_call_when_a_kernel_depends_on_the_batch(make_settings, monkeypatch, caplog):
    batch_dependent_rounding(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="app"), LiveServer(make_settings()) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        engine = http.get("/v1/info").json()["engine"]
        assert engine["batched"] is False and engine["batch_invariant"] is False
        assert "differs from its solo forward" in engine["batch_probe"]
        before = model_calls(server)
        run_sessions_at_once(server, http, [dict(seed=i) for i in range(3)], clips(3, channels=32))
        calls_made, rows = (after - was for after, was in zip(model_calls(server), before))
        classes = settled_classes(http)
        http.close()
    assert calls_made > 0 and rows == calls_made, "a model call carried several sessions although the probe failed"
    failed = [c["tokens_per_row"] for c in classes if c["invariant"] is False]
    assert failed and len(failed) == len(classes) == len(set(failed)), classes
    warnings = [r.getMessage() for r in caplog.records if "batching: auto serves forwards of" in r.getMessage()]
    assert len(warnings) == len(failed), ("each class that failed is logged once", warnings, classes)


def test_a_class_seen_for_the_first_time_is_probed_then_batched(make_settings):
    """The warm-up probes its own class (4x4 latents, blocks of 3: 48 tokens per row); sessions at 3x3 are a new
    class, probed when the engine first sees it, then batched; their bytes equal those of the first round."""
    configs = [dict(seed=i) for i in range(4)]
    inputs = clips(4, channels=32, height=3, width=3)
    with LiveServer(make_settings(max_batch_rows=8)) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        seen = http.get("/v1/info").json()["engine"]["batch_classes"]
        assert {c["tokens_per_row"]: c["invariant"] for c in seen}[48] is True and 27 not in [c["tokens_per_row"] for c in seen]
        first = run_sessions_at_once(server, http, configs, inputs)
        classes = settled_classes(http)
        assert {c["tokens_per_row"]: c["invariant"] for c in classes}.get(27) is True, classes
        before = model_calls(server)
        second = run_sessions_at_once(server, http, configs, inputs)
        calls, rows = (after - was for after, was in zip(model_calls(server), before))
        http.close()
    assert rows > calls, "no model call carried more than one session once the class passed its probe"
    for index, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"session {index}: batched differs from the first round by {(a - b).abs().max():.3g}"


def test_true_forces_batching_and_warns_when_the_probe_fails(make_settings, monkeypatch, caplog):
    batch_dependent_rounding(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="app"), running_app(make_settings(batching=True)) as client:
        engine = engine_info(client)
    assert engine["batching"] is True and engine["batched"] is True and engine["batch_invariant"] is False
    assert any("batching: true, but batched forwards" in r.getMessage() for r in caplog.records)


def test_false_never_batches_and_skips_the_probe(make_settings, monkeypatch):
    calls = failing_probe(monkeypatch)
    with running_app(make_settings(batching=False)) as client:
        engine = engine_info(client)
    assert calls == [] and engine["batched"] is False and engine["batch_invariant"] is None


def test_the_environment_takes_auto_true_and_false(monkeypatch, make_settings):
    for text, value in (("auto", "auto"), ("true", True), ("false", False)):
        monkeypatch.setenv("WM_REFINER_BATCHING", text)
        assert make_settings().batching == value
    monkeypatch.setenv("WM_REFINER_BATCHING", "sometimes")
    with pytest.raises(ValueError, match="batching"):
        make_settings()


# --- the service level ---------------------------------------------------------------------------------------
# The repro (inner 512: 8 x 64, 4 layers, caption 64; batched rows differed on an AVX2-only CPU) and an inner
# width that is not a multiple of 32 (5 x 16, where they differed on a Xeon too).
WIDTHS = {
    "512": dict(num_attention_heads=8, attention_head_dim=64, cross_attention_dim=512, caption_channels=64, num_layers=4),
    "80": dict(num_attention_heads=5, attention_head_dim=16, cross_attention_dim=80, caption_channels=24, num_layers=2),
}


def clips(count: int, channels: int, height: int = 4, width: int = 4) -> list:
    out = []
    for index in range(count):
        generator = torch.Generator().manual_seed(100 + index)
        latents = torch.randn(1, 128, 10 + index % 3, height, width, generator=generator)  # (B, C, T, H, W)
        embeds = torch.randn(1, 3 + index, channels, generator=generator)  # (B, L, caption)
        out.append((latents, embeds, None))
    return out


def run_sessions_at_once(server, http, configs: list[dict], inputs: list) -> list[torch.Tensor]:
    ids = [http.post("/v1/sessions", json=config).json()["session_id"] for config in configs]
    outputs: list[list] = [[] for _ in configs]
    threads = [threading.Thread(target=stream_clip, args=(server, ids[i], *inputs[i], 2 + i % 3, outputs[i]))
               for i in range(len(configs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S * 2)
    return [torch.cat([units for units, _ in output], dim=2) for output in outputs]


@pytest.mark.parametrize("width", sorted(WIDTHS))
def test_sessions_batched_on_a_server_equal_each_alone_for_other_widths(make_settings, tmp_path, width):
    """8 sessions at once on one server, then each alone on the same server: every clip within the parity tolerance,
    and bit-identical where the server batched them (its probe passed for this model here); where the probe failed
    the server serves one session per call, and the test is skipped with the probe's verdict."""
    shape = WIDTHS[width]
    checkpoint = write_checkpoint(tmp_path / "wide", preset="tiny", **shape)
    configs = [dict(seed=i, positions="rebased" if i % 3 == 2 else "absolute", kv_max_frames=7 + i % 2 * 4)
               for i in range(8)]
    inputs = clips(8, channels=shape["caption_channels"])
    with LiveServer(make_settings(model=str(checkpoint), max_batch_rows=8, warmup_prompt_tokens=3)) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        engine = http.get("/v1/info").json()["engine"]
        before = model_calls(server)
        together = run_sessions_at_once(server, http, configs, inputs)
        calls, rows = (after - was for after, was in zip(model_calls(server), before))
        alone = [run_sessions_at_once(server, http, [config], [clip])[0] for config, clip in zip(configs, inputs)]
        http.close()
    for index, (a, b) in enumerate(zip(together, alone)):
        assert (a - b).abs().max().item() <= 1e-5, f"session {index}: beyond the parity tolerance"
    if not engine["batched"]:
        assert rows == calls, "a model call carried several sessions although the probe failed"
        pytest.skip(f"the server does not batch this model here (its probe: {engine['batch_probe']})")
    assert rows > calls, "no model call carried more than one session"
    for index, (a, b) in enumerate(zip(together, alone)):
        assert torch.equal(a, b), f"session {index}: batched differs from alone by {(a - b).abs().max().item():.3g}"
