"""A saved session keeps the request of its last ``seq`` with the stored response (``app.core.chunk_request``): a
retry after a drain and adoption is recognised as one, another request under that seq is 409 there too; a file
written before requests were recorded is still adopted and replays a repeat as it did then."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from app.core.chunk_request import ChunkRequest
from tests.app.conftest import OCTET, make_clip, payload, running_app, wait_until

LATENTS, EMBEDS, MASK = make_clip(frames=12)
FIRST = payload(LATENTS[:, :, :5], EMBEDS, MASK)  # seq 0: the sink and block [1, 4); frame 4 pending


def _drained_after_first_chunk(make_settings, folder: Path) -> tuple[str, bytes]:
    """A session that took seq 0 (``FIRST``), written to ``folder`` by the app's drain: its id and seq 0's answer."""
    with running_app(make_settings(snapshot_dir=folder)) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        reply = client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=FIRST, headers=OCTET)
        assert reply.status_code == 200, reply.text
    return session_id, reply.content


def _state(client, session_id: str) -> dict:
    state = client.get(f"/v1/sessions/{session_id}").json()
    return {key: state[key] for key in ("frames_received", "frames_returned", "pending_frames", "next_seq", "flushed")}


def test_an_adopted_session_refuses_another_request_under_its_last_seq(make_settings, tmp_path):
    folder = tmp_path / "snapshots"
    session_id, answer = _drained_after_first_chunk(make_settings, folder)
    with running_app(make_settings(snapshot_dir=folder)) as client:
        url = f"/v1/sessions/{session_id}/chunks"
        before = _state(client, session_id)  # adopted here
        assert before["next_seq"] == 1
        other = client.post(url, params={"seq": 0, "flush": "true"}, content=FIRST, headers=OCTET)
        assert other.status_code == 409 and other.json()["error"]["code"] == "seq_conflict", other.status_code
        assert "flush=true where it had flush=false" in other.json()["error"]["message"]
        other = client.post(url, params={"seq": 0}, content=payload(LATENTS[:, :, 5:8]), headers=OCTET)
        assert other.status_code == 409 and "a body of" in other.json()["error"]["message"], other.status_code
        assert _state(client, session_id) == before
        retry = client.post(url, params={"seq": 0}, content=FIRST, headers=OCTET)
        assert retry.headers.get("x-replayed") == "true" and retry.content == answer
        assert _state(client, session_id) == before


def test_a_file_saved_without_the_request_is_adopted_and_replays_its_last_seq_as_before(make_settings, tmp_path):
    """Unknown request (a file written before requests were recorded): a repeat of the last seq gets the stored
    answer, whatever it holds, as it did when the file was written; the file is not refused."""
    folder = tmp_path / "snapshots"
    session_id, answer = _drained_after_first_chunk(make_settings, folder)
    path = folder / f"{session_id}.session.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
    fields = json.loads(metadata["app"])
    assert fields["last_request"]["flush"] is False and fields["last_request"]["bytes"] == len(FIRST)
    del fields["last_request"]
    metadata["app"] = json.dumps(fields)
    save_file(load_file(str(path)), str(path), metadata=metadata)
    with running_app(make_settings(snapshot_dir=folder)) as client:
        url = f"/v1/sessions/{session_id}/chunks"
        before = _state(client, session_id)
        repeat = client.post(url, params={"seq": 0}, content=payload(LATENTS[:, :, 5:8]), headers=OCTET)
        assert repeat.status_code == 200 and repeat.headers.get("x-replayed") == "true", repeat.text
        assert repeat.content == answer and _state(client, session_id) == before
        # The next chunk is recorded again: its seq is held to its request.
        nxt = client.post(url, params={"seq": 1}, content=payload(LATENTS[:, :, 5:8]), headers=OCTET)
        assert nxt.status_code == 200, nxt.text
        other = client.post(url, params={"seq": 1, "flush": "true"}, content=payload(LATENTS[:, :, 5:8]), headers=OCTET)
        assert other.status_code == 409 and other.json()["error"]["code"] == "seq_conflict", other.status_code


def test_a_session_saved_after_a_stream_message_does_not_repeat_the_http_seq_before_it(make_settings, tmp_path):
    """After HTTP seq=0 and a stream message (seq 1) the last chunk has no seq to repeat: the drain's file says so
    (no last seq, no stored response), and seq=0 sent to the adopting server is 409 naming seq=2, as it is live."""
    folder = tmp_path / "snapshots"
    with running_app(make_settings(snapshot_dir=folder)) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        assert client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=FIRST, headers=OCTET).status_code == 200
        with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
            ws.send_bytes(payload(LATENTS[:, :, 5:8]))
            wait_until(lambda: _state(client, session_id)["next_seq"] == 2, "the stream message to be accepted")
    with safe_open(str(folder / f"{session_id}.session.safetensors"), framework="pt") as handle:
        fields = json.loads(handle.metadata()["app"])
    assert (fields["next_seq"], fields["last_seq"], fields["has_last_response"]) == (2, None, False), fields
    with running_app(make_settings(snapshot_dir=folder)) as client:
        before = _state(client, session_id)  # adopted here
        assert before["next_seq"] == 2 and before["frames_received"] == 8, before
        repeat = client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=FIRST, headers=OCTET)
        assert repeat.status_code == 409 and repeat.json()["error"]["code"] == "seq_conflict", repeat.status_code
        assert "expects seq=2" in repeat.json()["error"]["message"]
        assert _state(client, session_id) == before


def test_a_file_written_with_a_stale_last_seq_is_adopted_without_repeating_it(make_settings, tmp_path):
    """Files written before a stream message dropped the last seq hold the HTTP chunk's seq and response behind a
    later next_seq (last seq 0, next seq 2 after seq 0 and a message). Such a last seq is not the last chunk's, so
    the adopting server does not repeat it: 409 naming seq=2, and the file is adopted all the same."""
    folder = tmp_path / "snapshots"
    session_id, _ = _drained_after_first_chunk(make_settings, folder)
    path = folder / f"{session_id}.session.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
    fields = json.loads(metadata["app"])
    assert (fields["next_seq"], fields["last_seq"], fields["has_last_response"]) == (1, 0, True), fields
    fields["next_seq"] = 2  # as the old code saved it after a stream message (seq 1)
    metadata["app"] = json.dumps(fields)
    save_file(load_file(str(path)), str(path), metadata=metadata)
    with running_app(make_settings(snapshot_dir=folder)) as client:
        before = _state(client, session_id)  # adopted here
        assert before["next_seq"] == 2, before
        repeat = client.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=FIRST, headers=OCTET)
        assert repeat.status_code == 409 and repeat.json()["error"]["code"] == "seq_conflict", repeat.status_code
        assert "expects seq=2" in repeat.json()["error"]["message"]
        assert _state(client, session_id) == before


def test_a_files_request_field_is_read_back_or_refused_when_malformed():
    """What a file holds is not trusted as it is: a malformed request is a ValueError, which the record's reader
    reports as unreadable service fields (the file set aside as a corrupt one), never a half-read request."""
    request = ChunkRequest.of(FIRST, flush=True)
    assert ChunkRequest.from_fields(json.loads(json.dumps(request.to_fields()))) == request
    assert ChunkRequest.from_fields(None) is None
    for bad in ([], {"flush": "yes", "bytes": 1, "sha256": "0" * 64}, {"flush": True, "bytes": -1, "sha256": "0" * 64},
                {"flush": True, "bytes": True, "sha256": "0" * 64}, {"flush": True, "bytes": 1, "sha256": "xyz"}):
        with pytest.raises(ValueError):
            ChunkRequest.from_fields(bad)
