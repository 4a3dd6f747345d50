"""A watcher that reconnects with ``?resume_from=N`` (WS /v1/sessions/{id}/watch): the retained units it missed, then
live ones, none twice and none lost; the same refusals as a stream's resume; across a drain and a restart."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from app.core.codec import decode_response
from app.outputs import delivery
from models.checkpoints import write_vae_checkpoint

from tests.app.conftest import DEADLINE_S, OCTET, LiveServer, make_clip, payload, wait_until

FLUSH = json.dumps({"type": "flush"})


def watch(server, session_id: str, query: str = ""):
    return connect(f"{server.ws_url}/v1/sessions/{session_id}/watch{query}", open_timeout=DEADLINE_S, max_size=None)


def units_of(ws, count: int) -> tuple[list[bytes], list[dict]]:
    """The next ``count`` binary messages of ``ws`` as sent, and the text events among them."""
    units, events = [], []
    while len(units) < count:
        message = ws.recv(timeout=DEADLINE_S)
        if isinstance(message, bytes):
            units.append(message)
        else:
            events.append(json.loads(message))
    return units, events


def rest_of(ws) -> tuple[list[bytes], list[dict]]:
    """Every binary message and text event until the server closes ``ws``."""
    units, events = [], []
    try:
        while True:
            message = ws.recv(timeout=DEADLINE_S)
            if isinstance(message, bytes):
                units.append(message)
            else:
                events.append(json.loads(message))
    except ConnectionClosed:
        return units, events


def frames(units: list[bytes]) -> list[tuple[int, int]]:
    return [(int(meta["frame_start"]), int(meta["frame_end"])) for meta in (decode_response(u)[1] for u in units)]


def watchers(server, session_id: str) -> int:
    return httpx.get(f"{server.base_url}/v1/sessions/{session_id}", timeout=DEADLINE_S).json()["watchers"]


def refusal(server, session_id: str, query: str) -> tuple[dict, int]:
    with watch(server, session_id, query) as ws:
        event = json.loads(ws.recv(timeout=DEADLINE_S))
        rest_of(ws)
        return event, ws.close_code


def test_a_watcher_that_reconnects_gets_the_units_it_missed_then_live_ones(make_settings):
    """The watcher leaves after the sink and the first block; two blocks are refined while it is away; back with
    resume_from=5 (inside block [4, 7): sent whole) it gets exactly those two, then the flush's block live and done:
    every byte what the producer got, no unit twice."""
    latents, embeds, mask = make_clip(frames=11, seed=21)
    with LiveServer(make_settings()) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=DEADLINE_S).json()["session_id"]
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", open_timeout=DEADLINE_S,
                     max_size=None) as producer:
            with watch(server, session_id) as first:
                wait_until(lambda: watchers(server, session_id) == 1, "the watcher to join")
                producer.send(payload(latents[:, :, :5], embeds, mask))
                produced, _ = units_of(producer, 2)
                seen, _ = units_of(first, 2)
            assert seen == produced
            wait_until(lambda: watchers(server, session_id) == 0, "the watcher to leave")
            producer.send(payload(latents[:, :, 5:10]))
            missed, _ = units_of(producer, 2)
            assert frames(missed) == [(4, 7), (7, 10)]
            with watch(server, session_id, "?resume_from=5") as again:
                replayed, events = units_of(again, 2)
                assert replayed == missed  # bit for bit: the session's bytes, kept
                producer.send(payload(latents[:, :, 10:]))
                producer.send(FLUSH)
                live, _ = units_of(producer, 1)
                assert json.loads(producer.recv(timeout=DEADLINE_S)) == {"type": "done", "frames": 11}
                tail, more = rest_of(again)
                assert again.close_code == 1000
    assert tail == live and frames(live) == [(10, 11)]
    events += more
    assert [(e["frame_start"], e["frame_end"]) for e in events if e["type"] == "block"] == [(4, 7), (7, 10), (10, 11)]
    assert events[-1] == {"type": "done", "frames": 11}


def response_units(responses: list[bytes], replayed: list[bytes]) -> None:
    """Every replayed unit holds exactly the frames of the HTTP responses that returned them, bit for bit, and says
    the seq of the request that did."""
    frames_of = {}
    for response in responses:
        tensors, meta = decode_response(response)
        for index in range(int(meta["frame_start"]), int(meta["frame_end"])):
            frames_of[index] = (tensors["latents"][:, :, index - int(meta["frame_start"])], meta["seq"])
    for unit in replayed:
        tensors, meta = decode_response(unit)
        start, end = int(meta["frame_start"]), int(meta["frame_end"])
        assert [frames_of[index][1] for index in range(start, end)] == [meta["seq"]] * (end - start)
        for index in range(start, end):
            assert tensors["latents"][:, :, index - start].equal(frames_of[index][0])


def test_a_watcher_of_a_session_fed_over_http_gets_the_units_it_missed(make_settings):
    """A generator POSTs its chunks; the watcher leaves after the first response's units, two more responses are
    returned while it is away, and back with resume_from=5 it gets their units (the ones returned in HTTP
    responses are kept too), bit-equal to the responses' frames, then the flush's live and done."""
    latents, embeds, mask = make_clip(frames=11, seed=25)
    with LiveServer(make_settings()) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        session_id = http.post("/v1/sessions").json()["session_id"]
        chunks = f"/v1/sessions/{session_id}/chunks"
        with watch(server, session_id) as first:
            wait_until(lambda: watchers(server, session_id) == 1, "the watcher to join")
            reply = http.post(chunks, content=payload(latents[:, :, :4], embeds, mask), headers=OCTET)
            assert reply.status_code == 200, reply.text
            seen, _ = units_of(first, 2)
        assert frames(seen) == [(0, 1), (1, 4)]
        response_units([reply.content], seen)
        wait_until(lambda: watchers(server, session_id) == 0, "the watcher to leave")
        responses = [http.post(chunks, content=payload(latents[:, :, start:start + 3]), headers=OCTET)
                     for start in (4, 7)]
        assert [r.status_code for r in responses] == [200, 200]
        with watch(server, session_id, "?resume_from=5") as again:
            replayed, events = units_of(again, 2)
            assert frames(replayed) == [(4, 7), (7, 10)]
            response_units([r.content for r in responses], replayed)
            last = http.post(chunks, params={"flush": True}, content=payload(latents[:, :, 10:]), headers=OCTET)
            assert last.status_code == 200, last.text
            tail, more = rest_of(again)
            assert again.close_code == 1000
    assert frames(tail) == [(10, 11)]
    response_units([last.content], tail)
    events += more
    assert [(e["frame_start"], e["frame_end"]) for e in events if e["type"] == "block"] == [(4, 7), (7, 10), (10, 11)]
    assert events[-1] == {"type": "done", "frames": 11}


@pytest.mark.parametrize("fields", [{}, {"outputs": ["latents", "video"], "video_format": "jpeg",
                                         "video_lookahead": 0}], ids=["latents", "latents+jpeg"])
def test_a_one_unit_response_is_kept_as_the_client_got_it_and_serialized_once(make_settings, tmp_path, monkeypatch,
                                                                             fields):
    """A chunk of one block is answered with one unit: the session keeps the response's bytes themselves for a
    resuming watcher (bit for bit what the HTTP client got), not a second serialization of the same unit (which
    would differ: another latency_ms, and safetensors writes the metadata in no fixed order). A response of two
    units (the sink and a block) is still kept unit by unit."""
    serialized = []
    real_encode = delivery.encode

    def counting_encode(tensors, metadata=None):
        serialized.append(str(metadata["frame_start"]))
        return real_encode(tensors, metadata)

    monkeypatch.setattr(delivery, "encode", counting_encode)
    vae = {"vae": str(write_vae_checkpoint(tmp_path / "vae", "tiny-vae"))} if fields else {}
    latents, embeds, mask = make_clip(frames=7, seed=29)
    with LiveServer(make_settings(**vae)) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        session_id = http.post("/v1/sessions", json=fields).json()["session_id"]
        chunks = f"/v1/sessions/{session_id}/chunks"
        first = http.post(chunks, content=payload(latents[:, :, :4], embeds, mask), headers=OCTET)
        assert first.status_code == 200, first.text
        assert sorted(serialized) == ["0", "0", "1"]  # the response, then its two units, each on its own
        serialized.clear()
        reply = http.post(chunks, content=payload(latents[:, :, 4:7]), headers=OCTET)
        assert reply.status_code == 200, reply.text
        assert serialized == ["4"]  # the response only
        with watch(server, session_id, "?resume_from=0") as ws:
            replayed, _ = units_of(ws, 3)
    assert frames(replayed) == [(0, 1), (1, 4), (4, 7)]
    assert replayed[2] == reply.content
    response_units([first.content], replayed[:2])


def test_a_streams_resume_does_not_send_again_the_units_answered_over_http(make_settings):
    """api.md: an HTTP chunk's units are answered in its HTTP response only. A stream dropped after four units,
    then a chunk POSTed: the stream resuming from 4 gets its own two units again (resent_from 4), not the
    response's, then its new ones. A watcher resuming from 4 gets all three."""
    latents, embeds, mask = make_clip(frames=14, seed=26)
    with LiveServer(make_settings()) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        session_id = http.post("/v1/sessions").json()["session_id"]
        stream = f"{server.ws_url}/v1/sessions/{session_id}/stream"
        with connect(stream, open_timeout=DEADLINE_S, max_size=None) as producer:
            producer.send(payload(latents[:, :, :10], embeds, mask))
            produced, _ = units_of(producer, 4)  # [0, 1) [1, 4) [4, 7) [7, 10)
        wait_until(lambda: http.get(f"/v1/sessions/{session_id}").json()["streaming"] is False, "the stream to end")
        reply = http.post(f"/v1/sessions/{session_id}/chunks", content=payload(latents[:, :, 10:13]), headers=OCTET)
        assert reply.status_code == 200, reply.text
        with watch(server, session_id, "?resume_from=4") as ws:
            watched, _ = units_of(ws, 3)
        assert watched[:2] == produced[2:] and frames(watched) == [(4, 7), (7, 10), (10, 13)]
        response_units([reply.content], watched[2:])
        with connect(f"{stream}?resume_from=4", open_timeout=DEADLINE_S, max_size=None) as producer:
            event = json.loads(producer.recv(timeout=DEADLINE_S))
            assert (event["frames_returned"], event["resume_from"], event["resent_from"]) == (13, 4, 4)
            resent, _ = units_of(producer, 2)
            assert resent == produced[2:]
            producer.send(payload(latents[:, :, 13:]))
            producer.send(FLUSH)
            live, _ = units_of(producer, 1)
            assert json.loads(producer.recv(timeout=DEADLINE_S)) == {"type": "done", "frames": 14}
    assert frames(live) == [(13, 14)]


