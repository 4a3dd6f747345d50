"""Live sessions on disk: one safetensors file per session in ``snapshot_dir``, a folder every replica may share.

A file holds what ``models.snapshot`` saves of the session (config, prompt, KV cache, generator state, pending
frames, counters: ``session_to_tensors``) plus the service's own fields: the session id, ``next_seq``, the last
``seq``, its request (``app.core.chunk_request``: what a retry must repeat) and its stored response (a retry after
the restart gets the same bytes), the units retained for a reattaching stream or watcher, its creation time, its
outputs and its output stages' states (``app.outputs.stage``; for video its decoder's state,
``models.vae.video_to_tensors``, under ``app.video``). Everything sits in one file so that one atomic rename commits all of it; a restart can never pair a
session with another moment's seq counters or units.

Sessions move through the folder: a draining replica writes its sessions (and a checkpoint is written the same
way); the replica that next gets a request for one takes the session's *lease* (``app.persistence.leases``: of several racing
replicas exactly one gets it, and none while the owner's lease is live), loads the file and holds the session. Every
write of a session's file is fenced by its writer's lease (``write_fenced``, the one write a checkpoint, a spill and
a drain all call), so a replica that lost a session can never write it again, and a later crash cannot bring back a
stale owner's copy.

Files in the folder are not trusted as they are (docs/reliability.md, the trust table). With
``snapshot_signing_key`` every file written is signed (``models.snapshot.sign``: HMAC-SHA256 over its metadata and
tensors) and a file that is unsigned or signed otherwise is refused as a corrupt one is. Every file written under a
lease records that lease's generation (``lease_generation``), and a file below the session's floor
(``app.persistence.leases.read_floor``: the generation of its last write) is refused (``StaleRecord``): an older copy put back
is never loaded over the session's later state.

Building records (``record_tensors``, ``record_from_tensors``) runs on the engine thread (the session's tensors
are the engine's); reading and verifying a file (``read_record``) touches no session and runs on a worker thread,
and so does building an adopted session in host memory (``host_session``: gigabytes copied, and on CUDA locked),
which the engine thread then only sends to the device on a side stream, as a page-in does.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from models import Refiner, RefinerSession
from models.move import move_session, stage_host
from models.snapshot import (
    KV_TENSOR_PREFIXES,
    SnapshotError,
    SnapshotLimits,
    TensorHeader,
    check_header,
    copy_session,
    fsync_dir,
    read_tensors,
    session_from_tensors,
    session_to_tensors,
    sign,
    verify,
    write_atomically,
)
from models.transfer import use_device

from wm_refiner_client import spec

from app.core.chunk_request import ChunkRequest
from app.core.error_kinds import ApiError
from app.outputs.catalog import outputs_from_fields
from app.outputs.kinds import Outputs
from app.outputs.replay import SentUnit
from app.outputs.stage import OutputStages, SessionStages, StageUnavailable
from app.persistence import leases

log = logging.getLogger("app")

APP_FORMAT = "wm-refiner-app/1"
SUFFIX = ".session.safetensors"
UNIT_TENSOR = "app.unit.{}"
LAST_RESPONSE_TENSOR = "app.last_response"
STAGES_PREFIX = "app"  # a stage's tensors are named app.<kind>.*
GENERATION_KEY = "lease_generation"  # metadata: the lease generation the file was written under


# Versions. ``APP_FORMAT`` stays ``/1`` as long as every earlier reader can read a file: a field a later version adds
# goes beside the others, and a reader that does not know it reads the file as it did before. Where such a reader
# would misread the file, the field's name goes into ``requires`` too (``units_in_responses``: an earlier reader
# takes every kept unit as streamed, and a stream's resume could send one answered over HTTP again). A reader leaves
# a file that requires what it does not know (or that says a later format) where it is (``NewerRecord``): a replica
# of the version that wrote it serves it, as during a rolling upgrade. Replicas before this rule read a later format
# as a corrupt file (set aside), which is why the format itself is not bumped.
APP_FEATURES = frozenset({"units_in_responses"})


class StaleRecord(SnapshotError):
    """A session file older than the session's last write (below its floor, ``app.persistence.leases``): not loaded."""


class NewerRecord(SnapshotError):
    """A session file written by a later version of the service, which this one would misread: left where it is."""


