"""A saved and restored session continues bit-identically; corrupt or foreign snapshots fail clearly."""

from __future__ import annotations

import pytest
import torch

from models import RefinerSession, SessionConfig, from_model
from models.checkpoints import build_model
from torch.utils._python_dispatch import TorchDispatchMode

from models.snapshot import (
    SnapshotError,
    _on_host,
    copy_session,
    load_snapshot,
    save_snapshot,
    session_to_tensors,
    stage_copy,
)

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


def _limits(**overrides):
    from models.snapshot import SnapshotLimits

    values = dict(max_window_frames=64, max_denoise_steps=16, max_frame_tokens=4096, max_batch=4,
                  max_prompt_tokens=1024, max_pending_frames=128)
    values.update(overrides)
    return SnapshotLimits(**values)


def _edited(path, target, edit_metadata=None, edit_tensors=None):
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        metadata = {k: json.loads(v) if k in ("state", "config") else v for k, v in handle.metadata().items()}
    if edit_metadata:
        edit_metadata(metadata)
    if edit_tensors:
        edit_tensors(tensors)
    metadata = {k: json.dumps(v) if k in ("state", "config") else v for k, v in metadata.items()}
    save_file(tensors, str(target), metadata=metadata)
    return target


def test_snapshot_headers_are_checked_against_limits_and_tensors_before_loading(tmp_path, monkeypatch):
    import models.snapshot as snapshot_module

    refiner = from_model(build_model("tiny"))
    session = RefinerSession(refiner, SessionConfig(block_size=2, kv_max_frames=5))
    latents, embeds = make_inputs(frames=6)
    session.push(latents, embeds)
    path = save_snapshot(tmp_path / "s.safetensors", session)
    restored, _ = load_snapshot(path, refiner, _limits())  # a genuine snapshot passes every check
    assert restored.state.history_frames == session.state.history_frames

    def geometry(values):
        return lambda m: m["state"].update(geometry=values)

    cases = {
        # within max_frame_tokens, but the KV tensors hold 4x4 frames: the header says so, nothing is allocated
        "tensor 'pending' is shaped": geometry([1, 128, 64, 64]),
        "max_frame_tokens": geometry([2, 128, 256, 256]),
        "max_batch": geometry([9, 128, 4, 4]),
        "channels": geometry([1, 64, 4, 4]),
        "max_window_frames": lambda m: m["config"].update(kv_max_frames=1000, block_size=500),
        "max_denoise_steps": lambda m: m["config"].update(sigmas=[1.0 - i / 200 for i in range(201)]),
        "pending frames": lambda m: m["state"].update(frames_received=10**9),
        "history frames": lambda m: m["state"].update(history_frames=50),
        "not a count": lambda m: m["state"].update(blocks_refined=-1),
    }
    # Nothing may be read or allocated for a refused file: loading would fail the test.
    monkeypatch.setattr(snapshot_module, "load_file", lambda *a, **k: pytest.fail("tensors read before the check"))
    for index, (message, edit) in enumerate(cases.items()):
        bad = _edited(path, tmp_path / f"bad{index}.safetensors", edit)
        with pytest.raises(SnapshotError, match=message):
            load_snapshot(bad, refiner, _limits())
    lying = {
        "is shaped": lambda t: t.update({"history.0.key": torch.zeros(1, 4 * 16, 32)}),
        "does not account for": lambda t: t.update(extra=torch.zeros(3)),
        "missing tensor": lambda t: t.pop("sink.1.value"),
        "rng_state": lambda t: t.update(rng_state=torch.zeros(10**6, dtype=torch.uint8)),
        "prompt_embeds": lambda t: t.update(prompt_embeds=torch.zeros(1, 2000, 32)),
    }
    for index, (message, edit) in enumerate(lying.items()):
        bad = _edited(path, tmp_path / f"lying{index}.safetensors", edit_tensors=edit)
        with pytest.raises(SnapshotError, match=message):
            load_snapshot(bad, refiner, _limits())