def test_a_watchers_resume_is_refused_as_a_streams_is_and_changes_nothing(make_settings):
    """resume_from that is not a frame index, past the frames returned, or before what is kept (ws_resume_units=2;
    a unit returned over HTTP counts among them) is an error event and close 1008 naming what to send instead; the
    session keeps no watcher. From where the kept units allow, the watch goes on."""
    latents, embeds, mask = make_clip(frames=14, seed=22)
    with LiveServer(make_settings(ws_resume_units=2)) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        session_id = http.post("/v1/sessions").json()["session_id"]
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", open_timeout=DEADLINE_S,
                     max_size=None) as producer:
            producer.send(payload(latents[:, :, :10], embeds, mask))
            produced, _ = units_of(producer, 4)  # [0, 1) [1, 4) [4, 7) [7, 10): the last two kept
        event, code = refusal(server, session_id, "?resume_from=four")
        assert (event["error"]["code"], code) == ("invalid_request", 1008)
        assert "not a frame index" in event["error"]["message"]
        event, code = refusal(server, session_id, "?resume_from=11")
        assert (event["error"]["code"], code) == ("invalid_request", 1008)
        assert "outside [0, 10]" in event["error"]["message"]
        event, code = refusal(server, session_id, "?resume_from=3")
        assert (event["error"]["code"], code) == ("resume_unavailable", 1008)
        assert "frames [3, 4) are no longer kept" in event["error"]["message"]
        assert "resume_from=4" in event["error"]["message"]
        with watch(server, session_id, "?resume_from=4") as ws:
            replayed, _ = units_of(ws, 2)
        assert replayed == produced[2:]
        # A unit returned over HTTP is kept too, and the oldest kept unit makes way for it.
        reply = http.post(f"/v1/sessions/{session_id}/chunks", content=payload(latents[:, :, 10:13]), headers=OCTET)
        assert reply.status_code == 200, reply.text
        event, code = refusal(server, session_id, "?resume_from=4")
        assert (event["error"]["code"], code) == ("resume_unavailable", 1008)
        assert "frames [4, 7) are no longer kept" in event["error"]["message"]
        with watch(server, session_id, "?resume_from=7") as ws:
            replayed, _ = units_of(ws, 2)
        assert replayed[0] == produced[3] and frames(replayed) == [(7, 10), (10, 13)]
        wait_until(lambda: watchers(server, session_id) == 0, "no watcher left")
        state = http.get(f"/v1/sessions/{session_id}").json()
        assert (state["frames_returned"], state["next_seq"]) == (13, 2)
        with watch(server, session_id, "?resume_from=13") as ws:
            wait_until(lambda: watchers(server, session_id) == 1, "the watcher to join")
            reply = http.post(f"/v1/sessions/{session_id}/chunks", params={"flush": True},
                              content=payload(latents[:, :, 13:]), headers=OCTET)
            assert reply.status_code == 200, reply.text
            units, events = rest_of(ws)
        assert frames(units) == [(13, 14)] and events[-1] == {"type": "done", "frames": 14}


