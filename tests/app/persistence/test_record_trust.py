"""Files in snapshot_dir are not trusted as they are (issue 25 item 8).

With ``snapshot_signing_key`` a record that is edited, unsigned or signed with another key is refused as a corrupt
one is (moved aside, 404, one warning); without it nothing is signed or checked. An older copy of a session put
back into the folder is refused (410 naming it, the file set aside), never loaded over the session's later state.
Lease times and generations read from the folder: test_leases.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from app.persistence.leases import read_floor
from models.snapshot import SIGNATURE, SnapshotError, sign, verify

from tests.app.conftest import OCTET, make_clip, payload, running_app

KEY = "k" * 40
OTHER_KEY = "o" * 40


def _drained(make_settings, folder: Path, session_id: str | None = None, frames: int = 8, **settings) -> str:
    """A session with a sink and history (or, with ``session_id``, that session adopted back and given ``frames``
    more), written to ``folder`` by the app's drain. Returns its id."""
    latents, embeds, mask = make_clip(frames=16)
    with running_app(make_settings(snapshot_dir=folder, **settings)) as client:
        if session_id is None:
            session_id = client.post("/v1/sessions").json()["session_id"]
            body, seq = payload(latents[:, :, :frames], embeds, mask), 0
        else:
            seq = client.get(f"/v1/sessions/{session_id}").json()["next_seq"]
            body = payload(latents[:, :, 8 : 8 + frames])
        reply = client.post(f"/v1/sessions/{session_id}/chunks?seq={seq}", content=body, headers=OCTET)
        assert reply.status_code == 200, reply.text
    return session_id


def _record(folder: Path, session_id: str) -> Path:
    return folder / f"{session_id}.session.safetensors"


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
    return load_file(str(path)), metadata


def _edit_seed(path: Path) -> None:
    """Change the session's seed in the file's metadata, keeping everything else (its signature included)."""
    tensors, metadata = _read(path)
    config = json.loads(metadata["config"])
    config["seed"] += 1
    metadata["config"] = json.dumps(config)
    save_file(tensors, str(path), metadata=metadata)


def _adopted(client, session_id: str) -> int:
    return client.get(f"/v1/sessions/{session_id}").status_code


def test_a_signature_covers_metadata_and_every_tensor_byte():
    tensors = {"a": torch.randn(3, 4), "b": torch.zeros(0, dtype=torch.uint8), "c": torch.ones(5, dtype=torch.bfloat16)}
    signed = sign(KEY.encode(), tensors, {"format": "x", "seed": "1"})
    verify(KEY.encode(), tensors, signed)
    with pytest.raises(SnapshotError, match="another key"):
        verify(OTHER_KEY.encode(), tensors, signed)
    with pytest.raises(SnapshotError, match="edited"):
        verify(KEY.encode(), tensors, {**signed, "seed": "2"})
    flipped = {**tensors, "c": tensors["c"].clone()}
    flipped["c"].view(torch.uint8)[3] ^= 1  # one bit of one bfloat16
    with pytest.raises(SnapshotError, match="edited"):
        verify(KEY.encode(), flipped, signed)
    renamed = {"a2" if name == "a" else name: tensor for name, tensor in tensors.items()}
    with pytest.raises(SnapshotError, match="edited"):
        verify(KEY.encode(), renamed, signed)
    with pytest.raises(SnapshotError, match="unsigned"):
        verify(KEY.encode(), tensors, {"format": "x", "seed": "1"})


