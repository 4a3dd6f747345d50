"""Who owns a session's file in the shared snapshot folder: a lease per session, with fencing.

Only plain POSIX file operations, so that any shared folder works (a local disk, NFS, a ReadWriteMany volume):

- A lease is a file ``.<session>.session.lease.<generation>`` (generation: 10 digits or more) holding its owner's
  ``replica_id``. The session's current lease is the one of the highest generation. It is *live* while its
  modification time is less than ``session_lease_s`` old: the owner renews it by touching it (``os.utime``, which
  never creates a file) every ``session_lease_s / 3`` while it holds the session.
- **Taking** a lease: read the current one; when it is live and another replica's, the session is that replica's
  (``LeaseHeld``). Otherwise (none, expired, or this replica id's own from an earlier life) create generation + 1
  with ``os.link`` of a complete temporary file: the link fails when the name exists, so of several replicas
  racing for one generation exactly one gets it. Older generations are removed afterwards (a courtesy: only the
  highest counts).
- **Fencing**: before a checkpoint or a drain's snapshot is renamed into place, and at every renewal, the owner
  checks that its generation's file is still there and generation + 1 is not. A replica that lost its lease (it
  stalled past ``session_lease_s`` and another one took the session) has its write refused and drops its copy.
  Between that check and the rename there is a window of one ``rename`` call: a write that slips through it holds
  the same session at a later point of the same deterministic run, which the new owner's next checkpoint replaces.
- **Releasing**: the owner deletes its lease files (after a drain saved the session, when the session ended, or
  when an adoption gave the file back); the file is then adoptable at once, by generation 1 again. A lease
  nobody renewed for a session's retention past its expiry is a dead owner's (``abandoned_leases``): the
  store's sweep removes it.
- **Generations never go back** (``floor``): a session's file records the generation it was written under, and a
  small marker ``.<session>.session.generation`` holds the lowest generation a file of the session may carry: the
  generation of its last write (raised after each write's rename), or one past the last when the session ended.
  A lease taken later continues from there (generation = max(current lease, floor) + 1), so releasing a lease
  never restarts the count, and a reader refuses a file below the floor: an older copy put back into the folder
  (a restored backup, a stale replica's file, a copy kept by someone) is not loaded over the session's later
  state. The marker is written atomically (staged, renamed) and only ever raised. A writer of the folder that
  deletes it can still roll a session back to an older copy of its own: the folder's permissions are the control
  there (docs/reliability.md, the trust table).
- **Staging**: every temporary file of a write (the lease before its link, a session file and safetensors' own
  temporary beside it) is in a staging folder of that write, locked by its process (``staging``): a sweep removes
  the folders of dead processes whatever their names (``dead_staging``).

Expiry compares this machine's clock with the file's modification time (the file server's clock on NFS): the
replicas' clocks must agree to well within ``session_lease_s`` (NTP does). A time read from the folder is not
trusted: a lease never runs more than ``session_lease_s`` from now, and one dated further ahead than that is
expired (``remaining``).

No asyncio here: the store calls these on a worker thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from wm_refiner_client import spec

LEASE_INFIX = ".session.lease."
_DIGITS = 10


class LeaseHeld(Exception):
    """The session's lease is live and another replica's."""

    def __init__(self, session_id: str, owner: str, expires_in: float):
        super().__init__(f"session {session_id} is held by replica {owner!r} (its lease runs {expires_in:.1f} s more "
                         "unless renewed)")
        self.session_id = session_id
        self.owner = owner
        self.expires_in = expires_in


class LeaseLost(Exception):
    """This replica's lease on a session was taken by another replica (or released by it): writes are refused."""


@dataclass(frozen=True)
class Lease:
    session_id: str
    generation: int
    path: Path
    # What was there before: "none" (no lease: never leased, or released), "expired" (its owner stopped renewing:
    # it crashed or stalled, so the file may be a crash checkpoint its clients are ahead of), "self" (this
    # replica id's own, from an earlier life of it: also a crash).
    previous: str = "none"
    # The lowest generation a file of the session may carry, as the floor marker said when the lease was taken.
    floor: int = 0
    # This acquisition's own mark, written in the lease file: a generation can be taken again after a release that
    # wrote nothing (the count goes on from the floor), so the name alone does not say the file is still this one.
    token: str = ""