def test_a_snapshot_from_another_kind_of_device_is_refused_with_the_reason(tmp_path):
    """A session saved by a CUDA replica holds a CUDA generator's state (16 bytes: Philox seed and offset); a CPU
    replica's generator takes 5056. Adopted across, the session would fail at its next block with torch's "RNG
    state is wrong size": the load refuses it at once, saying why and what to do."""
    refiner = from_model(build_model("tiny"))
    session = RefinerSession(refiner, SessionConfig())
    latents, embeds = make_inputs(frames=4)
    session.push(latents, embeds)
    path = save_snapshot(tmp_path / "s.safetensors", session)
    cuda_like = torch.zeros(16, dtype=torch.uint8)  # what torch.Generator("cuda").get_state() is shaped like

    def as_if_from_cuda(tensors):
        tensors["rng_state"] = cuda_like

    edited = _edited(path, tmp_path / "cuda.safetensors", edit_tensors=as_if_from_cuda)
    with pytest.raises(SnapshotError, match="16 bytes; a cpu generator's is 5056.*another kind of device"):
        load_snapshot(edited, refiner)
    restored, _ = load_snapshot(path, refiner)  # its own kind loads
    assert torch.equal(restored.state.rng_state, session.state.rng_state)


class _CopiedBytes(TorchDispatchMode):
    """Bytes written by copying ops (clone, copy_, _to_copy), as the device sees them."""

    COPIES = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.COPIES:
            self.bytes += out.numel() * out.element_size()
        return out


def _storages(session):
    kv = session.kv.export()
    return {t.untyped_storage().data_ptr() for part in kv.values() for t in part if t is not None}


def test_a_checkpoints_tensors_are_the_sessions_copied_once(tmp_path):
    """A crash checkpoint's tensors share no memory with the session going on, and each byte is copied once: a
    tensor the move to the host (or to contiguous memory) copied already is not cloned again. On a GPU that second
    copy was a 720p session's 9.6 GiB, on the host, on the engine thread (tests/gpu checks the device side)."""
    refiner = from_model(build_model("tiny"))
    session = RefinerSession(refiner, SessionConfig(block_size=2, kv_max_frames=5))
    latents, embeds = make_inputs(frames=9, seed=3)
    session.push(latents, embeds)
    live = _storages(session)
    shared, _ = session_to_tensors(session)
    assert live & {t.untyped_storage().data_ptr() for t in shared.values()}  # a drain's record reads in place
    with _CopiedBytes() as copied:
        owned, _ = session_to_tensors(session, own=True)
    assert not live & {t.untyped_storage().data_ptr() for t in owned.values()}
    assert copied.bytes == sum(t.numel() * t.element_size() for t in owned.values())
    assert all(torch.equal(owned[name], shared[name]) for name in shared)

    # A tensor the move made contiguous is a copy already: not cloned again.
    strided = torch.randn(8, 6).t()
    with _CopiedBytes() as copied:
        host = _on_host(strided, own=True)
    assert host.is_contiguous() and torch.equal(host, strided)
    assert copied.bytes == host.numel() * host.element_size()
    dense = strided.contiguous()
    with _CopiedBytes() as copied:
        same = _on_host(dense, own=False)
    assert copied.bytes == 0 and same is dense


def test_a_crash_checkpoints_copy_of_a_cpu_session_is_one_clone_with_nothing_in_flight():
    """``copy_session``, what a crash checkpoint copies with: on a CPU there is no side stream, so it is
    ``session_to_tensors(own=True)``'s one clone, done when it returns (no event to wait for), and there is nothing
    to stage (``stage_copy``); without staged buffers (``host`` None: no pinned memory could be had) the same."""
    refiner = from_model(build_model("tiny"))
    session = RefinerSession(refiner, SessionConfig(block_size=2, kv_max_frames=5))
    latents, embeds = make_inputs(frames=9, seed=3)
    session.push(latents, embeds)
    live = _storages(session)
    shared, metadata = session_to_tensors(session, {"app": "{}"})
    assert stage_copy(session) == {}
    for host in ({}, None):
        with _CopiedBytes() as copied:
            owned, owned_metadata, ready = copy_session(session, {"app": "{}"}, host)
        assert ready is None and owned_metadata == metadata and owned.keys() == shared.keys()
        assert not live & {t.untyped_storage().data_ptr() for t in owned.values()}
        assert copied.bytes == sum(t.numel() * t.element_size() for t in owned.values())
        assert all(torch.equal(owned[name], shared[name]) for name in shared)