def test_with_a_signing_key_an_edited_or_foreign_record_is_refused_as_a_corrupt_one_is(make_settings, tmp_path,
                                                                                       caplog):
    folder = tmp_path / "snapshots"
    genuine = _drained(make_settings, folder, snapshot_signing_key=KEY)
    assert _read(_record(folder, genuine))[1][SIGNATURE].startswith("hmac-sha256:")
    edited = "edited-seed-1"
    shutil.copy(_record(folder, genuine), _record(folder, edited))
    tensors, metadata = _read(_record(folder, edited))
    fields = json.loads(metadata["app"])
    fields["session_id"] = edited
    metadata["app"] = json.dumps(fields)
    save_file(tensors, str(_record(folder, edited)), metadata=metadata)  # the id alone changed: no longer signed
    foreign = _drained(make_settings, folder, snapshot_signing_key=OTHER_KEY)  # another deployment's key
    seeded = _drained(make_settings, folder, snapshot_signing_key=KEY)
    _edit_seed(_record(folder, seeded))
    with caplog.at_level("WARNING", logger="app"):
        with running_app(make_settings(snapshot_dir=folder, snapshot_signing_key=KEY)) as client:
            for session_id in (edited, foreign, seeded):
                assert _adopted(client, session_id) == 404
                assert _adopted(client, session_id) == 404  # set aside: asked again, nothing more is read or logged
            assert _adopted(client, genuine) == 200
    for session_id in (edited, foreign, seeded):
        assert not _record(folder, session_id).exists()
        assert (folder / f"{session_id}.session.safetensors.corrupt").is_file()
    refusals = [r.message for r in caplog.records if "cannot be adopted" in r.message]
    assert len(refusals) == 3
    assert sum("signature does not match" in message for message in refusals) == 3
    assert KEY not in caplog.text and OTHER_KEY not in caplog.text


def test_a_signed_record_is_verified_and_built_off_the_engine_thread(make_settings, tmp_path, monkeypatch):
    """Verifying reads and hashes every byte of the file (~0.7 s per GiB, docs/benchmarks.md "Snapshot signing") and
    building the session copies its KV cache (gigabytes at 720p; on CUDA also locked, then sent on a side stream): an
    adoption does both on a worker thread, never on the engine thread that refines every other session's blocks; its
    first chunk after adoption is refined as usual."""
    import threading

    from app.persistence import records

    folder = tmp_path / "snapshots"
    session_id = _drained(make_settings, folder, snapshot_signing_key=KEY)
    verified_on: list[str] = []
    built_on: list[str] = []
    real_verify, real_build = records.verify, records.session_from_tensors

    def recording_verify(*args, **kwargs):
        verified_on.append(threading.current_thread().name)
        return real_verify(*args, **kwargs)

    def recording_build(*args, **kwargs):
        built_on.append(threading.current_thread().name)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(records, "verify", recording_verify)
    monkeypatch.setattr(records, "session_from_tensors", recording_build)
    latents, _, _ = make_clip(frames=16)
    with running_app(make_settings(snapshot_dir=folder, snapshot_signing_key=KEY)) as client:
        assert _adopted(client, session_id) == 200
        reply = client.post(f"/v1/sessions/{session_id}/chunks?seq=1", content=payload(latents[:, :, 8:11]),
                            headers=OCTET)
        assert reply.status_code == 200, reply.text
        engine_thread = client.app.state.services.engine._thread.name
    assert len(verified_on) == 1 and verified_on[0] != engine_thread == "refiner-engine"
    assert len(built_on) == 1 and built_on[0] != engine_thread, built_on


def test_with_a_signing_key_an_unsigned_record_is_refused(make_settings, tmp_path, caplog):
    folder = tmp_path / "snapshots"
    unsigned = _drained(make_settings, folder)  # written by a server without the key
    assert SIGNATURE not in _read(_record(folder, unsigned))[1]
    with caplog.at_level("WARNING", logger="app"):
        with running_app(make_settings(snapshot_dir=folder, snapshot_signing_key=KEY)) as client:
            assert _adopted(client, unsigned) == 404
            info = client.get("/v1/info").text
    assert (folder / f"{unsigned}.session.safetensors.corrupt").is_file()
    assert sum("unsigned" in r.message for r in caplog.records) == 1
    assert KEY not in info and "snapshot_signing_key" not in info


def test_without_a_signing_key_records_are_neither_signed_nor_checked(make_settings, tmp_path):
    """Today's behaviour: an edited file that still describes a valid session is loaded, and a signed one too."""
    folder = tmp_path / "snapshots"
    plain = _drained(make_settings, folder)
    assert SIGNATURE not in _read(_record(folder, plain))[1]
    _edit_seed(_record(folder, plain))
    signed = _drained(make_settings, folder, snapshot_signing_key=KEY)
    with running_app(make_settings(snapshot_dir=folder)) as client:
        assert _adopted(client, plain) == 200
        assert client.get(f"/v1/sessions/{plain}").json()["config"]["seed"] == 43  # the edit, loaded as it is
        assert _adopted(client, signed) == 200


