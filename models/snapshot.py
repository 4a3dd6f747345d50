"""Saving a session to one safetensors file and restoring it, bit for bit.

A session's KV cache cannot be rebuilt without re-running its history, so a restart must carry it: config,
prompt, sink and history K/V, generator state, pending frames and counters. Files are written atomically
(temporary file, fsync, rename), so a crash mid-write leaves the previous snapshot or none, never half of one.
Restoring checks that the snapshot was made with the same model geometry and dtype.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import SessionConfig
from .errors import RefinerError
from .forward import Prompt
from .loading import Refiner
from .kv import SessionKV, WindowLayout
from .session import Geometry, RefinerSession, SessionState

FORMAT = "wm-refiner-session/1"


class SnapshotError(RefinerError):
    """A snapshot that cannot be restored (corrupt, foreign, or made for another model)."""

    code = "snapshot_error"


def _model_key(refiner: Refiner) -> dict:
    info = refiner.info
    return {
        "num_layers": info.num_layers,
        "inner_dim": info.inner_dim,
        "in_channels": info.in_channels,
        "caption_channels": info.caption_channels,
        "rope_type": info.rope_type,
        "dtype": info.dtype,
    }


def session_to_tensors(session: RefinerSession, extra: dict[str, str] | None = None):
    """(tensors, metadata) describing the session completely; tensors are on the CPU and contiguous.

    The cache is stored as its parts (per layer: pre-RoPE sink K, sink V, history K and V), not as the window
    buffers, so a file holds only what the session holds and any later layout of the buffers can read it."""
    state = session.state
    tensors: dict[str, torch.Tensor] = {"rng_state": state.rng_state.cpu()}
    if state.pending is not None:
        tensors["pending"] = state.pending
    if state.prompt is not None:
        tensors["prompt_embeds"] = state.prompt.embeds
        if state.prompt.mask is not None:
            tensors["prompt_mask"] = state.prompt.mask
    kv = session.kv
    if state.has_sink:
        parts = kv.export()
        for index in range(kv.num_layers):
            tensors[f"sink.{index}.key"] = parts["sink_key"][index]
            tensors[f"sink.{index}.value"] = parts["sink_value"][index]
            if state.history_frames:
                tensors[f"history.{index}.key"] = parts["history_key"][index]
                tensors[f"history.{index}.value"] = parts["history_value"][index]
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    counters = {
        "frames_received": state.frames_received,
        "frames_returned": state.frames_returned,
        "history_frames": state.history_frames,
        "blocks_refined": state.blocks_refined,
        "flushed": state.flushed,
        "has_sink": state.has_sink,
        # Absolute positions keep history keys rotated, rebased ones keep them pre-RoPE.
        "history_rotated": bool(state.history_frames and session.config.positions == "absolute"),
        "geometry": None if state.geometry is None else list(vars(state.geometry).values()),
    }
    metadata = {
        "format": FORMAT,
        "config": json.dumps(session.config.to_dict()),
        "model": json.dumps(_model_key(session.refiner)),
        "state": json.dumps(counters),
        **(extra or {}),
    }
    return tensors, metadata


def session_from_tensors(refiner: Refiner, tensors: dict[str, torch.Tensor], metadata: dict[str, str]):
    """Rebuild a session saved by ``session_to_tensors``; returns (session, metadata)."""
    if metadata.get("format") != FORMAT:
        raise SnapshotError(f"not a session snapshot (format {metadata.get('format')!r}, expected {FORMAT!r})")
    try:
        model = json.loads(metadata["model"])
        config = SessionConfig.from_dict(json.loads(metadata["config"]))
        counters = json.loads(metadata["state"])
    except (KeyError, ValueError, RefinerError) as exc:
        raise SnapshotError(f"snapshot metadata is unreadable: {exc}") from None
    if model != _model_key(refiner):
        raise SnapshotError(f"snapshot was made for model {model}, the loaded model is {_model_key(refiner)}")
    device, num_layers = refiner.device, refiner.num_layers

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise SnapshotError(f"snapshot is missing tensor {name!r}")
        return tensors[name].to(device)

    def layers(name: str, part: str) -> list[torch.Tensor]:
        return [get(f"{name}.{i}.{part}") for i in range(num_layers)]

    try:
        prompt = None
        if "prompt_embeds" in tensors:
            prompt = Prompt(get("prompt_embeds"), get("prompt_mask") if "prompt_mask" in tensors else None)
        geometry = Geometry(*counters["geometry"]) if counters["geometry"] is not None else None
        history_frames = int(counters["history_frames"])
        state = SessionState(
            frames_received=int(counters["frames_received"]),
            frames_returned=int(counters["frames_returned"]),
            pending=get("pending") if "pending" in tensors else None,
            geometry=geometry,
            prompt=prompt,
            has_sink=bool(counters["has_sink"]),
            history_frames=history_frames,
            rng_state=tensors["rng_state"].to(torch.uint8),
            flushed=bool(counters["flushed"]),
            blocks_refined=int(counters["blocks_refined"]),
        )
        rebased = config.positions == "rebased"
        if history_frames and bool(counters["history_rotated"]) == rebased:
            raise SnapshotError(
                f"snapshot keeps history keys {'rotated' if rebased else 'pre-RoPE'}, which {config.positions} "
                "positions cannot use"
            )
        kv = None
        if state.has_sink:
            if geometry is None:
                raise SnapshotError("snapshot has a sink but no geometry")
            layout = WindowLayout(config.sink_frames, config.max_history_frames, config.block_size,
                                  geometry.tokens_per_frame)
            if history_frames > layout.max_history_frames:
                raise SnapshotError(f"snapshot holds {history_frames} history frames, more than the config allows")
            kv = SessionKV(num_layers, geometry.batch, layout, refiner.info.inner_dim, refiner.dtype, device, rebased)
            empty = [None] * num_layers
            kv.load(
                layers("sink", "key"),
                layers("sink", "value"),
                layers("history", "key") if history_frames else empty,
                layers("history", "value") if history_frames else empty,
                history_frames,
            )
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SnapshotError(f"snapshot state is inconsistent: {exc}") from None
    pending = 0 if state.pending is None else int(state.pending.shape[2])
    if pending != state.pending_frames:
        raise SnapshotError(f"snapshot holds {pending} pending frames but its counters say {state.pending_frames}")
    session = RefinerSession(refiner, config)
    session.load(state, kv)
    return session, metadata


def write_atomically(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write a safetensors file so that a crash leaves the previous file or none: temporary file in the same
    folder, fsync, rename, fsync of the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def fsync_dir(folder: Path) -> None:
    # A rename is only durable once the directory entry is; not every platform can open a directory.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; ``SnapshotError`` when it cannot be read."""
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise SnapshotError(f"{Path(path).name}: unreadable snapshot ({exc})") from None
    return tensors, metadata


def save_snapshot(path: str | Path, session: RefinerSession, extra: dict[str, str] | None = None) -> Path:
    """Write the session to ``path`` atomically."""
    tensors, metadata = session_to_tensors(session, extra)
    return write_atomically(path, tensors, metadata)


def load_snapshot(path: str | Path, refiner: Refiner):
    """(session, metadata) from a snapshot file; ``SnapshotError`` if it is corrupt or foreign."""
    tensors, metadata = read_tensors(path)
    return session_from_tensors(refiner, tensors, metadata)
