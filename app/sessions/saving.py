"""A live session as the record the persistence layer writes (``app.persistence.records.SessionRecord``).

Read from the session's handle on the event loop (what it has sent, its seq, whether a stream held it); the record
itself is built later on the engine thread, where the last response may be encoded. Checkpoints, spills and the
drain all write this same record, so that any replica can adopt the file.
"""

from __future__ import annotations

import time
from typing import Callable

from app.engine.worker import wait_for
from app.outputs.delivery import Encoder
from app.outputs.replay import SentUnit
from app.persistence.records import SessionRecord
from app.sessions.registry import SessionHandle


def record_of(handle: SessionHandle, encoder: Encoder) -> Callable[[], SessionRecord]:
    """What saving ``handle`` writes, read now (on the loop); the returned function builds the record (on the
    engine thread: it may encode the last response)."""
    chunks = handle.chunks
    units = list(handle.retained)
    streaming = handle.streaming or handle.detached
    next_seq, last_seq, last_request = chunks.next_seq, chunks.last_seq, chunks.last_request
    realtime = handle.engine_session.pacing is not None

    def build() -> SessionRecord:
        # Paged in on a side stream and no work of it ran since: the engine's stream waits for those copies before
        # the record's device-to-host reads are queued on it (on the device; a no-op otherwise).
        wait_for(handle.engine_session)
        return SessionRecord(handle.id, handle.session, next_seq, last_seq, chunks.stored_response(), units, streaming,
                             encode=encode, outputs=handle.outputs, stages=handle.engine_session.stages,
                             created_at=handle.created_at, realtime=realtime, last_request=last_request)

    def encode(unit: SentUnit) -> bytes:
        return encoder.unit_bytes(unit.host, unit.outputs, time.perf_counter(), unit.metadata)

    return build