def test_an_older_copy_of_a_session_put_back_is_refused_not_loaded(make_settings, tmp_path, caplog):
    """The issue's case: the session moved on (next_seq 2) after a copy of its file was kept (next_seq 1); the copy
    put back was loaded silently and the client's next chunk got 409. Now the copy is refused with 410 saying what
    happened, set aside for the operator, and the session's later state is never replaced by it."""
    folder = tmp_path / "snapshots"
    session_id = _drained(make_settings, folder)
    older = tmp_path / "kept-copy.safetensors"
    shutil.copy(_record(folder, session_id), older)
    assert read_floor(folder, session_id) == 1
    _drained(make_settings, folder, session_id, frames=4)  # adopted under generation 2, one more chunk, drained
    assert read_floor(folder, session_id) == 2
    assert json.loads(_read(_record(folder, session_id))[1]["app"])["next_seq"] == 2
    shutil.copy(older, _record(folder, session_id))  # put back over the newer file
    with caplog.at_level("WARNING", logger="app"):
        with running_app(make_settings(snapshot_dir=folder)) as client:
            for _ in range(2):
                refused = client.get(f"/v1/sessions/{session_id}")
                assert refused.status_code == 410, refused.text
                assert refused.json()["error"]["code"] == "session_evicted"
                assert "older copy" in refused.json()["error"]["message"]
            late = client.post(f"/v1/sessions/{session_id}/chunks?seq=2", content=payload(make_clip(frames=4)[0]),
                               headers=OCTET)
            assert late.status_code == 410
    assert (folder / f"{session_id}.session.safetensors.stale").read_bytes() == older.read_bytes()
    assert not _record(folder, session_id).exists()
    assert sum("older copy" in r.message for r in caplog.records) == 1


def test_a_copy_of_an_ended_session_put_back_is_refused(make_settings, tmp_path):
    """Deleted sessions do not come back either: ending raises the floor past the generation it ended under."""
    folder = tmp_path / "snapshots"
    session_id = _drained(make_settings, folder)
    copy = tmp_path / "kept-copy.safetensors"
    shutil.copy(_record(folder, session_id), copy)
    with running_app(make_settings(snapshot_dir=folder)) as client:
        assert _adopted(client, session_id) == 200
        assert client.delete(f"/v1/sessions/{session_id}").status_code == 204
    assert read_floor(folder, session_id) == 3  # adopted under 2, ended: nothing written under 2 or before counts
    shutil.copy(copy, _record(folder, session_id))
    with running_app(make_settings(snapshot_dir=folder)) as client:
        assert client.get(f"/v1/sessions/{session_id}").status_code == 410
    assert (folder / f"{session_id}.session.safetensors.stale").is_file()


def test_host_memory_that_cannot_take_a_saved_session_keeps_its_file(make_settings, tmp_path, monkeypatch):
    """Building an adopted session in host memory (locked, on CUDA) can fail for the machine's reasons (``ulimit
    -l``, host memory): that is 503 insufficient_memory and the file stays where it is, not moved aside as corrupt
    (its id would then be a 404 for ever); once memory is there, the same request adopts it."""
    from app.persistence import records
    from models.transfer import HostMemoryError

    folder = tmp_path / "snapshots"
    session_id = _drained(make_settings, folder, snapshot_signing_key=KEY)
    real_build = records.session_from_tensors

    def no_memory(*args, **kwargs):
        raise HostMemoryError("cudaHostRegister of 9663676416 bytes failed with CUDA error 2")

    monkeypatch.setattr(records, "session_from_tensors", no_memory)
    with running_app(make_settings(snapshot_dir=folder, snapshot_signing_key=KEY)) as client:
        refused = client.get(f"/v1/sessions/{session_id}")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "insufficient_memory", refused.text
        assert "cannot hold it in memory now" in refused.json()["error"]["message"]
        assert (folder / f"{session_id}.session.safetensors").is_file()
        assert not list(folder.glob("*.corrupt"))
        monkeypatch.setattr(records, "session_from_tensors", real_build)
        assert _adopted(client, session_id) == 200  # its lease was let go: the retry takes it


