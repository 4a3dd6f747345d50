"""Ended sessions whose file in ``snapshot_dir`` is not fenced off and removed yet: ends no request waits for.

A session that ends must never be adopted back from its file (its last checkpoint, or its spill): its floor goes up
past the generation of that file (``app.persistence.leases.raise_floor``, so that no reader loads it, even put
back), then the file goes, then its lease. A DELETE that cannot raise the floor is refused (503 server_busy,
``SessionStore.delete``); a session that ends without a request (evicted after session_retention_s, a reconnect
window or a finished session's TTL; a spilled session past its retention: ``Parking.expire_spilled``) has nobody
to refuse. Such an end is remembered here (``end``) from the moment it happens: until its cleanup (``settle``) is
done its id is refused as an ended session's (``refusal``: ``SessionStore.lookup`` asks before it adopts a file, and
again once it holds the lease), and a cleanup that failed (the folder read-only, full, gone) is tried again at every
round of the upkeep timer (``retry``, ``app.sessions.upkeep``) until the folder takes it. Every file-system call is on
a worker thread: a stalled network volume stalls the cleanup, never the event loop.

The memory is this process's only, a decision. A marker in snapshot_dir cannot be the answer: what failed is a
write to that folder, and the marker's write would fail with the floor's; a marker anywhere else would be a second
store that other replicas (asked for the same id) do not read either. So what a restart of the replica loses, while
a cleanup is pending, is the refusal: the file stays as the session's last checkpoint or spill left it, under no
raised floor, and a request for its id (here after the restart, or on another replica, once the folder can be
written: adopting takes a lease, a write) adopts the session back at that point, as after a crash of the replica
that held it (``from_checkpoint``). That costs the session's end (its data outlives it until it ends again, and a
client asking for it gets it back instead of a 410), not its integrity: the adopter holds it under a new lease, and
no second copy of it runs. It takes a restart (or another replica's request) while the folder cannot be written;
while this process lives, the next round after the folder recovers fences the file. The same holds for the one
race left: another replica that adopts the file in the moment between the folder's recovery and that round holds
the session (its lease is later than the ended session's), and the cleanup leaves it to it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from app.core.error_kinds import ApiError
from app.core.tasks import in_thread, outlast
from app.persistence import leases
from app.persistence.leases import Lease, LeaseLost
from app.persistence.records import remove_record

log = logging.getLogger("app")


@dataclass(eq=False)
class _Ending:
    """One ended session's cleanup."""

    generation: int  # the generation of its last file: its lease's, or, spilled, the floor its spill left
    lease: Lease | None  # this replica's lease on it (a spilled session holds none), released once the file is gone
    answer: ApiError  # what its id answers until the cleanup is done (410 session_evicted, 404 once deleted)
    fenced: bool = False  # its floor is up: no reader loads its file any more; only the removal is left
    attempt: asyncio.Future | None = None  # the worker thread trying the cleanup now
    tries: int = 0  # attempts done: only the first failure is logged


class Endings:
    def __init__(self, folder: Path | None, replica_id: str):
        """``folder``: snapshot_dir (None: no files, nothing to end); ``replica_id``: whose staging folders."""
        self.folder = folder
        self.replica_id = replica_id
        self.pending: dict[str, _Ending] = {}

    def refusal(self, session_id: str) -> ApiError | None:
        """What ``session_id`` answers while its cleanup is pending (None: none is), as it was answered when it
        ended."""
        ending = self.pending.get(session_id)
        if ending is None:
            return None
        answer = ending.answer
        return ApiError(answer.kind, answer.message, answer.retry_after_s, answer.fields)

    def end(self, session_id: str, generation: int, lease: Lease | None, answer: ApiError) -> None:
        """The session ended: its id answers as ``answer`` says from now on, until ``settle`` raised its floor past
        ``generation``, removed its file and released ``lease``."""
        if self.folder is not None:
            self.pending[session_id] = _Ending(generation, lease, answer)

    async def settle(self, session_id: str) -> None:
        """Try the cleanup of the ended session ``session_id`` (none pending, or one being tried: nothing to do), on
        a worker thread seen to its end through a cancellation. A folder that cannot take it now leaves it pending,
        for ``retry``."""
        ending = self.pending.get(session_id)
        if ending is not None and ending.attempt is None:
            await self._attempt(session_id, ending, first=ending.tries == 0)

    async def retry(self) -> None:
        """Every pending cleanup tried again (one not already being tried), one after another."""
        for session_id in list(self.pending):
            await self.settle(session_id)

    async def _attempt(self, session_id: str, ending: _Ending, first: bool) -> None:
        ending.attempt = attempt = in_thread(self._clean, session_id, ending)
        cancelled = await outlast(attempt)
        ending.attempt, ending.tries = None, ending.tries + 1
        error = attempt.exception()
        if error is None or isinstance(error, LeaseLost):
            if isinstance(error, LeaseLost):
                log.info("session %s ended here but another replica holds it now (%s): its file is that replica's",
                         session_id, error)
            elif not first:
                log.info("session %s ended earlier: its file in %s is fenced off and removed now", session_id,
                         self.folder)
            if self.pending.get(session_id) is ending:
                del self.pending[session_id]
        elif first:  # later failures of the same cleanup say nothing new
            log.warning("session %s ended; fencing off and removing its file in %s failed (%r): its id is refused "
                        "meanwhile and the cleanup is tried again at every round of the timer", session_id,
                        self.folder, error)
        if cancelled:
            raise asyncio.CancelledError

    def _clean(self, session_id: str, ending: _Ending) -> None:
        """On a worker thread: the floor, the file, the lease, in that order (nobody may see the file gone and the
        floor not yet raised; a lease let go of before the floor is up would let another replica adopt the file).
        ``LeaseLost`` when another holder took the id since it ended (another replica adopted its file, or it was
        created again): its files are that holder's."""
        folder, generation = self.folder, ending.generation
        if not ending.fenced:
            if ending.lease is not None:
                leases.check(ending.lease)
            elif leases.generations(folder, session_id) or leases.read_floor(folder, session_id) > generation:
                # A spilled session holds no lease: a lease now, or a file written under a later generation than
                # its own, is another holder's.
                raise LeaseLost(f"session {session_id} was taken by another holder after it ended")
            try:
                leases.raise_floor(folder, session_id, generation + 1, self.replica_id)
            except OSError:
                # A full folder cannot take the floor, but the file it fences can go first: left in place it keeps
                # the folder full, and is adoptable once the folder has room; its removal frees the space the floor
                # then takes. (A read-only folder refuses the removal too: pending, tried again.)
                remove_record(folder, session_id)
                leases.raise_floor(folder, session_id, generation + 1, self.replica_id)
            ending.fenced = True  # read by the next attempt only, which begins after this one ended
        elif (any(later > generation + 1 for later in leases.generations(folder, session_id))
              or leases.read_floor(folder, session_id) > generation + 1):
            # Its lease may be gone already (let go of below): a holder since the floor went up is past the floor.
            raise LeaseLost(f"session {session_id} was taken by another holder after it ended")
        try:
            remove_record(folder, session_id)
        finally:  # the floor is up: nobody adopts its file, whoever holds the id next
            if ending.lease is not None:
                leases.release(folder, session_id, ending.lease)