@pytest.mark.slow
def test_a_resumed_watcher_gets_its_own_outputs_and_another_encoding_is_refused(make_settings, tmp_path):
    """A [latents, video] session: a watcher resuming with outputs=latents gets the kept units' latents (bit-equal)
    and no video; one asking another video encoding is refused (the kept units hold the session's), unless
    nothing is to be sent again."""
    vae_dir = write_vae_checkpoint(tmp_path / "vae", "tiny-vae")
    latents, embeds, mask = make_clip(frames=7, seed=23)
    with LiveServer(make_settings(vae=str(vae_dir))) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions", json={"outputs": ["latents", "video"]},
                                timeout=DEADLINE_S).json()["session_id"]
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", open_timeout=DEADLINE_S,
                     max_size=None) as producer:
            producer.send(payload(latents, embeds, mask))
            produced, _ = units_of(producer, 3)  # [0, 1) [1, 4) [4, 7)
        with watch(server, session_id, "?resume_from=1&outputs=latents") as ws:
            replayed, _ = units_of(ws, 2)
        for mine, theirs in zip(replayed, produced[1:]):
            (tensors, meta), (expected, expected_meta) = decode_response(mine), decode_response(theirs)
            assert set(tensors) == {"latents"} and not any(key.startswith("video_") for key in meta)
            assert tensors["latents"].equal(expected["latents"])
            assert (meta["frame_start"], meta["seq"]) == (expected_meta["frame_start"], expected_meta["seq"])
        event, code = refusal(server, session_id, "?resume_from=1&video_format=float32")
        assert (event["error"]["code"], code) == ("invalid_request", 1008)
        assert "video_format=uint8" in event["error"]["message"]
        with watch(server, session_id, "?resume_from=7&video_format=float32") as ws:
            wait_until(lambda: watchers(server, session_id) == 1, "the watcher to join")


