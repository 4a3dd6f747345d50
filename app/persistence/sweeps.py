"""What is left in ``snapshot_dir`` that nobody will ask for: found and deleted by folder, with no session object.

Two sweeps, both on a worker thread (they list and delete files):

- at start-up (``FolderSweep.at_start``): writes that never reached their rename (temporary files this replica id
  left in an earlier life, and anyone's past ``STALE_TEMPORARY_S``), then the periodic sweep once;
- periodically (``FolderSweep.expired_files``, from ``app.sessions.upkeep``): session files nobody asked for within
  ``session_retention_s``, floor markers past their session's file by as long, dead writers' staging folders and
  leases unrenewed long past their expiry.

What this replica still tracks (a live session, or one it spilled: its own retention counts GETs) is not this
module's to judge: the store answers it (``tracked``, a callable given here), so the sweep needs nothing of the
session layer above it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from app.persistence import leases
from app.persistence.records import SUFFIX, folder_view, snapshot_path

log = logging.getLogger("app")

# A temporary file of another writer is left alone until it is this old: no write of a session takes that long,
# so it was abandoned (its writer crashed) rather than in progress on a live replica.
STALE_TEMPORARY_S = 3600.0


def leftover_temporaries(folder: Path, writer: str, now: float, stale_after_s: float = STALE_TEMPORARY_S
                         ) -> list[Path]:
    """The temporary files in ``folder`` a starting replica may delete: those ``writer`` (its replica id) left
    behind in an earlier life, and anyone's older than ``stale_after_s``. Never another live replica's write in
    progress."""
    found = []
    for path, marker in [*((p, f"{SUFFIX}.") for p in folder.glob(f".*{SUFFIX}.*.tmp")),
                         *((p, ".session.lease.") for p in folder.glob(".*.session.lease.*.tmp"))]:
        # .<id><marker>[<generation>.]<writer>.<random>.tmp; the random part has no dot, a writer may.
        rest = path.name.split(marker, 1)[1][: -len(".tmp")]
        if marker != f"{SUFFIX}.":
            rest = rest.split(".", 1)[-1]
        own = rest.rsplit(".", 1)[0] == writer
        try:
            old = now - path.stat().st_mtime > stale_after_s
        except FileNotFoundError:
            continue
        if own or old:
            found.append(path)
    return found


@dataclass(frozen=True)
class FolderSweep:
    """The sweeps of one replica's ``snapshot_dir`` (``folder``; None: no folder, nothing to sweep).

    ``replica_id``: whose temporaries are this replica's own; ``retention_s``: ``session_retention_s``, how long an
    unasked-for file is kept; ``lease_s``: ``session_lease_s``; ``tracked``: whether this replica holds the session
    (live, or spilled by it), whose file the sweep leaves to it. Every method blocks on the disk: call it on a
    worker thread once the service runs."""

    folder: Path | None
    replica_id: str
    retention_s: float
    lease_s: float
    tracked: Callable[[str], bool]

    def at_start(self) -> None:
        """Writes that never reached their rename are garbage: this replica id's own (from an earlier life) and
        anyone's older than ``STALE_TEMPORARY_S``; another live replica's write in progress is left alone. Then
        the periodic sweep. Nothing else is touched: sessions are adopted on their first request, by whichever
        replica the router sends it to."""
        folder = self.folder
        if folder is None or not folder.is_dir():
            return
        for leftover in leftover_temporaries(folder, self.replica_id, time.time()):
            leftover.unlink(missing_ok=True)  # names of writes before staging folders (leases.staging_dir)
        self.expired_files()

    def expired_files(self) -> list[str]:
        """Delete the session files in the folder nobody asked for within ``retention_s``: a session spilled or
        drained by a replica that then restarted (or went away) is past its retention as a live one would be. A
        file under a lease is a live session's checkpoint on some replica, and one this replica tracks (live, or
        spilled: its retention counts GETs too) is left to that; both are kept. Returns the ids. A file's age is
        its last use by any replica: a spill writes it, and each GET of the spilled session on the replica that
        spilled it sets its modification time (``Parking.record_use``), so a session polled there is never
        deleted here.

        What dead processes left goes too (``app.persistence.leases``): their staging folders (writes that never
        reached their rename), and leases nobody renewed for ``retention_s`` past their expiry (a crashed
        replica's: under the default random ``replica_id`` it never comes back to release them), with the
        session's file when that is past its retention too."""
        folder = self.folder
        if folder is None or not folder.is_dir():
            return []
        now = time.time()
        for staging in leases.dead_staging(folder, now):
            leases.remove_staging(staging)
        cutoff, forgotten = now - self.retention_s, []
        view = folder_view(folder)  # one listing: a folder of many files is not listed once per file
        # A lease unrenewed for a session's whole retention past its expiry: its owner would have ended the
        # session by now if it were alive (the owner of a live session renews its lease every third of it).
        dead = leases.abandoned_leases(folder, now, self.lease_s, self.retention_s)
        for session_id, generations in dead.items():
            if session_id not in view.saved:
                for generation in generations:  # only these: a successor taken meanwhile stays
                    with contextlib.suppress(OSError):
                        leases.lease_path(folder, session_id, generation).unlink()
        # A floor marker outlives its session's file by a retention (it keeps an ended session's copies from coming
        # back); then it goes, as the file would have.
        for session_id in sorted(view.floored - view.saved - view.leased):
            if self.tracked(session_id):
                continue
            marker = leases.floor_path(folder, session_id)
            with contextlib.suppress(OSError):
                if marker.stat().st_mtime < cutoff:
                    marker.unlink()
        for session_id in sorted((view.saved - view.leased) | (view.saved & dead.keys())):
            if self.tracked(session_id):
                continue
            path = snapshot_path(folder, session_id)
            try:
                if path.stat().st_mtime >= cutoff:
                    continue
                path.unlink()
            except OSError:  # gone meanwhile (adopted, removed by its owner): nothing to forget
                continue
            for generation in dead.get(session_id, ()):
                with contextlib.suppress(OSError):
                    leases.lease_path(folder, session_id, generation).unlink()
            with contextlib.suppress(OSError):
                leases.remove_floor(folder, session_id)
            forgotten.append(session_id)
        if forgotten:
            log.info("deleted %d session file(s) of snapshot_dir past session_retention_s", len(forgotten))
        return forgotten
