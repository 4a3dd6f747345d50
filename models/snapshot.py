"""Saving a session to one safetensors file and restoring it, bit for bit.

A session's KV cache cannot be rebuilt without re-running its history, so a restart must carry it: config,
prompt, sink and history K/V, generator state, pending frames and counters. Files are written atomically
(temporary file, fsync, rename), so a crash mid-write leaves the previous snapshot or none, never half of one.
Restoring checks that the snapshot was made with the same model geometry and dtype.

A file may carry a signature (``sign`` / ``verify``): an HMAC-SHA256, under a deployment's key, of its metadata and
every tensor (name, dtype, shape, bytes), stored in the metadata under ``signature``. It is computed from the tensors
in memory, never from the file's bytes, so it does not depend on how safetensors lays a file out, and a reader checks
exactly the tensors it goes on to use (a file swapped between a check and a load cannot slip through).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import SessionConfig
from .errors import RefinerError
from .forward import Prompt
from .loading import Refiner
from .kv import SessionKV, WindowLayout
from .move import Move, stage_tensors
from .session import Geometry, RefinerSession, SessionState, _generator_device

FORMAT = "wm-refiner-session/1"
SIGNATURE = "signature"  # the metadata key of a file's signature
_SIGNATURE_SCHEME = "hmac-sha256:"


class SnapshotError(RefinerError):
    """A snapshot that cannot be restored (corrupt, foreign, or made for another model)."""

    code = "snapshot_error"


class SnapshotUnreadable(SnapshotError):
    """The file could not be read now (an I/O error: EIO, ESTALE, EMFILE, EACCES...): the file itself is not known
    to be at fault. ``errno``: the operating system's error number (None when unknown)."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno

    @classmethod
    def reading(cls, path: str | Path, exc: OSError) -> SnapshotUnreadable:
        """``exc``, raised reading ``path``. safetensors (Rust) raises ``FileNotFoundError`` & co. with ``errno``
        None: the class says ENOENT then."""
        number = exc.errno if exc.errno is not None else (errno.ENOENT if isinstance(exc, FileNotFoundError) else None)
        return cls(f"{Path(path).name}: cannot be read now ({exc})", number)


@dataclass(frozen=True)
class SnapshotLimits:
    """What a snapshot may declare before any of it is allocated: the limits a live session is held to (its
    window, steps, frame size, batch, prompt length), so a file can never make the server build more than a
    client could have asked for. ``max_pending_frames``: frames received and not yet refined."""

    max_window_frames: int
    max_denoise_steps: int
    max_frame_tokens: int
    max_batch: int
    max_prompt_tokens: int
    max_pending_frames: int


# The names of a file's KV cache tensors: sink.<layer>.key|value, history.<layer>.key|value.
KV_TENSOR_PREFIXES = ("sink.", "history.")
# A generator's state is a few KiB (CPU: 5056 bytes, CUDA: 16); anything far larger is not one.
_MAX_RNG_STATE_BYTES = 64 * 1024
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True)
class TensorHeader:
    """A tensor as the file's header declares it; read without touching its data."""

    dtype: str  # safetensors' name: F32, BF16, U8, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES.get(self.dtype, 8)


