"""A session as its clients see it in JSON: its line in ``GET /v1/sessions`` (``summary``) and its description in
``GET /v1/sessions/{id}`` (``description``), for a live session (its ``SessionHandle``) or a spilled one
(``Spilled``: what it was when it was written to snapshot_dir, api.md 1.1).

Plain functions over a handle, kept out of the handle: the handle is the session's state, these are one way of
showing it, and a field added to a response is one edit here. Read on the event loop; no tensor is touched (the
numbers come from the session's immutable ``SessionState`` and ``app.sessions.footprint``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from app.engine import pacing
from app.outputs.catalog import describe
from app.sessions.footprint import handle_bytes
from app.sessions.registry import SessionHandle

# A spilled session's parts that were allocated while it was live: nothing of them is here now (its file holds them).
_HELD_FIELDS = ("kv_cache_bytes", "video_state_bytes", "cache_bytes", "pending_bytes")


@dataclass
class Spilled:
    """A session written to snapshot_dir and dropped from memory (``app.sessions.parking``): what the listing and GET
    report of it until it is adopted back (by this replica or another) or its retention ends."""

    session_id: str
    summary_fields: dict[str, Any]
    description: dict[str, Any]
    created_at: float
    last_active: float  # registry clock
    file_bytes: int
    # The file's inode when this replica spilled it: a file of the same name with another inode was written since
    # by another replica (it adopted the session and spilled it again): no longer this replica's spill.
    file_inode: int | None = None

    @property
    def id(self) -> str:
        return self.session_id


def spilled(handle: SessionHandle, file_bytes: int, file_inode: int | None = None) -> Spilled:
    """What the listing and GET will show of ``handle`` once it is spilled to a file of ``file_bytes``: its views as
    they stand now (read on the loop, right before the handle is dropped)."""
    return Spilled(handle.id, summary(handle), description(handle), handle.created_at, handle.last_active, file_bytes,
                   file_inode)


def summary(entry: SessionHandle | Spilled) -> dict[str, Any]:
    """Its line in ``GET /v1/sessions``."""
    if isinstance(entry, Spilled):
        return {**entry.summary_fields, "state": "spilled", "bytes": {"device": 0, "host": 0, "disk": entry.file_bytes}}
    handle, state = entry, entry.session.state
    return {
        "session_id": handle.id,
        "created_at": iso_time(handle.created_at),
        "last_active_at": iso_time(handle.last_active_wall),
        "frames_received": state.frames_received,
        "frames_returned": state.frames_returned,
        "flushed": state.flushed,
        "streaming": handle.streaming,
        "outputs": list(handle.outputs.kinds),
        "watchers": len(handle.watchers),
        "state": handle.memory_state,
        "bytes": {**{k: v for k, v in handle_bytes(handle).items() if k != "parts"}, "disk": 0},
        "realtime": handle.engine_session.pacing is not None,
        "late_blocks": pacing.status(handle.engine_session)["late_blocks"],
    }


def description(entry: SessionHandle | Spilled) -> dict[str, Any]:
    """``GET /v1/sessions/{id}``."""
    if isinstance(entry, Spilled):
        # What it held is in its file now; nothing of it is allocated here.
        held = {name: 0 for name in _HELD_FIELDS if name in entry.description}
        return {**entry.description, **held, "state": "spilled",
                "bytes": {"device": 0, "host": 0, "disk": entry.file_bytes, "parts": {}}}
    handle, state = entry, entry.session.state
    return {
        "session_id": handle.id,
        "config": {**handle.config.to_dict(), **handle.outputs.to_dict(), **pacing.flags_of(handle)},
        "frames_received": state.frames_received,
        "frames_returned": state.frames_returned,
        "pending_frames": state.pending_frames,
        "history_frames": state.history_frames,
        "blocks_refined": state.blocks_refined,
        "flushed": state.flushed,
        "next_seq": handle.chunks.next_seq,
        "kv_cache_bytes": handle.session.cache_bytes,
        # What the output stages hold and where they stand (video: its decoder's state, frames returned), and
        # everything together: what the session holds.
        **describe(handle.engine_session.stages),
        "cache_bytes": handle.cache_bytes,
        # A realtime session's deadlines: blocks committed late, the last and worst lateness (s; < 0: early).
        **pacing.status(handle.engine_session),
        "watchers": len(handle.watchers),
        "pending_bytes": state.pending_bytes,
        "streaming": handle.streaming,
        "detached": handle.detached,
        # The earliest frame a reattaching stream can ask for again (resume_from).
        "resumable_from": handle.retained.first_frame(state.frames_returned),
        **({} if handle.durable_frames is None else {"durable_frames": handle.durable_frames}),
        "created_at": iso_time(handle.created_at),
        "last_active_at": iso_time(handle.last_active_wall),
        # Where it is (app.sessions.parking) and what it holds there, by part (app.sessions.footprint).
        "state": handle.memory_state,
        "bytes": {**handle_bytes(handle), "disk": 0},
    }


def iso_time(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()
