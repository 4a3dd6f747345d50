"""A saved and restored session continues bit-identically; corrupt or foreign snapshots fail clearly."""

from __future__ import annotations

import pytest
import torch

from models import RefinerSession, SessionConfig, from_model
from models.checkpoints import build_model
from models.snapshot import SnapshotError, load_snapshot, save_snapshot

from .conftest import make_inputs


@pytest.mark.parametrize("positions", ["absolute", "rebased"])
def test_restored_session_continues_bit_identically(positions, tmp_path):
    refiner = from_model(build_model("tiny"))
    config = SessionConfig(positions=positions, block_size=2, kv_max_frames=5)
    latents, embeds = make_inputs(frames=19, seed=12)
    mask = torch.ones(1, embeds.shape[1])
    mask[:, :2] = 0
    uninterrupted = RefinerSession(refiner, config).push(latents, embeds, mask, flush=True)

    session = RefinerSession(refiner, config)
    got = session.push(latents[:, :, :12], embeds, mask)  # window full, 1 frame pending
    assert session.state.pending_frames == 1
    save_snapshot(tmp_path / "s.safetensors", session, {"seq": "3"})
    restored, metadata = load_snapshot(tmp_path / "s.safetensors", from_model(build_model("tiny")))
    assert metadata["seq"] == "3" and restored.cache_bytes == session.cache_bytes
    got += restored.push(latents[:, :, 12:], flush=True)
    assert len(got) == len(uninterrupted)
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(got, uninterrupted))


def test_bad_snapshots_are_refused(tmp_path):
    refiner = from_model(build_model("tiny"))
    session = RefinerSession(refiner, SessionConfig())
    latents, embeds = make_inputs(frames=4)
    session.push(latents, embeds)
    path = save_snapshot(tmp_path / "s.safetensors", session)
    data = path.read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="unreadable"):
        load_snapshot(tmp_path / "truncated.safetensors", refiner)
    (tmp_path / "garbage.safetensors").write_bytes(b"not a snapshot at all")
    with pytest.raises(SnapshotError):
        load_snapshot(tmp_path / "garbage.safetensors", refiner)
    with pytest.raises(SnapshotError, match="made for model"):
        load_snapshot(path, from_model(build_model("tiny", rope_type="split")))
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries behind