def read_header(path: str | Path) -> tuple[dict[str, TensorHeader], dict[str, str]]:
    """(every tensor's dtype and shape, metadata) of a safetensors file from its header alone (nothing of the data
    is read or allocated); ``SnapshotError`` when it cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            headers = {}
            for name in handle.keys():
                view = handle.get_slice(name)
                headers[name] = TensorHeader(str(view.get_dtype()), tuple(int(n) for n in view.get_shape()))
    except OSError as exc:
        raise SnapshotUnreadable.reading(path, exc) from None
    except (SafetensorError, ValueError) as exc:
        raise SnapshotError(f"{Path(path).name}: unreadable snapshot ({exc})") from None
    return headers, metadata


def check_header(refiner: Refiner, headers: dict[str, TensorHeader], metadata: dict[str, str],
                 limits: SnapshotLimits, foreign: Callable[[str], bool] = lambda name: False) -> None:
    """Refuse (``SnapshotError``) a snapshot whose declared config, counters or geometry exceed ``limits`` or this
    model, or whose tensors are not exactly the ones those declare (names, shapes, dtypes), before anything is
    allocated from them. ``foreign``: names of tensors that are the caller's to check (the service's fields)."""
    model, config, counters = _read_metadata(metadata)
    if model != _model_key(refiner):
        raise SnapshotError(f"snapshot was made for model {model}, the loaded model is {_model_key(refiner)}")
    window = config.kv_max_frames + config.block_size
    if window > limits.max_window_frames:
        raise SnapshotError(f"snapshot declares a window of {window} frames, past this server's limit of "
                            f"{limits.max_window_frames} (max_window_frames)")
    if config.steps > limits.max_denoise_steps:
        raise SnapshotError(f"snapshot declares {config.steps} forwards per block, past this server's limit of "
                            f"{limits.max_denoise_steps} (max_denoise_steps)")
    if not isinstance(counters, dict):
        raise SnapshotError("snapshot state is not a mapping")

    def count(name: str) -> int:
        value = counters.get(name)
        if type(value) is not int or value < 0:
            raise SnapshotError(f"snapshot counter {name} is {value!r}, not a count")
        return value

    received, returned, history = count("frames_received"), count("frames_returned"), count("history_frames")
    count("blocks_refined")
    pending = received - returned
    if not 0 <= pending <= limits.max_pending_frames:
        raise SnapshotError(f"snapshot declares {pending} pending frames (received {received}, returned {returned}); "
                            f"at most {limits.max_pending_frames} can be")
    if history > config.max_history_frames:
        raise SnapshotError(f"snapshot holds {history} history frames, more than its config allows "
                            f"({config.max_history_frames})")
    geometry = counters.get("geometry")
    info = refiner.info
    if geometry is not None:
        if (not isinstance(geometry, list) or len(geometry) != 4
                or not all(type(n) is int and n >= 1 for n in geometry)):
            raise SnapshotError(f"snapshot geometry {geometry!r} is not four positive integers (B, C, H, W)")
        batch, channels, height, width = geometry
        if channels != info.in_channels:
            raise SnapshotError(f"snapshot geometry has {channels} channels, the model takes {info.in_channels}")
        if batch > limits.max_batch:
            raise SnapshotError(f"snapshot geometry has batch {batch}, past the limit of {limits.max_batch} (max_batch)")
        if height * width > limits.max_frame_tokens:
            raise SnapshotError(f"snapshot geometry has {height}x{width} tokens per frame, past the limit of "
                                f"{limits.max_frame_tokens} (max_frame_tokens)")
    elif received or counters.get("has_sink"):
        raise SnapshotError("snapshot has frames or a sink but no geometry")

    expected: dict[str, tuple[int, ...]] = {}
    if geometry is not None:
        batch, channels, height, width = geometry
        tokens = height * width
        if "pending" in headers:
            expected["pending"] = (batch, channels, pending, height, width)
        if counters.get("has_sink"):
            for layer in range(refiner.num_layers):
                for part in ("key", "value"):
                    expected[f"sink.{layer}.{part}"] = (batch, config.sink_frames * tokens, info.inner_dim)
                    if history:
                        expected[f"history.{layer}.{part}"] = (batch, history * tokens, info.inner_dim)
    elif "pending" in headers:
        raise SnapshotError("snapshot holds pending frames but no geometry")
    if pending and "pending" not in headers:
        raise SnapshotError(f"snapshot counters say {pending} pending frames but it holds none")
    prompt = headers.get("prompt_embeds")
    if prompt is not None:
        if (len(prompt.shape) != 3 or prompt.shape[2] != info.caption_channels
                or not 1 <= prompt.shape[1] <= limits.max_prompt_tokens
                or prompt.shape[0] not in ({1, geometry[0]} if geometry else range(1, limits.max_batch + 1))):
            raise SnapshotError(f"snapshot prompt_embeds shaped {list(prompt.shape)} do not fit (B, L <= "
                                f"{limits.max_prompt_tokens}, {info.caption_channels})")
        expected["prompt_embeds"] = prompt.shape
        if "prompt_mask" in headers:
            expected["prompt_mask"] = prompt.shape[:2]
    for name, shape in expected.items():
        header = headers.get(name)
        if header is None:
            raise SnapshotError(f"snapshot is missing tensor {name!r}")
        if header.shape != shape:
            raise SnapshotError(f"snapshot tensor {name!r} is shaped {list(header.shape)}, its metadata says "
                                f"{list(shape)}")
        if name != "prompt_mask" and header.dtype not in _FLOAT_DTYPES:
            raise SnapshotError(f"snapshot tensor {name!r} is {header.dtype}, not a floating point type")
    rng = headers.get("rng_state")
    if rng is None or rng.dtype != "U8" or len(rng.shape) != 1 or rng.nbytes > _MAX_RNG_STATE_BYTES:
        raise SnapshotError(f"snapshot rng_state is {rng}, not a generator state (at most "
                            f"{_MAX_RNG_STATE_BYTES} bytes of U8)")
    unknown = sorted(name for name in headers if name not in expected and name != "rng_state" and not foreign(name))
    if unknown:
        raise SnapshotError(f"snapshot holds tensors its metadata does not account for: {unknown[:5]}")


def _rng_state(state: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``state`` if it is a state of the generator a session on ``device`` draws with. A CUDA generator's state
    (Philox seed and offset, 16 bytes) and a CPU one's (Mersenne Twister, 5056) do not fit each other: unchecked,
    a session saved on one kind of device would be adopted on the other and fail at its next block with torch's
    "RNG state is wrong size"."""
    expected = torch.Generator(device=_generator_device(device)).get_state().numel()
    if state.numel() != expected:
        raise SnapshotError(
            f"snapshot rng_state is a generator state of {state.numel()} bytes; a {device.type} generator's is "
            f"{expected} (CUDA: 16, CPU: 5056): the session was saved by a replica on another kind of device. "
            "Adopt it on a replica of the device type that saved it")
    return state


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


