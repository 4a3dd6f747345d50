"""The folder sweeps on their own (``app.persistence.sweeps``): no server, no session object, only a folder and
what the replica says it tracks."""

from __future__ import annotations

import os
import time

import pytest

from app.persistence.leases import acquire, generations
from app.persistence.sweeps import FolderSweep
from tests.app.conftest import running_app


def _file(folder, session_id: str, age_s: float) -> None:
    path = folder / f"{session_id}.session.safetensors"
    path.write_bytes(b"not read: the sweep goes by names and ages")
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_the_sweep_deletes_only_old_unleased_files_the_replica_does_not_track(tmp_path):
    """Past retention and neither leased nor tracked: deleted and returned. Recent, tracked (live or spilled here)
    or under a live lease: kept, whatever its age."""
    _file(tmp_path, "old-session-1", 120.0)
    _file(tmp_path, "recent-session-1", 1.0)
    _file(tmp_path, "tracked-session-1", 120.0)
    _file(tmp_path, "leased-session-1", 120.0)
    lease = acquire(tmp_path, "leased-session-1", "replica-a", lease_s=30.0)
    asked: list[str] = []

    def tracked(session_id: str) -> bool:
        asked.append(session_id)
        return session_id == "tracked-session-1"

    sweep = FolderSweep(tmp_path, "replica-b", retention_s=60.0, lease_s=30.0, tracked=tracked)
    assert sweep.expired_files() == ["old-session-1"]
    assert sorted(p.name for p in tmp_path.glob("*.session.safetensors")) == [
        "leased-session-1.session.safetensors", "recent-session-1.session.safetensors",
        "tracked-session-1.session.safetensors"]
    assert "tracked-session-1" in asked and "leased-session-1" not in asked, asked
    assert generations(tmp_path, "leased-session-1") == [lease.generation]


def test_at_start_removes_this_replicas_leftover_temporaries_then_sweeps(tmp_path):
    ours = tmp_path / ".some-session-1.session.safetensors.replica-b.k2j4h1.tmp"
    theirs = tmp_path / ".some-session-2.session.safetensors.replica-a.x9q8w7.tmp"
    for path in (ours, theirs):
        path.write_bytes(b"partial")
    _file(tmp_path, "old-session-1", 120.0)
    FolderSweep(tmp_path, "replica-b", retention_s=60.0, lease_s=30.0, tracked=lambda _: False).at_start()
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name]


def test_no_folder_or_a_missing_one_is_nothing_to_sweep(tmp_path):
    assert FolderSweep(None, "replica-b", 60.0, 30.0, tracked=lambda _: False).expired_files() == []
    FolderSweep(tmp_path / "absent", "replica-b", 60.0, 30.0, tracked=lambda _: False).at_start()
    assert not (tmp_path / "absent").exists()


def test_a_session_this_replica_ended_does_not_stop_the_sweep(make_settings, tmp_path):
    """An id the registry remembers as evicted (410 to its clients) is not held here: its old file is swept, and
    the pass goes on to the others (asking about it used to raise the 410 and end the pass)."""
    folder = tmp_path / "snapshots"
    with running_app(make_settings(snapshot_dir=folder, session_retention_s=60.0)) as client:
        services = client.app.state.services
        folder.mkdir(exist_ok=True)
        services.registry.mark_evicted("ended-session-1", "a test")
        _file(folder, "ended-session-1", 120.0)
        _file(folder, "other-session-1", 120.0)
        assert sorted(services.sweep.expired_files()) == ["ended-session-1", "other-session-1"]
        assert not list(folder.glob("*.session.safetensors"))


def test_a_snapshot_folder_on_a_case_insensitive_file_system_is_refused(tmp_path, monkeypatch):
    """Session ids differ by case; on a case-insensitive file system two of them would share one file (one session's
    spill overwriting the other's): refused at start-up, saying where to put it. The probe leaves nothing behind."""
    import pathlib

    from app.persistence.records import check_snapshot_folder

    folder = tmp_path / "snapshots"
    check_snapshot_folder(folder)  # made, written to, and this test machine's file system tells case apart
    assert folder.is_dir() and list(folder.iterdir()) == []
    real_exists = pathlib.Path.exists

    def case_blind(path, *args, **kwargs):  # what a case-insensitive volume answers for the probe's other case
        return real_exists(path.parent / path.name.lower(), *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "exists", case_blind)
    with pytest.raises(OSError, match="case-insensitive file system.*put it on a case-sensitive file system"):
        check_snapshot_folder(folder)
    monkeypatch.setattr(pathlib.Path, "exists", real_exists)
    assert list(folder.iterdir()) == []