@pytest.mark.slow
def test_a_watch_resumes_without_a_gap_across_a_drain_and_a_restart(make_settings, tmp_path):
    """The watcher leaves; a block is refined; the replica drains (saving the session and its kept units to
    snapshot_dir) and another on the same folder starts. The watcher resuming there gets the block refined while it
    was away, from the saved units, then the blocks the producer streams after its own resume, bit for bit."""
    latents, embeds, mask = make_clip(frames=11, seed=24)
    folder = tmp_path / "snapshots"
    folder.mkdir()
    settings = make_settings(snapshot_dir=folder)
    with LiveServer(settings) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=DEADLINE_S).json()["session_id"]
        producer = connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", open_timeout=DEADLINE_S,
                           max_size=None)
        with watch(server, session_id) as first:
            wait_until(lambda: watchers(server, session_id) == 1, "the watcher to join")
            producer.send(payload(latents[:, :, :4], embeds, mask))
            produced, _ = units_of(producer, 2)
            seen, _ = units_of(first, 2)
        assert seen == produced
        wait_until(lambda: watchers(server, session_id) == 0, "the watcher to leave")
        producer.send(payload(latents[:, :, 4:7]))
        missed, _ = units_of(producer, 1)
    assert frames(missed) == [(4, 7)]
    rest_of(producer)
    assert producer.close_code == 1012  # drained: the session saved
    with LiveServer(settings) as server:
        with watch(server, session_id, "?resume_from=4") as again:  # adopts the session from the folder
            replayed, _ = units_of(again, 1)
            assert replayed == missed
            with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream?resume_from=7", open_timeout=DEADLINE_S,
                         max_size=None) as producer:
                assert json.loads(producer.recv(timeout=DEADLINE_S))["frames_received"] == 7
                producer.send(payload(latents[:, :, 7:]))
                producer.send(FLUSH)
                live, _ = units_of(producer, 2)
            tail, events = rest_of(again)
    assert tail == live and frames(live) == [(7, 10), (10, 11)]
    assert events[-1] == {"type": "done", "frames": 11}