@dataclass
class SessionRecord:
    """A session as it is saved and restored: the model-side session plus the service's fields."""

    session_id: str
    session: RefinerSession
    next_seq: int
    last_seq: int | None
    last_response: bytes | None
    units: list[SentUnit]
    streaming: bool = False  # a WebSocket was attached when it was saved: its client will want to reattach
    encode: Callable[[SentUnit], bytes] | None = None  # for a retained unit whose encoding failed earlier
    outputs: Outputs = Outputs()
    stages: SessionStages | None = None  # None: new ones (a session that outputs latents only)
    created_at: float | None = None  # wall clock (time.time()) of the session's creation
    checkpoint: bool = False  # read from a crash checkpoint rather than a drain's snapshot
    realtime: bool = False  # its blocks have deadlines (app.engine.pacing): a moved or spilled session keeps them
    # The event its tensors' copies to the device complete with (a session built in host memory: its first forward
    # waits for it on the device, ``app.engine.worker.wait_for``); None when nothing was copied (on the CPU).
    ready: Any = None
    # The request of ``last_seq`` (a repeat must equal it). None: unknown, as in a file written before requests were
    # recorded; such a session replays a repeat of its last seq whatever the request holds, as it did then.
    last_request: ChunkRequest | None = None


def check_snapshot_folder(folder: Path) -> None:
    """``OSError`` saying what to change when ``folder`` cannot hold sessions: it cannot be created or written to, or
    it is on a case-insensitive file system (a macOS or Windows volume, an SMB share), where two session ids that
    differ only in case (``ab...`` and ``AB...`` are two sessions) would share one file, and one session's spill or
    drain would overwrite the other's. Checked once at start-up by a probe file, removed at once."""
    probe = folder / f".case-probe-{os.getpid()}-{os.urandom(6).hex()}.tmp"  # lower case: hex digits a-f
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
    except OSError as exc:
        raise OSError(f"snapshot_dir {folder} cannot be written to ({exc.strerror or exc}): give a folder this "
                      "process may create files in, or unset snapshot_dir (sessions are then not saved)") from None
    try:
        if (folder / probe.name.upper()).exists():
            raise OSError(f"snapshot_dir {folder} is on a case-insensitive file system: session ids differ by case, "
                          "and two of them would share one file there; put it on a case-sensitive file system (any "
                          "Linux one, or NFS exported from one)")
    finally:
        probe.unlink(missing_ok=True)


def snapshot_path(folder: Path, session_id: str) -> Path:
    """The file of ``session_id`` in ``folder``. Every path to a session's file is made here, so the id rule
    (``spec.check_session_id``: ValueError otherwise) keeps any '/', '..' or glob character out of the folder."""
    return folder / f"{spec.check_session_id(session_id)}{SUFFIX}"


def record_tensors(record: SessionRecord) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What a file of ``record`` holds, its session's tensors read in place (a drain's, a spill's: the session does
    not go on meanwhile); on the engine thread."""
    app_metadata, app_tensors = _app_parts(record, checkpoint=False)
    tensors, metadata = session_to_tensors(record.session, app_metadata)
    tensors.update(app_tensors)
    return tensors, metadata


def record_copy(record: SessionRecord, host: dict[str, torch.Tensor] | None = None, after=None):
    """(tensors, metadata, ready): what a crash checkpoint of ``record`` holds, none of it sharing memory with the
    session, which goes on meanwhile; on the engine thread. On CUDA the session's tensors are still being copied to
    the host when this returns (``models.snapshot.copy_session``, into the buffers ``host`` staged by
    ``stage_copy``): read them only once ``ready`` has passed, and make the session's next work wait for it on the
    device. ``ready`` is None when nothing is in flight. ``after``: copies still bringing the session's tensors
    (``copy_session``)."""
    app_metadata, app_tensors = _app_parts(record, checkpoint=True)
    tensors, metadata, ready = copy_session(record.session, app_metadata, host, after)
    tensors.update(app_tensors)
    return tensors, metadata, ready


def _app_parts(record: SessionRecord, checkpoint: bool) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The service's part of a file of ``record``: its metadata entry and its tensors (output stages' states,
    retained units, the last response), all new or immutable host tensors."""
    app_fields = {
        "format": APP_FORMAT,
        "session_id": record.session_id,
        "next_seq": record.next_seq,
        "last_seq": record.last_seq,
        "has_last_response": record.last_response is not None,
        "last_request": None if record.last_request is None else record.last_request.to_fields(),
        "units": [[unit.frame_start, unit.frame_end] for unit in record.units],
        # Which of them were returned in HTTP responses (a stream's resume does not send those again). A field of
        # its own, so that a replica of an earlier version still reads "units" (and takes them all as streamed).
        "units_in_responses": [index for index, unit in enumerate(record.units) if unit.in_response],
        # What an earlier reader would misread (see APP_FEATURES): a replica that knows none of it leaves the file.
        "requires": ["units_in_responses"] if any(unit.in_response for unit in record.units) else [],
        "streaming": record.streaming,
        "created_at": record.created_at,
        "outputs": record.outputs.to_dict(),
        "checkpoint": checkpoint,  # a crash checkpoint: its clients may be ahead of it
        "realtime": record.realtime,
    }
    stage_tensors: dict[str, torch.Tensor] = {}
    if record.stages is not None:
        # Each stage's fields under its kind ("video": the decoder's, as before stages existed; None: stateless).
        stage_tensors, stage_fields = record.stages.to_tensors(STAGES_PREFIX)
        app_fields.update(stage_fields)
    tensors = dict(stage_tensors)  # immutable states: never written in place
    for index, unit in enumerate(record.units):
        tensors[UNIT_TENSOR.format(index)] = _bytes_tensor(unit.data(record.encode))
    if record.last_response is not None:
        tensors[LAST_RESPONSE_TENSOR] = _bytes_tensor(record.last_response)
    return {"app": json.dumps(app_fields)}, tensors