def _on_host(tensor: torch.Tensor, own: bool) -> torch.Tensor:
    host = tensor.to("cpu").contiguous()
    if own and host.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        host = host.clone()  # still the session's memory (a CPU session): the one copy
    return host


def session_to_tensors(session: RefinerSession, extra: dict[str, str] | None = None, own: bool = False):
    """(tensors, metadata) describing the session completely; tensors are on the CPU and contiguous.

    ``own``: no tensor shares memory with the live session. Each is copied once: a tensor on the GPU is already a
    copy once on the host (so is a non-contiguous one made contiguous), and only a tensor that is still the
    session's own memory is cloned. Cloning after the move, as this did, copied a 720p session's 9.6 GiB twice, the
    second time on the host on the engine thread. A crash checkpoint uses ``copy_session`` instead, which on CUDA
    does not wait for the copies at all.

    The cache is stored as its parts (per layer: pre-RoPE sink K, sink V, history K and V), not as the window
    buffers, so a file holds only what the session holds and any later layout of the buffers can read it."""
    tensors = {name: _on_host(tensor, own) for name, tensor in _session_parts(session).items()}
    return tensors, _session_metadata(session, extra)


def stage_copy(session: RefinerSession) -> dict[str, torch.Tensor]:
    """The exact-size pinned host buffers a ``copy_session`` of ``session`` now needs, by tensor name (nothing for a
    session off CUDA). Locking a 720p session's 9.6 GiB takes seconds, so a worker thread calls this before the
    engine's turn (``app.sessions.checkpoints``), while no work of the session runs (its tensors are only read
    here by shape); a buffer that no longer fits when the copy is queued is allocated then, on the engine thread."""
    return stage_tensors(_session_parts(session), torch.device("cpu"))