def lease_path(folder: Path, session_id: str, generation: int) -> Path:
    return folder / f".{spec.check_session_id(session_id)}{LEASE_INFIX}{generation:0{_DIGITS}d}"


def _generation_of(name: str, prefix: str) -> int | None:
    """The generation in a lease file's name, or None when ``name`` is not a lease of ``prefix``'s session. Any
    number of digits: generations are written with at least 10, and one past 9999999999 has 11 (a folder's files
    are not trusted to stay below it)."""
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix):]
    return int(tail) if tail.isdigit() and tail.isascii() else None


def generations(folder: Path, session_id: str) -> list[int]:
    """The session's lease generations present in ``folder``, lowest first. One session: a directory listing each
    call; a caller asking about many sessions takes ``leased`` once instead."""
    prefix = f".{spec.check_session_id(session_id)}{LEASE_INFIX}"
    found = []
    for path in folder.glob(f"{glob.escape(prefix)}*"):
        generation = _generation_of(path.name, prefix)
        if generation is not None:
            found.append(generation)
    return sorted(found)


def parse_name(name: str) -> tuple[str, int] | None:
    """(session id, generation) of a lease file's name; None for any other name (a staging file among them)."""
    if not name.startswith(".") or LEASE_INFIX not in name:
        return None
    session_id = name[1:].split(LEASE_INFIX, 1)[0]
    generation = _generation_of(name, f".{session_id}{LEASE_INFIX}")
    if generation is None or not spec.is_session_id(session_id):
        return None
    return session_id, generation


def leased(folder: Path) -> dict[str, list[int]]:
    """Every session with a lease file in ``folder`` and its generations (lowest first), from ONE directory
    listing: what a listing of many sessions asks, at a cost independent of how many it asks about."""
    found: dict[str, list[int]] = {}
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                parsed = parse_name(entry.name)
                if parsed is not None:
                    found.setdefault(parsed[0], []).append(parsed[1])
    except FileNotFoundError:
        return found
    for generation_list in found.values():
        generation_list.sort()
    return found