def write_record(folder: Path, session_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str], *,
                 writer: str = "", before_rename: Callable[[], None] | None = None,
                 lease: leases.Lease | None = None, key: bytes | None = None) -> Path:
    """``writer``: the replica id; ``before_rename``: the lease's fencing check (``app.persistence.leases.check``). With a
    writer, every temporary file (this one's, and the one safetensors makes for itself beside it) is in a staging
    folder of this write (``app.persistence.leases.staging``), which a sweep removes once its process is dead: a crash mid-write
    leaves nothing anyone has to recognise by name. The rename from there is as atomic (one file system).

    ``lease``: the lease the file is written under; its generation goes into the file, and once the file is in
    place the session's floor is raised to it (after the rename: a crash between the two leaves the floor lower,
    which accepts this file, never higher, which would refuse it). ``key``: the deployment's signing key (the
    signature covers the generation too)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = snapshot_path(folder, session_id)
    if lease is not None:
        metadata = {**metadata, GENERATION_KEY: str(lease.generation)}
    if key is not None:
        metadata = sign(key, tensors, metadata)  # on the writing thread: the tensors are read in place
    if not writer:
        write_atomically(path, tensors, metadata, before_rename=before_rename)
    else:
        with leases.staging(folder, writer) as staged_in:
            staged = write_atomically(staged_in / path.name, tensors, metadata)
            if before_rename is not None:
                before_rename()
            os.replace(staged, path)
        fsync_dir(folder)
    if lease is not None:
        try:
            leases.raise_floor(folder, session_id, lease.generation, writer or "local")
        except OSError as exc:  # the file is in place: a floor left lower only accepts more, never refuses it
            log.warning("session %s: its floor marker was not raised to %d (%r)", session_id, lease.generation, exc)
    return path


def write_fenced(folder: Path, session_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str], *,
                 lease: leases.Lease | None, replica_id: str, lease_s: float, key: bytes | None = None,
                 release: bool = False) -> tuple[leases.Lease, Path]:
    """The one write of a session's file by a replica: under the session's lease, fenced by it. Every writer of a
    live session (a checkpoint, a spill, a drain) goes through here, so none can forget the fence.

    ``lease``: the one this replica holds on the session already, or None: it is taken first
    (``leases.acquire``: LeaseHeld while another replica holds a live one). The file is renamed into place only
    if the lease is still this replica's right before (``leases.check``: LeaseLost otherwise, and the file is
    not written), so a replica that lost a session can never overwrite its new owner's copy. ``release``: the
    lease is let go once the file is in place (a drain: whichever replica is asked next adopts it at once);
    otherwise the caller keeps it. ``key``: the deployment's ``snapshot_signing_key`` (the file is signed), or
    None. The file carries the lease's generation (``write_record``). Returns the lease held for the write and the
    file's path. On a worker thread (it blocks on the disk)."""
    held = lease or leases.acquire(folder, session_id, replica_id, lease_s)
    path = write_record(folder, session_id, tensors, metadata, writer=replica_id,
                        before_rename=lambda: leases.check(held), lease=held, key=key)
    if release:
        leases.release(folder, session_id, held)
    return held, path


