"""A drain's part in the session layer: settle every live session, then save each to ``snapshot_dir``.

``app.runtime.services`` runs the drain (stop admitting, let work finish, pause the engine, then these two, then
close the connections); these are the steps that read the sessions. Functions of their collaborators, given
explicitly: the drain happens once per process and keeps no state of its own.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Callable

from app.core.settings import Settings
from app.engine.worker import Engine
from app.outputs.delivery import Encoder
from app.persistence.leases import Lease, LeaseHeld, LeaseLost
from app.persistence.records import record_tensors, write_fenced
from app.sessions.parking import Parking
from app.sessions.registry import Registry, SessionHandle
from app.sessions.saving import record_of

log = logging.getLogger("app")


async def settle(registry: Registry, parking: Parking) -> list[SessionHandle]:
    """Once the engine is paused: every committed unit delivered (so retained; an HTTP response's too), and no
    checkpoint write still in flight (it must not land after, and over, the drain's snapshot). Returns the live
    sessions."""
    handles = registry.handles()
    await asyncio.gather(*(h.deliveries.flush() for h in handles if h.deliveries is not None),
                         *(h.retaining for h in handles if h.retaining is not None), return_exceptions=True)
    await parking.settle()  # parked sessions' copies to the host complete before they are read
    writes = [h.checkpoint_write for h in handles if h.checkpoint_write is not None]
    if writes:
        await asyncio.wait(writes)
    return handles


async def save_all(handles: list[SessionHandle], *, folder: Path | None, settings: Settings, engine: Engine,
                   encoder: Encoder, leases_held: dict[str, Lease], saving: set[str],
                   lose: Callable[[SessionHandle, BaseException], None]) -> set[str]:
    """Write every session of ``handles`` to ``folder`` (snapshot_dir; none when None), on the engine thread
    (paused by now, so no forward can run while a session is read), each under its lease in ``leases_held`` (the
    store's table: a saved session's lease is released and leaves it). Their ids are in ``saving`` (the lease
    renewal's: ``Checkpoints.saving``) while they are written, since each lease is let go of as its session is
    written and the table forgets them once all are, so the renewal does not drop one of them: a session found to
    be another replica's now (its write refused) is dropped here instead (``lose``: its clients are sent to its
    new owner, not told to come back here). Returns the ids written."""
    if folder is None:
        return set()
    # The service's fields that live on the loop are read here, on the loop.
    records = {handle.id: record_of(handle, encoder) for handle in handles}
    held = dict(leases_held)

    lost: dict[str, BaseException] = {}

    def write_all() -> set[str]:
        written = set()
        for session_id, record in records.items():
            try:
                tensors, metadata = record_tensors(record())
                # Released at once: the next replica asked for it adopts it without waiting for the lease.
                write_fenced(folder, session_id, tensors, metadata, lease=held.get(session_id),
                             replica_id=settings.replica_id, lease_s=settings.session_lease_s,
                             key=settings.signing_key, release=True)
            except (LeaseHeld, LeaseLost) as exc:
                log.warning("drain: session %s is another replica's now (%s); not saved", session_id, exc)
                lost[session_id] = exc
                continue
            except Exception:  # one session that cannot be saved must not cost the others
                log.exception("drain: could not save session %s", session_id)
                continue
            written.add(session_id)
        return written

    saving.update(records)
    try:
        written = await engine.call(write_all)
    except Exception:
        log.exception("drain: saving sessions to %s failed", folder)
        return set()
    finally:
        saving.difference_update(records)
    for session_id in written:
        leases_held.pop(session_id, None)
    for handle in handles:
        if handle.id in lost and leases_held.get(handle.id) is held.get(handle.id):  # not ended meanwhile
            lose(handle, lost[handle.id])
    log.info("drain: saved %d of %d session(s) to %s", len(written), len(handles), folder)
    return written