def _owner(path: Path) -> str | None:
    try:
        return str(json.loads(path.read_text())["owner"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return "?"  # unreadable: treated as someone else's until it expires


def remaining(mtime: float, now: float, lease_s: float) -> float:
    """Seconds a lease touched at ``mtime`` (a time read from the folder, so not trusted) runs unless renewed: never
    more than ``lease_s``. A time ahead of this clock by less than ``lease_s`` is clock skew (counted as touched
    now); one further ahead is no renewal any replica wrote (their clocks agree to well within ``lease_s``), so the
    lease is expired: a file dated 2040 must not hold a session, or a Retry-After, for 14 years."""
    if mtime > now + lease_s:
        return 0.0
    return max(0.0, lease_s - (now - min(mtime, now)))


def acquire(folder: Path, session_id: str, replica_id: str, lease_s: float, now: float | None = None) -> Lease:
    """Take the session's lease for ``replica_id``; ``LeaseHeld`` when another replica holds a live one (or won
    the race for the next generation)."""
    folder.mkdir(parents=True, exist_ok=True)
    current = generations(folder, session_id)
    floor = read_floor(folder, session_id)
    previous, generation = "none", 0
    if current:
        generation = current[-1]
        path = lease_path(folder, session_id, generation)
        owner = _owner(path)
        if owner is not None:  # None: released between the listing and now
            try:
                expires_in = remaining(path.stat().st_mtime, time.time() if now is None else now, lease_s)
            except FileNotFoundError:
                expires_in = 0.0
            if owner == replica_id:
                previous = "self"
            elif expires_in > 0:
                raise LeaseHeld(session_id, owner, expires_in)
            else:
                previous = "expired"
    # After a release (no lease file) the count goes on from the floor, never back to 1: a file written before
    # must stay below every later generation.
    generation = max(generation, floor)
    target = lease_path(folder, session_id, generation + 1)
    token = secrets.token_hex(16)
    with staging(folder, replica_id) as staged_in:  # a crash here leaves nothing a sweep cannot recognise
        staged = staged_in / target.name
        staged.write_text(json.dumps({"owner": replica_id, "session_id": session_id, "generation": generation + 1,
                                      "token": token}))
        try:
            os.link(staged, target)
        except FileExistsError:
            raise LeaseHeld(session_id, _owner(target) or "?", lease_s) from None
    for older in current:
        with contextlib.suppress(OSError):
            lease_path(folder, session_id, older).unlink()
    return Lease(session_id, generation + 1, target, previous, floor, token)


def held_elsewhere(folder: Path, session_id: str, replica_id: str, lease_s: float,
                   now: float | None = None) -> LeaseHeld | None:
    """The live lease another replica holds on the session (as ``acquire`` would refuse it), or None."""
    current = generations(folder, session_id)
    if not current:
        return None
    path = lease_path(folder, session_id, current[-1])
    owner = _owner(path)
    if owner is None or owner == replica_id:
        return None
    try:
        expires_in = remaining(path.stat().st_mtime, time.time() if now is None else now, lease_s)
    except FileNotFoundError:
        return None
    return LeaseHeld(session_id, owner, expires_in) if expires_in > 0 else None


def check(lease: Lease) -> None:
    """``LeaseLost`` unless ``lease`` is still the session's current one."""
    if not lease.path.exists():
        raise LeaseLost(f"the lease on session {lease.session_id} was released by another replica")
    if lease.token:
        try:
            token = json.loads(lease.path.read_text()).get("token")
        except FileNotFoundError:
            raise LeaseLost(f"the lease on session {lease.session_id} was released by another replica") from None
        except (ValueError, AttributeError):
            token = None
        except OSError:  # unreadable now (EIO, ESTALE): the name is all there is to go by, as before tokens
            token = lease.token
        if token != lease.token:  # the same generation, taken again by someone else after a release
            raise LeaseLost(f"session {lease.session_id} was taken over by replica {_owner(lease.path)!r} "
                            f"(generation {lease.generation} taken again)")
    successor = lease_path(lease.path.parent, lease.session_id, lease.generation + 1)
    if successor.exists():
        raise LeaseLost(f"session {lease.session_id} was taken over by replica {_owner(successor)!r}")


def renew(lease: Lease) -> None:
    """Touch the lease (``LeaseLost`` when it is no longer this replica's)."""
    check(lease)
    try:
        os.utime(lease.path)  # never creates the file: a lease deleted meanwhile stays deleted
    except FileNotFoundError:
        raise LeaseLost(f"the lease on session {lease.session_id} was released by another replica") from None


def release(folder: Path, session_id: str, lease: Lease | None = None) -> None:
    """Delete the session's lease files (``lease``: only if it is still the current one, so a replica that lost
    the session never deletes its successor's lease)."""
    if lease is not None:
        try:
            check(lease)
        except LeaseLost:
            return
    for generation in generations(folder, session_id):
        with contextlib.suppress(OSError):
            lease_path(folder, session_id, generation).unlink()


# --- the floor: the lowest generation a session's file may carry ------------------------------------------------------

FLOOR_SUFFIX = ".session.generation"


def floor_path(folder: Path, session_id: str) -> Path:
    return folder / f".{spec.check_session_id(session_id)}{FLOOR_SUFFIX}"


def read_floor(folder: Path, session_id: str) -> int:
    """The lowest generation a file of the session may carry (0: no marker, any file). An unreadable marker counts
    as none: it is no worse than a deleted one, and the next write replaces it."""
    try:
        value = json.loads(floor_path(folder, session_id).read_text())["floor"]
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return value if type(value) is int and value >= 0 else 0


def raise_floor(folder: Path, session_id: str, floor: int, replica_id: str) -> None:
    """Set the session's floor to ``floor`` unless it is at least that already (it never goes down): after a write
    under generation g, g (that file is the newest); after the session ended under g, g + 1 (no file of it may come
    back). Written staged and renamed into place, so a reader sees the old marker or the new one."""
    if read_floor(folder, session_id) >= floor:
        return
    target = floor_path(folder, session_id)
    with staging(folder, replica_id) as staged_in:
        staged = staged_in / target.name
        staged.write_text(json.dumps({"session_id": session_id, "floor": floor}))
        os.replace(staged, target)


def remove_floor(folder: Path, session_id: str) -> None:
    floor_path(folder, session_id).unlink(missing_ok=True)


def parse_floor_name(name: str) -> str | None:
    """The session id of a floor marker's name; None for any other name."""
    if not (name.startswith(".") and name.endswith(FLOOR_SUFFIX)):
        return None
    session_id = name[1 : -len(FLOOR_SUFFIX)]
    return session_id if spec.is_session_id(session_id) else None


# --- writes in progress: staging folders ------------------------------------------------------------------------------
#
# Every temporary file a replica makes in the shared folder (a lease being linked into place, a session file being
# written, and the one safetensors makes for itself beside it) lives in a staging folder of that one write,
# ``.staging.<replica_id>.<pid>.<random>/``, which the writing process holds an exclusive ``flock`` on until the
# write is over and the folder removed. The kernel (the NFS server, on NFS) drops the lock when the process dies,
# kill -9 included, so a sweep tells a dead writer's folder from a write in progress by trying the lock, whatever
# the folder's name; where the file system has no locks, by its age (``STALE_STAGING_S``).

STAGING_PREFIX = ".staging."
STALE_STAGING_S = 3600.0  # no write takes this long: a folder untouched this long has no write in progress


@contextlib.contextmanager
def staging(folder: Path, replica_id: str):
    """A fresh staging folder in ``folder`` for one write, locked while it runs and removed after it."""
    path = folder / f"{STAGING_PREFIX}{replica_id}.{os.getpid()}.{secrets.token_hex(4)}"
    path.mkdir(parents=True)
    with open(path / "lock", "w") as lock:
        with contextlib.suppress(OSError):  # no locks on this file system: the folder is judged by its age
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def _write_in_progress(path: Path, now: float, stale_after_s: float) -> bool:
    try:
        with open(path / "lock", "r") as lock:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True  # its writer holds it
            except OSError:
                pass  # no locks here: by age
            else:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
                return False  # its writer died (or is done and removing it)
    except FileNotFoundError:
        pass  # killed before it made its lock (or removed meanwhile): by age
    except OSError:
        return True
    try:
        newest = max([path.stat().st_mtime, *(p.stat().st_mtime for p in path.iterdir())])
    except OSError:
        return False  # removed meanwhile
    return now - newest < stale_after_s


def dead_staging(folder: Path, now: float, stale_after_s: float = STALE_STAGING_S) -> list[Path]:
    """Staging folders in ``folder`` whose write is over for good: their process died (the lock is free), or, where
    that cannot be told, nothing in them changed for ``stale_after_s``. Never a write in progress."""
    try:
        entries = [Path(entry.path) for entry in os.scandir(folder)
                   if entry.name.startswith(STAGING_PREFIX) and entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    return [path for path in entries if not _write_in_progress(path, now, stale_after_s)]


def remove_staging(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def abandoned_leases(folder: Path, now: float, lease_s: float, after_s: float) -> dict[str, list[int]]:
    """The leases in ``folder`` whose current generation nobody renewed for ``lease_s + after_s``, by session:
    their owner died (or stalled that long; it then finds its lease gone at its next renewal or write, as if taken
    over, and drops its copy). Under the default random ``replica_id`` a crashed replica's are never released."""
    found: dict[str, list[int]] = {}
    for session_id, generations_found in leased(folder).items():
        path = lease_path(folder, session_id, generations_found[-1])
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if remaining(mtime, now, lease_s) == 0 and (mtime > now or now - mtime > lease_s + after_s):
            found[session_id] = generations_found
    return found