def copy_session(session: RefinerSession, extra: dict[str, str] | None = None,
                 host: dict[str, torch.Tensor] | None = None, after=None):
    """(tensors, metadata, ready): ``session_to_tensors(own=True)`` without waiting for the device, for a crash
    checkpoint written while the session goes on. On the engine thread.

    On CUDA each tensor is copied once, on the device-to-host side stream of ``models.move.Move`` (which first waits
    for everything queued on the compute stream, so the copies see the last forwards' writes), into the pinned
    buffers ``stage_copy`` prepared (``host``); nothing here waits. ``ready`` is the event the copies complete with:
    whoever reads the tensors waits for it first (the checkpoint's writer thread, ``synchronize``). ``after``: an
    event of copies still bringing the session's tensors (a page-in no forward has waited for yet: a message that
    only added pending frames); the copies wait for it first, and ``ready`` then covers it too, so the session's
    next work, which waits for ``ready`` in its place, still waits for the page-in.

    The session must not write what is still being copied: its pending frames, prompt and generator state are
    replaced by new tensors when they change (``SessionState`` is immutable), but the KV cache is written in place
    (each forward writes its block slot and rotates the sink keys into the window, a commit with a full history
    shifts the history left, a rollback shifts it back). So the session's next work must make the compute stream
    wait for ``ready`` on the device (``app.engine.worker.wait_for``, as after a page-in); other sessions' work does
    not wait. Freed meanwhile (the session deleted), the cache's memory is reused only once the copies are done
    (``Move`` marks the sources used by its stream, ``record_stream``).

    Elsewhere (a CPU session, or one parked in host memory) ``ready`` is None and each tensor is cloned, as
    ``session_to_tensors(own=True)`` does: there is no stream to copy on. So it is with ``host`` None (no pinned
    memory could be locked for it, ``transfer.HostMemoryError``): then a CUDA session is copied into plain host
    memory, which waits for the device (and for ``after`` first), as checkpoints did before."""
    parts = _session_parts(session)
    metadata = _session_metadata(session, extra)
    source = next((t.device for t in parts.values() if t.device.type == "cuda"), None)
    if source is None or host is None:
        if source is not None and after is not None:
            # Copied on the compute stream, which has not waited for the page-in's side stream yet: the copies
            # would read the cache while it is still being brought in.
            torch.cuda.current_stream(source).wait_event(after)
        return {name: _on_host(tensor, own=True) for name, tensor in parts.items()}, metadata, None
    with Move(torch.device("cpu"), cuda_device=source, host=host, after=after) as move:
        tensors = {name: move(tensor, key=name) if tensor.device.type == "cuda" else _on_host(tensor, own=True)
                   for name, tensor in parts.items()}
    return tensors, metadata, move.ready


def _session_parts(session: RefinerSession) -> dict[str, torch.Tensor]:
    """Every tensor a file of ``session`` holds, where the session holds it (views into its cache buffers)."""
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
    return {name: tensor.detach() for name, tensor in tensors.items()}


def _session_metadata(session: RefinerSession, extra: dict[str, str] | None) -> dict[str, str]:
    state = session.state
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
    return {
        "format": FORMAT,
        "config": json.dumps(session.config.to_dict()),
        "model": json.dumps(_model_key(session.refiner)),
        "state": json.dumps(counters),
        **(extra or {}),
    }


def _read_metadata(metadata: dict[str, str]) -> tuple[dict, SessionConfig, dict]:
    """The model key, config and counters a snapshot declares; SnapshotError when they cannot be read."""
    if metadata.get("format") != FORMAT:
        raise SnapshotError(f"not a session snapshot (format {metadata.get('format')!r}, expected {FORMAT!r})")
    try:
        return (json.loads(metadata["model"]), SessionConfig.from_dict(json.loads(metadata["config"])),
                json.loads(metadata["state"]))
    except (KeyError, ValueError, TypeError, RefinerError) as exc:
        raise SnapshotError(f"snapshot metadata is unreadable: {exc}") from None


def session_from_tensors(refiner: Refiner, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                         device: torch.device | None = None, pin: bool = False):
    """Rebuild a session saved by ``session_to_tensors``; returns (session, metadata). ``device``: where its tensors
    go (default: the model's; the host for a session built off the engine thread and moved to the model's device
    afterwards, ``models.move.move_session``), its KV cache in page-locked memory with ``pin``."""
    model, config, counters = _read_metadata(metadata)
    if model != _model_key(refiner):
        raise SnapshotError(f"snapshot was made for model {model}, the loaded model is {_model_key(refiner)}")
    device = refiner.device if device is None else torch.device(device)
    num_layers = refiner.num_layers

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
            rng_state=_rng_state(tensors["rng_state"].to(torch.uint8), refiner.device),  # the model's generator
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
            kv = SessionKV(num_layers, geometry.batch, layout, refiner.info.inner_dim, refiner.dtype, device, rebased,
                           pin=pin)
            empty = [None] * num_layers
            kv.load(
                layers("sink", "key"),
                layers("sink", "value"),
                layers("history", "key") if history_frames else empty,
                layers("history", "value") if history_frames else empty,
                history_frames,
            )
    except torch.OutOfMemoryError:
        raise  # the machine's memory, not the file: the caller says so and keeps the file
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        problem = f"snapshot state is inconsistent: {exc}"
    else:
        problem = None
    if problem is not None:
        # Raised outside the except clause: an exception raised inside would keep the failed one as its context,
        # and with it the frames holding whatever was allocated (a KV cache) for as long as anyone holds it.
        kv = state = None
        raise SnapshotError(problem)
    pending = 0 if state.pending is None else int(state.pending.shape[2])
    if pending != state.pending_frames:
        raise SnapshotError(f"snapshot holds {pending} pending frames but its counters say {state.pending_frames}")
    session = RefinerSession(refiner, config)
    session.load(state, kv)
    return session, metadata


