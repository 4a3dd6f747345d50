"""The service's one background round over its sessions: eviction by idle time, parking, and the folder sweep.

Every ``interval`` (half the shortest of the idle settings, at most 5 s): sessions past their retention (or
reattach grace, or TTL) are evicted (``Registry.evict_idle``), idle ones are parked, spilled or deleted
(``Parking.tick``), the cleanups of ended sessions that snapshot_dir could not take are tried again
(``app.sessions.endings.Endings.retry``), and now and then (every quarter retention, at least a minute)
``snapshot_dir`` is swept of what nobody will ask for (``app.persistence.sweeps.FolderSweep.expired_files``, on a
worker thread). Nothing moves while a drain runs: the drain saves the sessions as they stand, and evicting one would
not remove its snapshot.

A function of its collaborators (given by ``app.runtime.services``), not a method of the store: the store admits,
finds and ends sessions; deciding when idle ones go is this loop's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from app.core.settings import Settings
from app.persistence.sweeps import FolderSweep
from app.sessions.endings import Endings
from app.sessions.parking import Parking
from app.sessions.registry import Registry

log = logging.getLogger("app")


async def upkeep_forever(settings: Settings, registry: Registry, parking: Parking, endings: Endings,
                         sweep: FolderSweep, draining: Callable[[], bool]) -> None:
    """Evict, park / spill / delete, finish the cleanups of ended sessions and sweep, until cancelled.
    ``draining``: a drain is under way (nothing moves)."""
    interval = settings.upkeep_interval_s
    next_sweep = time.monotonic() + max(60.0, settings.retention_s / 4)  # start-up swept already
    while True:
        await asyncio.sleep(interval)
        if draining():
            # The sessions are saved as they stand; evicting them now would not remove their snapshots.
            continue
        evicted = registry.evict_idle()
        if evicted:
            log.info("evicted %d idle session(s)", len(evicted))
        try:
            await parking.tick()
        except Exception:  # parking is an optimisation: a failure must never stop eviction
            log.exception("parking sessions failed")
        await endings.retry()  # ended sessions whose file the folder could not fence off until now
        if time.monotonic() >= next_sweep:
            next_sweep = time.monotonic() + max(60.0, settings.retention_s / 4)
            await asyncio.to_thread(sweep.expired_files)