def test_a_file_holding_another_session_is_refused_before_it_is_read_or_built(make_settings, tmp_path, monkeypatch):
    """A session's file put under another id (or a foreign safetensors file) is refused from its header's fields,
    before its tensors are read and a session is built from them (at 720p: gigabytes read, hashed and copied for
    nothing); it is set aside as a corrupt file is."""
    import models.snapshot
    from app.persistence import records

    folder = tmp_path / "snapshots"
    session_id = _drained(make_settings, folder)
    shutil.copy(_record(folder, session_id), _record(folder, "copied-under-1"))
    save_file({"x": torch.zeros(2)}, str(_record(folder, "foreign-file-1")), metadata={"app": '{"format": "other"}'})
    reads, builds = [], []
    real_read, real_build = models.snapshot.load_file, records.session_from_tensors
    monkeypatch.setattr(models.snapshot, "load_file", lambda *a, **k: reads.append(a) or real_read(*a, **k))
    monkeypatch.setattr(records, "session_from_tensors", lambda *a, **k: builds.append(a) or real_build(*a, **k))
    with running_app(make_settings(snapshot_dir=folder)) as client:
        for refused in ("copied-under-1", "foreign-file-1"):
            assert _adopted(client, refused) == 404
            assert (folder / f"{refused}.session.safetensors.corrupt").is_file()
        assert reads == [] and builds == []
        assert _adopted(client, session_id) == 200  # the session's own file, under its own id
        assert len(reads) == 1 and len(builds) == 1


@pytest.mark.parametrize("later", ["requires", "format"])
def test_a_file_a_later_version_wrote_is_left_for_it_not_set_aside(make_settings, tmp_path, later):
    """A file that requires what this version does not know (or says a later format), as a newer replica sharing the
    folder during a rolling upgrade writes it, would be misread here: 503 server_busy naming why, the file stays
    where it is (not set aside as corrupt, which would make its id a 404 for ever) and its lease is let go; the same
    file without it is adopted. A file whose units were answered over HTTP says that it requires
    units_in_responses (an earlier reader would take them as streamed)."""
    folder = tmp_path / "snapshots"
    session_id = _drained(make_settings, folder)
    path = _record(folder, session_id)
    tensors, metadata = _read(path)
    fields = json.loads(metadata["app"])
    assert fields["requires"] == ["units_in_responses"] and fields["units_in_responses"]
    newer = dict(fields, requires=[*fields["requires"], "a-later-feature"]) if later == "requires" else \
        dict(fields, format="wm-refiner-app/2")
    save_file(tensors, str(path), metadata={**metadata, "app": json.dumps(newer)})
    with running_app(make_settings(snapshot_dir=folder)) as client:
        refused = client.get(f"/v1/sessions/{session_id}")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_busy", refused.text
        message = refused.json()["error"]["message"]
        assert "later version" in message and ("a-later-feature" in message or "wm-refiner-app/2" in message)
        assert path.is_file() and not list(folder.glob("*.corrupt"))
        save_file(tensors, str(path), metadata=metadata)  # as this version wrote it
        assert _adopted(client, session_id) == 200  # its lease was let go: the retry takes it


@pytest.mark.parametrize("requires", ["a-later-feature", [1], {"a-later-feature": True}, None])
def test_a_file_whose_requires_is_not_a_list_of_names_is_set_aside_as_corrupt(make_settings, tmp_path, requires):
    """Every version writes ``requires`` as a list of names: anything else is a damaged file, set aside as corrupt
    (its id then a 404), not a later version's left in place (a string was read as its letters, each an unknown
    feature: 503 server_busy for ever, retried by every client through the router)."""
    folder = tmp_path / "snapshots"
    session_id = _drained(make_settings, folder)
    path = _record(folder, session_id)
    tensors, metadata = _read(path)
    damaged = dict(json.loads(metadata["app"]), requires=requires)
    save_file(tensors, str(path), metadata={**metadata, "app": json.dumps(damaged)})
    with running_app(make_settings(snapshot_dir=folder)) as client:
        assert client.get(f"/v1/sessions/{session_id}").status_code == 404
        assert not path.exists() and list(folder.glob("*.corrupt"))
