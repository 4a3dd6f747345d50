"""The K/V a forward writes cannot go missing silently: each of refiner.md's four causes gets an actionable error.

In this refiner a forward writes its block's K/V straight into the session's window (``models.kv``) and a
commit keeps what the last forward wrote, so "capture" is the write every layer makes, checked once per forward
by ``KVWrites.verify``.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMLTX2AudioVideoAttnProcessor

from models import CaptureError, RefinerSession, SessionConfig, from_model, run_batch
from models.attention import WindowAttnProcessor
from models.checkpoints import build_model
from models.step import build_window

from .conftest import make_inputs


@pytest.fixture
def refiner():
    return from_model(build_model("tiny"))


def sink_forward(refiner):
    """A session about to capture its sink, and that forward's inputs."""
    latents, embeds = make_inputs(frames=1)
    session = RefinerSession(refiner, SessionConfig())
    session.append(session.check(latents, embeds))
    run = session.start(session.plan())
    return session, run, session.next_forward(run)


def assert_actionable(error: CaptureError, *fragments: str) -> None:
    message = str(error)
    for fragment in ("Fix:", *fragments):
        assert fragment in message, f"{fragment!r} missing from: {message}"


def diffusers_forward(refiner, forward, window, kv_cache_mode):
    """diffusers' own forward of the model, driving our processors through ``window``."""
    tokens = forward.tokens
    return refiner.model(
        hidden_states=tokens,
        encoder_hidden_states=torch.zeros(1, 2, refiner.info.caption_channels),
        timestep=torch.zeros(1, tokens.shape[1]),
        video_rotary_emb=forward.tables,
        kv_cache=window,
        kv_cache_mode=kv_cache_mode,
        return_dict=False,
    )[0]


def test_every_layer_writes_the_sink_once(refiner):
    session, run, forward = sink_forward(refiner)
    window = build_window([forward], refiner.num_layers)
    diffusers_forward(refiner, forward, window, window.kv_cache_mode)
    window.writes.verify()
    tokens = forward.tokens.shape[1]
    assert session.kv.sink_key.shape == (refiner.num_layers, 1, tokens, refiner.info.inner_dim)
    assert bool(session.kv.sink_key.abs().sum(dim=(1, 2, 3)).gt(0).all()), "every layer's pre-RoPE sink K written"


def test_capture_in_one_mode_collected_in_another(refiner):
    """A window made for one mode, run under another mode's kv_cache_mode, is refused before it computes."""
    _, _, forward = sink_forward(refiner)
    window = build_window([forward], refiner.num_layers)
    with pytest.raises(CaptureError) as error:
        diffusers_forward(refiner, forward, window, "inject_and_capture_post_rope")
    assert_actionable(error.value, "layer 0", "'sink'", "capture_pre_rope", "enabled in one mode and collected in another")


def test_collected_twice(refiner):
    _, _, forward = sink_forward(refiner)
    window = build_window([forward], refiner.num_layers)
    diffusers_forward(refiner, forward, window, window.kv_cache_mode)
    window.writes.verify()  # read once
    with pytest.raises(CaptureError) as error:
        window.writes.verify()
    assert_actionable(error.value, "'sink'", "collected twice")
    with pytest.raises(CaptureError) as error:  # and a reused window cannot silently write again
        diffusers_forward(refiner, forward, window, window.kv_cache_mode)
    assert_actionable(error.value, "layer 0", "reused")


def test_forward_short_circuited_before_attention(refiner, monkeypatch):
    """Layer 1 returns early (as a buggy block or hook would): its K/V is missing and the error says where."""
    _, _, forward = sink_forward(refiner)
    block = refiner.model.transformer_blocks[1]
    monkeypatch.setattr(block, "forward", lambda hidden_states, **kwargs: hidden_states)
    with pytest.raises(CaptureError) as error:
        run_batch(refiner.model, [forward])
    assert_actionable(error.value, "missing captured K/V on layer 1", "'sink'", "short-circuited")


def test_custom_processor_that_ignores_the_capture(refiner):
    refiner.model.transformer_blocks[1].attn1.set_processor(SanaWMLTX2AudioVideoAttnProcessor())
    _, _, forward = sink_forward(refiner)
    with pytest.raises(CaptureError) as error:
        run_batch(refiner.model, [forward])
    assert_actionable(error.value, "layer 1", "SanaWMLTX2AudioVideoAttnProcessor", "ignores the capture flag")


def test_processor_ignoring_capture_is_caught_even_past_the_precheck(refiner):
    """A processor subclass that passes the type check but computes without the window cannot go unnoticed."""

    class Forgetful(WindowAttnProcessor):
        def __call__(self, attn, hidden_states, *args, kv_cache=None, kv_cache_mode=None, **kwargs):
            return attn.to_out[0](attn.to_v(hidden_states))

    refiner.model.transformer_blocks[0].attn1.set_processor(Forgetful())
    _, _, forward = sink_forward(refiner)
    with pytest.raises(CaptureError) as error:
        run_batch(refiner.model, [forward])
    assert_actionable(error.value, "missing captured K/V on layer 0", "Forgetful", "custom attention processor")


def test_session_error_leaves_session_usable(refiner):
    """A capture failure inside a session is a failed step: the session keeps its state."""
    latents, embeds = make_inputs(frames=4)
    session = RefinerSession(refiner, SessionConfig())
    original = refiner.model.transformer_blocks[1].attn1.processor
    refiner.model.transformer_blocks[1].attn1.set_processor(SanaWMLTX2AudioVideoAttnProcessor())
    with pytest.raises(CaptureError):
        session.push(latents, embeds)
    assert session.state.frames_received == 0 and not session.state.has_sink and session.kv is None
    refiner.model.transformer_blocks[1].attn1.set_processor(original)
    assert [u.kind for u in session.push(latents, embeds)] == ["sink", "block"]
