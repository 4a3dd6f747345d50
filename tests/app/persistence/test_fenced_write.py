"""The one write of a session's file (``app.persistence.records.write_fenced``, issue 24 item 2): under the
session's lease, fenced by it; a checkpoint, a spill and a drain all write through it."""

from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import load_file

from app.persistence.leases import LeaseHeld, LeaseLost, acquire, check, generations
from app.persistence.records import snapshot_path, write_fenced

TENSORS = {"kv": torch.arange(6, dtype=torch.float32)}
META = {"app": "{}"}


def test_without_a_lease_the_write_takes_one_and_keeps_it(tmp_path):
    held, path = write_fenced(tmp_path, "fenced-session", TENSORS, META, lease=None, replica_id="replica-a",
                              lease_s=30.0)
    assert path == snapshot_path(tmp_path, "fenced-session") and path.is_file()
    assert torch.equal(load_file(path)["kv"], TENSORS["kv"])
    check(held)  # the caller holds it now: still the session's current lease
    assert generations(tmp_path, "fenced-session") == [held.generation]
    # Written again under the lease it holds: no new generation is taken.
    again, _ = write_fenced(tmp_path, "fenced-session", {"kv": torch.ones(2)}, META, lease=held,
                            replica_id="replica-a", lease_s=30.0)
    assert again is held and generations(tmp_path, "fenced-session") == [held.generation]
    assert torch.equal(load_file(path)["kv"], torch.ones(2))


def test_release_lets_go_of_the_lease_once_the_file_is_in_place(tmp_path):
    held, path = write_fenced(tmp_path, "drained-session", TENSORS, META, lease=None, replica_id="replica-a",
                              lease_s=30.0, release=True)
    assert path.is_file() and generations(tmp_path, "drained-session") == []
    with pytest.raises(LeaseLost):
        check(held)
    # Adoptable at once by any replica: nobody holds it.
    assert acquire(tmp_path, "drained-session", "replica-b", lease_s=30.0).previous == "none"


def test_another_replicas_live_lease_refuses_the_write(tmp_path):
    acquire(tmp_path, "owned-session", "replica-b", lease_s=30.0)
    with pytest.raises(LeaseHeld, match="replica-b"):
        write_fenced(tmp_path, "owned-session", TENSORS, META, lease=None, replica_id="replica-a", lease_s=30.0)
    assert not snapshot_path(tmp_path, "owned-session").exists()


def test_a_lost_lease_fences_the_write_and_leaves_the_new_owners_file(tmp_path):
    mine, path = write_fenced(tmp_path, "moved-session", TENSORS, META, lease=None, replica_id="replica-a",
                              lease_s=30.0)
    # This replica stalled past its lease; another took the session over and wrote its own file.
    os.utime(mine.path, (time.time() - 31, time.time() - 31))
    theirs, _ = write_fenced(tmp_path, "moved-session", {"kv": torch.ones(3)}, META, lease=None,
                             replica_id="replica-b", lease_s=30.0)
    assert theirs.generation == mine.generation + 1
    with pytest.raises(LeaseLost):
        write_fenced(tmp_path, "moved-session", TENSORS, META, lease=mine, replica_id="replica-a", lease_s=30.0)
    assert torch.equal(load_file(path)["kv"], torch.ones(3))  # the stale owner never overwrote it
    check(theirs)