def write_atomically(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], *,
                     writer: str = "", before_rename: Callable[[], None] | None = None) -> Path:
    """Write a safetensors file so that a crash leaves the previous file or none: temporary file in the same
    folder (``.<name>.<writer>.<random>.tmp``: ``writer`` names who writes it, so that a folder shared by several
    processes can tell its own leftovers from another's write in progress), fsync, rename, fsync of the folder.
    ``before_rename``: last check before the rename; what it raises aborts the write (the file is left as it was)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{writer + '.' if writer else ''}", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        if before_rename is not None:
            before_rename()
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


def read_tensors(path: str | Path, check: Callable[[dict[str, TensorHeader], dict[str, str]], None] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; ``SnapshotError`` when it cannot be read. ``check``: called with
    the header (``read_header``) before any tensor is read; it raises to refuse the file."""
    if check is not None:
        check(*read_header(path))
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except OSError as exc:
        raise SnapshotUnreadable.reading(path, exc) from None
    except (SafetensorError, ValueError) as exc:
        raise SnapshotError(f"{Path(path).name}: unreadable snapshot ({exc})") from None
    return tensors, metadata


def save_snapshot(path: str | Path, session: RefinerSession, extra: dict[str, str] | None = None) -> Path:
    """Write the session to ``path`` atomically."""
    tensors, metadata = session_to_tensors(session, extra)
    return write_atomically(path, tensors, metadata)


def load_snapshot(path: str | Path, refiner: Refiner, limits: SnapshotLimits | None = None):
    """(session, metadata) from a snapshot file; ``SnapshotError`` if it is corrupt or foreign, or (``limits``)
    declares more than they allow: checked from the header before anything is read."""
    check = None if limits is None else (lambda headers, metadata: check_header(refiner, headers, metadata, limits))
    tensors, metadata = read_tensors(path, check)
    return session_from_tensors(refiner, tensors, metadata)


# --- signatures ---------------------------------------------------------------------------------------------------


def signature(key: bytes, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> str:
    """The HMAC-SHA256 under ``key`` of ``metadata`` (all of it but a signature already there) and ``tensors``.

    What is authenticated, in this order: a canonical JSON of the metadata and of every tensor's name, dtype and
    shape (its length first), then each tensor's bytes in name order. The JSON fixes every length, so the
    concatenation cannot be re-cut into another file's. Each tensor's bytes are fed from its own memory (a
    contiguous CPU tensor's buffer): nothing of the file is copied to compute it."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    names = sorted(tensors)
    header = json.dumps(
        {"metadata": {k: v for k, v in metadata.items() if k != SIGNATURE},
         "tensors": [[name, str(tensors[name].dtype), list(tensors[name].shape)] for name in names]},
        sort_keys=True, separators=(",", ":"),
    ).encode()
    mac.update(len(header).to_bytes(8, "little"))
    mac.update(header)
    for name in names:
        flat = tensors[name].detach().to("cpu").contiguous().reshape(-1)  # (numel,): a view when already so
        mac.update(flat.view(torch.uint8).numpy())  # its bytes, read in place
    return _SIGNATURE_SCHEME + mac.hexdigest()


def sign(key: bytes, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` with the signature of it and ``tensors`` under ``key`` added."""
    return {**metadata, SIGNATURE: signature(key, tensors, metadata)}


def verify(key: bytes, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], name: str = "snapshot"
           ) -> None:
    """``SnapshotError`` unless ``metadata`` carries the signature of itself and ``tensors`` under ``key``
    (compared in constant time). ``name``: the file, for the message."""
    stored = metadata.get(SIGNATURE)
    if stored is None:
        raise SnapshotError(f"{name}: unsigned, and this server loads only files signed with its "
                            "snapshot_signing_key (a file written without the key, or by a server of another "
                            "deployment, is refused)")
    if not hmac.compare_digest(stored.encode(), signature(key, tensors, metadata).encode()):
        raise SnapshotError(f"{name}: its signature does not match its contents under this server's "
                            "snapshot_signing_key: the file was edited, or signed with another key")
