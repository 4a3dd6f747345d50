"""A session's bytes: computed before allocation (admission), counted from its tensors (accounting), and moved to
another device and back without changing a bit of what it refines (parking)."""

from __future__ import annotations

import pytest
import torch

from models import RefinerSession, SessionConfig, from_model
from models.checkpoints import build_model
from models.move import move_session
from models.session import Geometry
from models.session_bytes import session_bytes, session_bytes_estimate

from .conftest import make_inputs


def _owned(session) -> list[torch.Tensor]:
    """Every tensor the session owns, found by walking its objects (not through models.session_bytes)."""
    found = [v for v in vars(session.kv).values() if isinstance(v, torch.Tensor)] if session.kv else []
    state = session.state
    found += [t for t in (state.pending,) if t is not None]
    if state.prompt is not None:
        found += [t for t in vars(state.prompt).values() if isinstance(t, torch.Tensor)]
    if session._prepared is not None:
        found += [t for t in vars(session._prepared[1]).values() if isinstance(t, torch.Tensor)]
    return found


@pytest.mark.parametrize("positions,batch", [("absolute", 1), ("rebased", 2)])
def test_the_estimate_is_what_the_session_allocates_and_the_count_is_its_tensors(positions, batch):
    refiner = from_model(build_model("tiny"))
    config = SessionConfig(positions=positions, block_size=2, kv_max_frames=5)
    latents, embeds = make_inputs(batch=batch, frames=6, height=4, width=3)
    estimate = session_bytes_estimate(refiner.num_layers, refiner.info.inner_dim, config,
                                      Geometry(batch, 128, 4, 3), refiner.dtype)
    session = RefinerSession(refiner, config)
    assert sum(session_bytes(session).values()) == 0, "nothing before the first chunk"
    session.push(latents[:, :, :5], embeds)  # the sink, two blocks; no frame pending
    counted = session_bytes(session)
    for part in ("kv_window", "kv_sink", "kv_history_keys"):
        assert counted[part] == estimate[part], part
    assert (counted["kv_history_keys"] > 0) == (positions == "rebased")
    assert sum(counted.values()) == sum(t.nbytes for t in _owned(session))
    session.push(latents[:, :, 5:6])  # one frame pending: at most a step's worth is estimated
    assert 0 < session_bytes(session)["pending"] <= estimate["pending"]
    # With the prompt and one chunk's rollback copies (issue 25: admission left them out), per part.
    whole = session_bytes_estimate(refiner.num_layers, refiner.info.inner_dim, config, Geometry(batch, 128, 4, 3),
                                   refiner.dtype, prompt_tokens=embeds.shape[1],
                                   caption_channels=refiner.info.caption_channels, chunk_frames=5)
    assert session_bytes(session)["prompt"] == whole["prompt"] > 0
    assert whole["kv_rollback"] > 0 and whole["pending"] >= estimate["pending"]
    assert {k: v for k, v in whole.items() if k not in ("prompt", "kv_rollback", "pending")} == \
        {k: v for k, v in estimate.items() if k not in ("prompt", "kv_rollback", "pending")}
    assert sum(session_bytes(session).values()) == sum(t.nbytes for t in _owned(session))


@pytest.mark.parametrize("positions", ["absolute", "rebased"])
def test_a_session_moved_away_and_back_refines_bit_identically(positions):
    refiner = from_model(build_model("tiny"))
    config = SessionConfig(positions=positions, block_size=2, kv_max_frames=5)
    latents, embeds = make_inputs(frames=15, seed=3)
    uninterrupted = RefinerSession(refiner, config).push(latents, embeds, flush=True)

    session = RefinerSession(refiner, config)
    got = session.push(latents[:, :, :8], embeds)
    old = _owned(session)  # kept alive, so that no new tensor can be allocated where one of them was
    # On a CPU "away" is the same device: copy=True makes the move real, so nothing can be read from the old tensors.
    assert move_session(session, torch.device("cpu"), copy=True) is None
    assert not {t.data_ptr() for t in old} & {t.data_ptr() for t in _owned(session)}, "every tensor was moved"
    assert session._prepared is None
    move_session(session, refiner.device, copy=True)
    got += session.push(latents[:, :, 8:], flush=True)
    assert len(got) == len(uninterrupted)
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(got, uninterrupted))


def test_a_session_with_a_rollback_point_open_is_never_moved():
    refiner = from_model(build_model("tiny"))
    session = RefinerSession(refiner, SessionConfig(block_size=2))
    latents, embeds = make_inputs(frames=4)
    session.push(latents, embeds)
    mark = session.checkpoint()
    with pytest.raises(RuntimeError, match="rollback point"):
        move_session(session, torch.device("cpu"))
    session.release(mark)


@pytest.mark.parametrize("positions", ["absolute", "rebased"])
def test_the_rollback_copies_are_counted_while_a_point_is_open(positions):
    """``SessionKV.rollback_tensors``: what an open rollback point holds (the history frames a chunk pushed out) is
    in the session's bytes while it is open, and gone once it is released."""
    refiner = from_model(build_model("tiny"))
    session = RefinerSession(refiner, SessionConfig(positions=positions, block_size=2, kv_max_frames=5))
    latents, embeds = make_inputs(frames=11, height=4, width=3)
    session.push(latents[:, :, :5], embeds)  # the sink and two blocks: the history is full
    assert not session.kv.rollback_open and session_bytes(session)["kv_rollback"] == 0
    mark = session.checkpoint()
    session.push(latents[:, :, 5:9])  # two more blocks push two blocks' frames out of the window
    assert session.kv.rollback_open
    saved = session.kv.rollback_tensors()
    # K/V pieces, and with rebased positions a pre-RoPE key piece beside each: twice as many tensors.
    assert saved and len(saved) == len(session.kv._checkpoints[0].saved) * (2 if positions == "rebased" else 1)
    assert session_bytes(session)["kv_rollback"] == sum(t.nbytes for t in saved) == session.kv.checkpoint_bytes > 0
    session.release(mark)
    assert not session.kv.rollback_open and session_bytes(session)["kv_rollback"] == 0


def test_a_rolled_back_prompt_leaves_nothing_prepared_from_it():
    """A chunk with a new prompt that fails (rolled back) must not leave the new prompt's cross-attention K/V held
    and counted; the session then refines exactly as one that never got that chunk."""
    refiner = from_model(build_model("tiny"))
    config = SessionConfig(block_size=2)
    latents, embeds = make_inputs(frames=7, prompt_len=6)
    _, other = make_inputs(frames=1, prompt_len=20, seed=9)
    session, twin = RefinerSession(refiner, config), RefinerSession(refiner, config)
    for s in (session, twin):
        s.push(latents[:, :, :3], embeds)
    before = session_bytes(session)["prompt"]
    mark = session.checkpoint()
    session.push(latents[:, :, 3:5], other)  # refined with the new prompt, then the chunk fails
    assert session_bytes(session)["prompt"] > before
    session.rollback(mark)
    # The restored prompt's own K/V are prepared again by the next forward: until then only its embeddings count.
    assert session_bytes(session)["prompt"] <= before
    assert session._prepared is None or session._prepared[0] is session.state.prompt
    mine, theirs = session.push(latents[:, :, 3:7]), twin.push(latents[:, :, 3:7])
    assert [u.frame_start for u in mine] == [u.frame_start for u in theirs] == [3, 5]
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(mine, theirs))
