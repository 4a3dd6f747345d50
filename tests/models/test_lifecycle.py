"""The capture lifecycle cannot come up empty silently: each of refiner.md's four causes gets an actionable error."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMLTX2AudioVideoAttnProcessor

from models import CaptureError, ForwardWindow, RefinerSession, SessionConfig, from_model, run_forward
from models.attention import WindowAttnProcessor
from models.checkpoints import build_model
from models.forward import Prompt, pack
from models.rope import rope_tables

from .conftest import make_inputs


@pytest.fixture
def refiner():
    return from_model(build_model("tiny"))


def sink_forward_args(refiner):
    latents, embeds = make_inputs(frames=1)
    rope = rope_tables(refiner.model, [0], 1, latents.shape[3], latents.shape[4], 16.0, refiner.device, refiner.dtype)
    return pack(latents), rope, Prompt(embeds, torch.ones(1, embeds.shape[1]))


def assert_actionable(error: CaptureError, *fragments: str) -> None:
    message = str(error)
    for fragment in ("Fix:", *fragments):
        assert fragment in message, f"{fragment!r} missing from: {message}"


def test_capture_returns_every_layer_once(refiner):
    tokens, rope, prompt = sink_forward_args(refiner)
    window = ForwardWindow("sink", refiner.num_layers)
    _, captured = run_forward(refiner.model, tokens, 0.0, rope, prompt, window)
    assert len(captured) == refiner.num_layers
    assert all(kv.key.shape == (1, tokens.shape[1], refiner.info.inner_dim) and not kv.rotated for kv in captured)


def test_capture_in_one_mode_collected_in_another(refiner):
    """A window made for one mode run under another mode's kv_cache_mode is refused before it computes."""
    tokens, rope, prompt = sink_forward_args(refiner)
    window = ForwardWindow("sink", refiner.num_layers)
    timestep = torch.zeros(1, tokens.shape[1])
    with pytest.raises(CaptureError) as error:
        refiner.model(hidden_states=tokens, encoder_hidden_states=prompt.embeds, timestep=timestep,
                      video_rotary_emb=rope, kv_cache=window, kv_cache_mode="inject_and_capture_post_rope")
    assert_actionable(error.value, "layer 0", "'sink'", "capture_pre_rope", "enabled in one mode and collected in another")


def test_collected_twice(refiner):
    tokens, rope, prompt = sink_forward_args(refiner)
    window = ForwardWindow("sink", refiner.num_layers)
    run_forward(refiner.model, tokens, 0.0, rope, prompt, window)  # reads the capture once
    with pytest.raises(CaptureError) as error:
        window.capture.take()
    assert_actionable(error.value, "'sink'", "collected twice")
    with pytest.raises(CaptureError) as error:  # and a reused window cannot silently capture again
        run_forward(refiner.model, tokens, 0.0, rope, prompt, window)
    assert_actionable(error.value, "layer 0", "reused")


def test_forward_short_circuited_before_attention(refiner, monkeypatch):
    """Layer 1 returns early (as a buggy block or hook would): its K/V is missing and the error says where."""
    tokens, rope, prompt = sink_forward_args(refiner)
    block = refiner.model.transformer_blocks[1]
    monkeypatch.setattr(block, "forward", lambda hidden_states, **kwargs: hidden_states)
    with pytest.raises(CaptureError) as error:
        run_forward(refiner.model, tokens, 0.0, rope, prompt, ForwardWindow("sink", refiner.num_layers))
    assert_actionable(error.value, "missing captured K/V on layer 1", "'sink'", "short-circuited")


def test_custom_processor_that_ignores_the_capture(refiner):
    refiner.model.transformer_blocks[1].attn1.set_processor(SanaWMLTX2AudioVideoAttnProcessor())
    tokens, rope, prompt = sink_forward_args(refiner)
    with pytest.raises(CaptureError) as error:
        run_forward(refiner.model, tokens, 0.0, rope, prompt, ForwardWindow("sink", refiner.num_layers))
    assert_actionable(error.value, "layer 1", "SanaWMLTX2AudioVideoAttnProcessor", "ignores the capture flag")


def test_processor_ignoring_capture_is_caught_even_past_the_precheck(refiner):
    """A processor subclass that passes the type check but drops the window still cannot go unnoticed."""

    class Forgetful(WindowAttnProcessor):
        def __call__(self, attn, hidden_states, *args, kv_cache=None, kv_cache_mode=None, **kwargs):
            return super().__call__(attn, hidden_states, *args, **kwargs)

    refiner.model.transformer_blocks[0].attn1.set_processor(Forgetful())
    tokens, rope, prompt = sink_forward_args(refiner)
    with pytest.raises(CaptureError) as error:
        run_forward(refiner.model, tokens, 0.0, rope, prompt, ForwardWindow("sink", refiner.num_layers))
    assert_actionable(error.value, "missing captured K/V on layer 0", "Forgetful", "custom attention processor")


def test_session_error_leaves_session_usable(refiner):
    """A capture failure inside a session is a failed step: the session keeps its state."""
    latents, embeds = make_inputs(frames=4)
    session = RefinerSession(refiner, SessionConfig())
    original = refiner.model.transformer_blocks[1].attn1.processor
    refiner.model.transformer_blocks[1].attn1.set_processor(SanaWMLTX2AudioVideoAttnProcessor())
    with pytest.raises(CaptureError):
        session.push(latents, embeds)
    assert session.state.frames_received == 0 and session.state.sink is None
    refiner.model.transformer_blocks[1].attn1.set_processor(original)
    assert [u.kind for u in session.push(latents, embeds)] == ["sink", "block"]