@pytest.mark.slow
def test_a_watch_of_a_session_fed_over_http_resumes_across_a_drain_and_a_restart(make_settings, tmp_path):
    """The units of the HTTP responses returned while the watcher was away are saved with the session by the drain:
    the watcher resuming on the replica that adopts it gets them, the same bytes as a resume before the drain, and
    the responses' frames bit for bit; then the rest live. A stream resuming there is refused them as before the
    drain (they were answered in their responses), and goes on from the frames returned."""
    latents, embeds, mask = make_clip(frames=11, seed=27)
    folder = tmp_path / "snapshots"
    folder.mkdir()
    settings = make_settings(snapshot_dir=folder)
    with LiveServer(settings) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        session_id = http.post("/v1/sessions").json()["session_id"]
        chunks = f"/v1/sessions/{session_id}/chunks"
        with watch(server, session_id) as first:
            wait_until(lambda: watchers(server, session_id) == 1, "the watcher to join")
            assert http.post(chunks, content=payload(latents[:, :, :4], embeds, mask), headers=OCTET).status_code == 200
            units_of(first, 2)
        wait_until(lambda: watchers(server, session_id) == 0, "the watcher to leave")
        reply = http.post(chunks, content=payload(latents[:, :, 4:7]), headers=OCTET)
        assert reply.status_code == 200, reply.text
        with watch(server, session_id, "?resume_from=4") as before:
            kept, _ = units_of(before, 1)
    assert frames(kept) == [(4, 7)]
    response_units([reply.content], kept)
    with LiveServer(settings) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        with watch(server, session_id, "?resume_from=4") as again:  # adopts the session from the folder
            replayed, _ = units_of(again, 1)
            assert replayed == kept
            stream = f"{server.ws_url}/v1/sessions/{session_id}/stream"
            with connect(f"{stream}?resume_from=4", open_timeout=DEADLINE_S, max_size=None) as producer:
                event = json.loads(producer.recv(timeout=DEADLINE_S))
                rest_of(producer)
            assert (event["error"]["code"], producer.close_code) == ("resume_unavailable", 1008)
            assert "frames [4, 7) are no longer kept for a stream" in event["error"]["message"]
            with connect(f"{stream}?resume_from=7", open_timeout=DEADLINE_S, max_size=None) as producer:
                event = json.loads(producer.recv(timeout=DEADLINE_S))
                assert (event["frames_returned"], event["resent_from"]) == (7, 7)
                producer.send(payload(latents[:, :, 7:]))
                producer.send(FLUSH)
                live, _ = units_of(producer, 2)
            tail, events = rest_of(again)
    assert tail == live and frames(live) == [(7, 10), (10, 11)]
    assert events[-1] == {"type": "done", "frames": 11}


