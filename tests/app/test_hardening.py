"""Hostile inputs that must be bounded: snapshot files whose metadata lies, request bodies held open, slow and
huge requests, inputs that turn a session's output non-finite (issue 16, items 2, 4, 5 and 6)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .conftest import OCTET, make_clip, payload, running_app


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _saved_session(make_settings, folder: Path) -> Path:
    """A real drain snapshot of a session that has its sink and some history."""
    latents, embeds, mask = make_clip(frames=8)
    with running_app(make_settings(snapshot_dir=folder)) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        reply = client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(latents, embeds, mask),
                            headers=OCTET)
        assert reply.status_code == 200, reply.text
    return folder / f"{session_id}.session.safetensors"


def _rewrite(source: Path, target_id: str, edit) -> Path:
    """A copy of ``source`` under session ``target_id`` with its metadata changed by ``edit(metadata)``."""
    tensors = load_file(str(source))
    with safe_open(str(source), framework="pt") as handle:
        metadata = dict(handle.metadata())
    app_fields = json.loads(metadata["app"])
    app_fields["session_id"] = target_id
    metadata["app"] = json.dumps(app_fields)
    edit(metadata)
    target = source.with_name(f"{target_id}.session.safetensors")
    save_file(tensors, str(target), metadata=metadata)
    return target


def _huge_geometry(metadata: dict) -> None:
    state = json.loads(metadata["state"])
    state["geometry"] = [2, 128, 256, 256]
    metadata["state"] = json.dumps(state)


def _huge_window(metadata: dict) -> None:
    config = json.loads(metadata["config"])
    config.update(kv_max_frames=1000, block_size=500, sigmas=[1.0 - i / 200 for i in range(201)])
    metadata["config"] = json.dumps(config)


def test_snapshot_metadata_is_checked_against_limits_and_tensors_before_anything_is_allocated(make_settings,
                                                                                             tmp_path):
    folder = tmp_path / "snapshots"
    saved = _saved_session(make_settings, folder)
    ids = [f"hugegeom{i}" for i in range(3)]
    for session_id in ids:
        _rewrite(saved, session_id, _huge_geometry)
    _rewrite(saved, "hugewindow", _huge_window)
    with running_app(make_settings(snapshot_dir=folder)) as client:
        before = _rss_mib()
        for session_id in ids:
            assert client.get(f"/v1/sessions/{session_id}").status_code == 404
        grown = _rss_mib() - before
        # Each file would allocate a ~800 MiB KV cache from its declared geometry alone.
        assert grown < 150, f"refused snapshots moved RSS by {grown:.0f} MiB"
        # Past max_window_frames=64 and max_denoise_steps=16: refused, as a corrupt file is.
        assert client.get("/v1/sessions/hugewindow").status_code == 404
        # The genuine snapshot is still adopted (and saved again by this app's drain).
        assert client.get(f"/v1/sessions/{saved.name.split('.')[0]}").status_code == 200
    names = sorted(p.name for p in folder.iterdir() if p != saved)
    assert names == sorted(f"{i}.session.safetensors.corrupt" for i in [*ids, "hugewindow"])


def test_a_chunk_that_refines_to_non_finite_values_is_refused_and_the_session_is_unchanged(make_settings, refiner):
    from .conftest import expected_clip, read_latents, session_state

    latents, embeds, mask = make_clip(frames=10, seed=5)
    with running_app(make_settings()) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        first = client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(latents[:, :, :4], embeds, mask),
                            headers=OCTET)
        assert first.status_code == 200
        before = session_state(client, session_id)
        poisoned = latents[:, :, 4:].clone()
        poisoned[:, :, :, 0, 0] = 3e38  # finite: passes the input checks, overflows in the model
        refused = client.post(f"/v1/sessions/{session_id}/chunks?seq=1&flush=true", content=payload(poisoned),
                              headers=OCTET)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_input" and "NaN or Inf" in error["message"]
        assert "3e+38" in error["message"] and "send latents and prompt_embeds" in error["message"]
        assert session_state(client, session_id) == before
        retry = client.post(f"/v1/sessions/{session_id}/chunks?seq=1&flush=true", content=payload(latents[:, :, 4:]),
                            headers=OCTET)
        assert retry.status_code == 200, retry.text
        refined = torch.cat([read_latents(first.content)[0], read_latents(retry.content)[0]], dim=2)
    assert torch.equal(refined, expected_clip(refiner, latents, embeds, mask))
