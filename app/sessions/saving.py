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
    engine thread: it may encode the last response).

    The chunk log's counters are read here, its response and the session's tensors there, later: in between, no
    chunk of the session may be accepted or run on the engine, or the file would pair ``last_seq`` with another
    chunk's response, or hold frames ``next_seq`` does not count. None of the callers lets that happen:

    - ``Checkpoints.write_due`` runs within the session's chunk turn (``ChunkLog.turn``). Every HTTP chunk and stream
      message holds that turn from its seq check through its forward and ``accept_request`` / ``accept_message``
      to ``store``, so the chunk it follows is counted and stored, and the next one waits for the turn.
    - ``Parking.spill`` holds ``handle.moving`` and found the session parked and idle (no turn held or awaited,
      nothing queued or running on the engine), so no chunk is between its forward and its acceptance; one that
      comes later waits in ``Parking.activate`` for ``moving`` before its work reaches the engine.
    - ``drain.save_all`` runs once the engine is paused (no forward runs, no work is taken). A chunk whose forward
      was done before the pause had its result sent to the loop before the pause's (both from the engine thread,
      in order, by ``call_soon_threadsafe``), so it ran before the drain went on, and it counts itself
      (``accept_request``) before its first await; one the pause stopped is rolled back and not counted.

    What may still happen in between is that chunk's response being stored (``ChunkLog.store``); one not stored yet
    is built here by its own builder, which returns the bytes its client gets (``Encoder.response``).
    ``test_lifecycle_races.py`` holds each caller at this point while the next chunk comes."""
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