def test_with_ws_resume_units_0_nothing_is_kept_and_a_resume_from_the_frames_returned_goes_on(make_settings, tmp_path):
    """ws_resume_units: 0, for a host that cannot spare the memory: a session keeps no unit, streamed or returned
    in HTTP responses, not even those its file brings from a replica that kept some (the drain below saved two). Its
    HTTP chunks are answered as ever; a resume from before the frames returned is resume_unavailable naming them,
    a stream's and a watcher's, and one from there goes on live."""
    latents, embeds, mask = make_clip(frames=10, seed=28)
    folder = tmp_path / "snapshots"
    folder.mkdir()
    with LiveServer(make_settings(snapshot_dir=folder)) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        session_id = http.post("/v1/sessions").json()["session_id"]
        chunks = f"/v1/sessions/{session_id}/chunks"
        assert http.post(chunks, content=payload(latents[:, :, :4], embeds, mask), headers=OCTET).status_code == 200
        assert http.get(f"/v1/sessions/{session_id}").json()["bytes"]["parts"]["retained_units"] > 0
    with LiveServer(make_settings(snapshot_dir=folder, ws_resume_units=0)) as server:
        http = httpx.Client(base_url=server.base_url, timeout=DEADLINE_S)
        reply = http.post(chunks, content=payload(latents[:, :, 4:7]), headers=OCTET)
        assert reply.status_code == 200, reply.text
        assert decode_response(reply.content)[1]["frame_end"] == "7"
        state = http.get(f"/v1/sessions/{session_id}").json()
        assert (state["bytes"]["parts"]["retained_units"], state["resumable_from"]) == (0, 7)
        event, code = refusal(server, session_id, "?resume_from=4")
        assert (event["error"]["code"], code) == ("resume_unavailable", 1008)
        assert "reconnect with resume_from=7" in event["error"]["message"]
        stream = f"{server.ws_url}/v1/sessions/{session_id}/stream"
        with connect(f"{stream}?resume_from=1", open_timeout=DEADLINE_S, max_size=None) as producer:
            event = json.loads(producer.recv(timeout=DEADLINE_S))
            rest_of(producer)
        assert (event["error"]["code"], producer.close_code) == ("resume_unavailable", 1008)
        with watch(server, session_id, "?resume_from=7") as watcher, \
                connect(f"{stream}?resume_from=7", open_timeout=DEADLINE_S, max_size=None) as producer:
            assert json.loads(producer.recv(timeout=DEADLINE_S))["resent_from"] == 7
            wait_until(lambda: watchers(server, session_id) == 1, "the watcher to join")
            producer.send(payload(latents[:, :, 7:]))
            producer.send(FLUSH)
            live, _ = units_of(producer, 1)
            seen, events = rest_of(watcher)
        assert seen == live and frames(live) == [(7, 10)]
        assert events[-1] == {"type": "done", "frames": 10}
        assert http.get(f"/v1/sessions/{session_id}").json()["bytes"]["parts"]["retained_units"] == 0