def remove_record(folder: Path, session_id: str) -> None:
    """A session that ended (deleted, evicted, finished) must not come back from its last checkpoint."""
    snapshot_path(folder, session_id).unlink(missing_ok=True)


def snapshot_limits(settings) -> SnapshotLimits:
    """The limits a file in ``snapshot_dir`` is held to: those of a session a client could have made here. Pending
    frames: at most a window's worth plus one chunk that arrived before the blocks it completes were refined."""
    return SnapshotLimits(
        max_window_frames=settings.max_window_frames,
        max_denoise_steps=settings.max_denoise_steps,
        max_frame_tokens=settings.max_frame_tokens,
        max_batch=settings.max_batch,
        max_prompt_tokens=settings.max_prompt_tokens,
        max_pending_frames=settings.max_window_frames + settings.max_frames_per_chunk,
    )


def check_record_header(path: Path, refiner: Refiner, limits: SnapshotLimits, headers: dict[str, TensorHeader],
                        metadata: dict[str, str]) -> None:
    """Refuse a file from its header alone: the session's part against ``limits`` and the model
    (``models.snapshot.check_header``), the service's tensors against the fields that declare them."""
    try:
        check_header(refiner, headers, metadata, limits, foreign=lambda name: name.startswith(f"{STAGES_PREFIX}."))
        fields = json.loads(metadata["app"])
        units = list(fields["units"])
        has_last_response = bool(fields["has_last_response"])
    except SnapshotError as exc:
        raise SnapshotError(f"{path.name}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"{path.name}: service fields are unreadable ({exc!r})") from None
    byte_tensors = [UNIT_TENSOR.format(index) for index in range(len(units))]
    if has_last_response:
        byte_tensors.append(LAST_RESPONSE_TENSOR)
    for name in byte_tensors:
        header = headers.get(name)
        if header is None or header.dtype != "U8" or len(header.shape) != 1:
            raise SnapshotError(f"{path.name}: {name} is {header}, not the bytes its fields declare")
    declared = set(byte_tensors)
    extra = sorted(name for name in headers
                   if name.startswith(("app.unit.", LAST_RESPONSE_TENSOR)) and name not in declared)
    if extra:
        raise SnapshotError(f"{path.name}: holds tensors its fields do not declare: {extra[:5]}")


def load_record(path: Path, refiner: Refiner, stages: OutputStages, expected_id: str | None = None,
                limits: SnapshotLimits | None = None, key: bytes | None = None, floor: int = 0) -> SessionRecord:
    """The record in ``path``; ``SnapshotError`` when it is corrupt, foreign or made for another model (or with an
    output this server cannot produce: video without a VAE). ``stages``: the server's. ``expected_id``: the session
    the file must hold (default: its name's). ``limits``, ``key``, ``floor``: ``read_record``'s. The two halves,
    ``read_record`` then ``record_from_tensors``; an adoption runs the first on a worker thread."""
    tensors, metadata = read_record(path, refiner, limits, key, floor, expected_id)
    return record_from_tensors(path, tensors, metadata, refiner, stages, expected_id)


def read_record(path: Path, refiner: Refiner, limits: SnapshotLimits | None = None, key: bytes | None = None,
                floor: int = 0, expected_id: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of the file in ``path``, checked as far as the file alone can be: ``limits`` from
    its header before anything is read (``check_record_header``), so a file cannot make this process allocate more
    than a client's session could; ``key``: the deployment's signing key, and the file must carry its signature of
    exactly the tensors and metadata read (checked before any of them is used); ``floor``: the lowest lease
    generation the file may have been written under (``app.persistence.leases.read_floor``), ``StaleRecord`` below
    it (a file without one counts as 0); ``expected_id``: the session it must hold (default: its name's), from its
    fields before anything is read (``record_identity``), so that a foreign file costs no read and no build.

    It touches no session and no model state (``refiner``: its config, for the header check), so it may run on
    any thread. An adoption runs it on a worker thread: verifying a signed file reads and hashes every byte
    (~0.7 s per GiB on the AMD EPYC machine, docs/benchmarks.md "Snapshot signing"), which on the engine thread
    would stall every other session's blocks."""
    def check(headers: dict[str, TensorHeader], metadata: dict[str, str]) -> None:
        record_identity(path, metadata, expected_id)  # a foreign file, or another session's, before any read
        if limits is not None:
            check_record_header(path, refiner, limits, headers, metadata)

    tensors, metadata = read_tensors(path, check)
    if key is not None:
        verify(key, tensors, metadata, path.name)
    generation = record_generation(metadata, path.name)
    if generation < floor:
        raise StaleRecord(
            f"{path.name}: written under lease generation {generation}, but the session was written since under "
            f"generation {floor} or ended: an older copy of the session was put back in snapshot_dir; its later "
            "state is not in this file, and loading it would silently take the session back"
        )
    return tensors, metadata


HostSession = tuple[RefinerSession, dict[int, torch.Tensor]]


def host_session(refiner: Refiner, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> HostSession:
    """The session ``read_record``'s tensors hold, built in host memory (its KV cache page-locked when the model is
    on CUDA), and the pinned copies of the rest that its move to the model's device needs (``stage_host``): the part
    of an adoption that copies gigabytes (and locks them), done on a worker thread rather than the engine's, where
    it stalled every other session's blocks for the length of a 720p window's copy (and on CUDA queued ~200
    pageable copies, each waiting for the GPU). ``SnapshotError`` as ``session_from_tensors``; it touches no model
    state. Pass it to ``record_from_tensors(..., built=)``. Out of host memory (or of what may be locked):
    ``MemoryError`` / ``torch.OutOfMemoryError``, the file is not to blame.

    The file's per-layer cache tensors are dropped from ``tensors`` once copied into the session's buffers (the
    rest of the record reads the others): an adoption holds the file's copy and the session's at once only while
    this runs."""
    cuda = refiner.device.type == "cuda"
    if cuda:
        use_device(refiner.device)  # a worker thread's current device is 0: locking memory there opens a context
    session, _ = session_from_tensors(refiner, tensors, metadata, device=torch.device("cpu"), pin=cuda)
    for name in [name for name in tensors if name.startswith(KV_TENSOR_PREFIXES)]:
        del tensors[name]
    return session, stage_host(session, refiner.device)


def record_from_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], refiner: Refiner,
                        stages: OutputStages, expected_id: str | None = None,
                        built: HostSession | None = None) -> SessionRecord:
    """The record ``read_record`` read from ``path`` (named in errors), built into a session and its output stages:
    ``SnapshotError`` when its fields are unreadable, foreign, for another session or another model. On the engine
    thread (the session it builds is the engine's). ``built``: ``host_session``'s session, sent to the model's
    device here without a host wait (the record's ``ready`` says when it is there) instead of built here."""
    session_id = record_identity(path, metadata, expected_id)
    try:
        fields = json.loads(metadata["app"])
        # Absent from files written before HTTP responses' units were kept: every unit there was streamed.
        in_responses = {int(index) for index in fields.get("units_in_responses", [])}
        units = [
            SentUnit(int(start), int(end), _tensor_bytes(tensors[UNIT_TENSOR.format(index)]),
                     in_response=index in in_responses)
            for index, (start, end) in enumerate(fields["units"])
        ]
        last_response = _tensor_bytes(tensors[LAST_RESPONSE_TENSOR]) if fields["has_last_response"] else None
        next_seq = int(fields["next_seq"])
        last_seq = None if fields["last_seq"] is None else int(fields["last_seq"])
        # Absent from files written before requests were recorded: unknown (None), a repeat is then replayed as it
        # was before; those files stay readable.
        last_request = ChunkRequest.from_fields(fields.get("last_request"))
        outputs = outputs_from_fields(fields.get("outputs") or {}, vae_configured=True)
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"{path.name}: service fields are unreadable ({exc!r})") from None
    except ApiError as exc:
        raise SnapshotError(f"{path.name}: outputs are unreadable ({exc.message})") from None
    try:
        session_stages = stages.from_tensors(outputs, tensors, fields, STAGES_PREFIX)
    except StageUnavailable as exc:
        raise SnapshotError(f"{path.name}: the session outputs {list(outputs.kinds)} but {exc}") from None
    except Exception as exc:
        raise SnapshotError(f"{path.name}: its output stages' state does not fit this server ({exc!r})") from None
    session = session_from_tensors(refiner, tensors, metadata)[0] if built is None else built[0]
    for earlier, later in zip(units, units[1:]):
        if later.frame_start != earlier.frame_end:
            raise SnapshotError(f"{path.name}: retained units are not contiguous")
    if units and units[-1].frame_end > session.state.frames_returned:
        raise SnapshotError(
            f"{path.name}: retained units end at frame {units[-1].frame_end}, after the session's "
            f"{session.state.frames_returned} returned frames"
        )
    # Last, once nothing can refuse the file: on a side stream, the engine thread only queues the copies.
    ready = None if built is None else move_session(session, refiner.device, host=built[1])
    return SessionRecord(session_id, session, next_seq, last_seq, last_response, units, bool(fields.get("streaming")),
                         outputs=replace(outputs, fps=session.config.fps), stages=session_stages,
                         created_at=fields.get("created_at"), checkpoint=bool(fields.get("checkpoint")),
                         realtime=fields.get("realtime") is True, ready=ready, last_request=last_request)


def record_identity(path: Path, metadata: dict[str, str], expected_id: str | None = None) -> str:
    """The session the record in ``path`` holds, from its fields alone: ``SnapshotError`` when it is not a service
    snapshot or holds another session than ``expected_id`` (default: the one its file name says). Cheap: an
    adoption asks it before building anything from the file (``read_record``'s ``expected_id``)."""
    try:
        fields = json.loads(metadata["app"])
        written = fields.get("format")
        if written != APP_FORMAT:
            if isinstance(written, str) and written.startswith("wm-refiner-app/"):
                raise NewerRecord(f"{path.name}: written in format {written!r} by another version of wm-refiner; "
                                  f"this one reads {APP_FORMAT!r}")
            raise SnapshotError(f"{path.name}: not a service snapshot (format {written!r})")
        session_id = spec.check_session_id(str(fields["session_id"]))
        requires = fields.get("requires", [])
        # A list of names, as every version writes it: anything else is a damaged file, not a later version's (a
        # string was read as its letters, each an unknown feature: the file left alone, its id 503 for ever).
        if not (isinstance(requires, list) and all(isinstance(name, str) for name in requires)):
            raise ValueError(f"requires is {str(requires)[:80]!r}, not a list of names")
        unknown = sorted(set(requires) - APP_FEATURES)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotError(f"{path.name}: service fields are unreadable ({exc!r})") from None
    if unknown:
        raise NewerRecord(f"{path.name}: written by a later version of wm-refiner: it requires {unknown[:5]}, which "
                          "this version would misread")
    if (expected_id is None and path.name != f"{session_id}{SUFFIX}") or expected_id not in (None, session_id):
        raise SnapshotError(f"{path.name}: holds session {session_id}, not the one its name says")
    return session_id


def record_generation(metadata: dict[str, str], name: str = "snapshot") -> int:
    """The lease generation a file was written under (0: written without one, before generations were recorded)."""
    value = metadata.get(GENERATION_KEY, "0")
    if not (value.isascii() and value.isdigit()):
        raise SnapshotError(f"{name}: {GENERATION_KEY} {value[:40]!r} is not a generation (a count)")
    return int(value)


@dataclass(frozen=True)
class FolderView:
    """What one listing of ``snapshot_dir`` saw: the sessions with a file and those with a lease file."""

    saved: frozenset[str]
    leased: frozenset[str]
    floored: frozenset[str] = frozenset()  # sessions with a floor marker (app.persistence.leases.FLOOR_SUFFIX)


def folder_view(folder: Path) -> FolderView:
    """One directory listing (``os.scandir``) of ``folder``: its cost is linear in the folder's size, whatever
    is then asked of it."""
    saved, leased, floored = set(), set(), set()
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(SUFFIX) and not name.startswith("."):
                    if spec.is_session_id(name[: -len(SUFFIX)]):
                        saved.add(name[: -len(SUFFIX)])
                elif (lease := leases.parse_name(name)) is not None:
                    leased.add(lease[0])
                elif (marked := leases.parse_floor_name(name)) is not None:
                    floored.add(marked)
    except FileNotFoundError:
        pass
    return FolderView(frozenset(saved), frozenset(leased), frozenset(floored))


def has_snapshot(folder: Path, session_id: str) -> bool:
    return snapshot_path(folder, session_id).is_file()


def _bytes_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.to(torch.uint8).contiguous().numpy().tobytes()
