"""wm_refiner_client against a real server on loopback: every path gives the bytes of /v1/refine, retries are
idempotent, a dropped stream resumes without losing or repeating a frame, errors are typed."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from websockets.sync.client import connect

import wm_refiner_client as wm
from bench.live import ThreadServer, metric_samples
from tests.app.conftest import EngineHold
from wm_refiner_client import AsyncClient, Chunk, Client, RetryPolicy, concat

from .conftest import chunks_of, clip
from .proxy import Proxy

FAST_RETRY = RetryPolicy(attempts=40, backoff_s=0.05, max_backoff_s=0.5)
LATENTS, PROMPT, MASK = clip(14)


@pytest.fixture(scope="module")
def reference(server):
    """The whole clip through /v1/refine: what every other path must return, bit for bit."""
    with Client(server.base_url) as client:
        return client.refine(LATENTS, PROMPT, MASK).latents


def test_refine_matches_the_library(server, refiner_output):
    with Client(server.base_url) as client:
        unit = client.refine(LATENTS, PROMPT, MASK)
    assert (unit.frame_start, unit.frame_end) == (0, LATENTS.shape[2])
    assert np.array_equal(unit.latents, refiner_output)


@pytest.fixture(scope="module")
def refiner_output(checkpoint_dir):
    from models import SessionConfig, load_refiner, refine_clip

    refiner = load_refiner(checkpoint_dir, device="cpu", dtype="float32")
    out = refine_clip(refiner, torch.from_numpy(LATENTS), torch.from_numpy(PROMPT), torch.from_numpy(MASK),
                      SessionConfig())
    return out.numpy()


def test_http_chunks_equal_refine_with_automatic_seq(server, reference):
    with Client(server.base_url) as client:
        session = client.create_session()
        units = [session.send(part, prompt=PROMPT if i == 0 else None, prompt_mask=MASK if i == 0 else None)
                 for i, part in enumerate(chunks_of(LATENTS, [5, 2, 4]))]
        units.append(session.flush())
        state = session.state()
    assert [u.seq for u in units] == [0, 1, 2, 3, 4]
    assert all(u.latency_ms is not None and u.latency_ms > 0 for u in units)  # HTTP responses carry it too
    assert [(u.frame_start, u.frame_end) for u in units] == [(0, 4), (4, 7), (7, 10), (10, 13), (13, 14)]
    assert np.array_equal(concat(units), reference)
    assert state.next_seq == 5 and state.flushed and state.frames_returned == 14
    # Where it is and what it holds, typed (the server's JSON is in .raw).
    assert state.memory_state == "active" and state.bytes["device"] == state.raw["bytes"]["device"] > 0
    assert state.late_blocks is None  # not a realtime session


def test_stream_equals_refine_and_takes_torch_tensors(server, reference):
    with Client(server.base_url, return_tensors="pt") as client:
        session = client.create_session()
        chunks = [torch.from_numpy(part) for part in chunks_of(LATENTS, [2, 5, 1, 3])]
        stream = session.stream(chunks, prompt=torch.from_numpy(PROMPT), prompt_mask=torch.from_numpy(MASK))
        units = list(stream)
    assert all(isinstance(u.latents, torch.Tensor) for u in units)
    assert [u.frames for u in units] == [1, 3, 3, 3, 3, 1]  # the sink, blocks of 3, the final short block
    assert all(u.latency_ms is not None and u.latency_ms > 0 for u in units)
    # Each unit's seq is the message that finalized it: messages of 2, 5, 1, 3, 3 frames (0-4), then the flush (5).
    assert [u.seq for u in units] == [0, 1, 1, 3, 4, 5]
    assert torch.equal(concat(units), torch.from_numpy(reference))
    assert stream.stats.frames_sent == stream.stats.frames_refined == 14 and stream.stats.reconnects == 0


def test_stream_prompt_switch_with_chunk_objects(server):
    other_prompt = clip(seed=5)[1]
    chunks = [Chunk(LATENTS[:, :, :7], PROMPT, MASK), Chunk(LATENTS[:, :, 7:], prompt=other_prompt)]
    with Client(server.base_url) as client:
        streamed = concat(client.create_session().stream(chunks))
        session = client.create_session()
        first = session.send(LATENTS[:, :, :7], PROMPT, MASK)
        second = session.send(LATENTS[:, :, 7:], prompt=other_prompt, flush=True)
    assert np.array_equal(streamed, concat([first, second]))


def test_async_client_http_and_stream(server, reference):
    async def run():
        async with AsyncClient(server.base_url) as client:
            assert (await client.info())["model"]["channels"] == 128
            session = await client.create_session()
            sent = [await session.send(LATENTS[:, :, :6], PROMPT, MASK), await session.send(LATENTS[:, :, 6:])]
            sent.append(await session.flush())

            async def chunks():
                for part in chunks_of(LATENTS, [3, 3, 3]):
                    yield part

            streamed = [unit async for unit in (await client.create_session()).stream(chunks(), prompt=PROMPT,
                                                                                       prompt_mask=MASK)]
            return sent, streamed

    sent, streamed = asyncio.run(run())
    assert np.array_equal(concat(sent), reference)
    assert np.array_equal(concat(streamed), reference)


async def _stream_cancelled_after_its_first_unit(client):
    """A session streamed 8 frames into by a program cancelled once it kept the first unit: (the session, the
    units kept), with the server done sending the rest (blocks [1, 4) and [4, 7)) to the connection that went."""
    session = await client.create_session()
    kept: list = []
    never = asyncio.Event()

    async def source():
        yield LATENTS[:, :, :8]
        await never.wait()  # a live source that has nothing more yet

    async def consume():
        async for unit in session.stream(source(), prompt=PROMPT, prompt_mask=MASK):
            kept.append(unit)
            if len(kept) == 1:
                await never.wait()  # the program is busy when it is cancelled

    task = asyncio.create_task(consume())
    while not kept:
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(500):
        state = await session.state()
        if state.frames_returned == 7 and not state.streaming:
            break
        await asyncio.sleep(0.02)
    return session, kept


def test_a_cancelled_async_stream_continues_from_the_frames_the_caller_kept(server, reference):
    """A program cancelled mid-stream kept fewer frames than the server returned (units went to a connection that
    was gone): ``get_session(id, frames_returned=K)`` gets them again, so the clip comes out whole, bit for bit."""

    async def run():
        async with AsyncClient(server.base_url) as client:
            session, kept = await _stream_cancelled_after_its_first_unit(client)
            held, state = kept[-1].frame_end, await session.state()
            assert (held, state.frames_returned) == (1, 7)  # the sink kept; blocks [1, 4) and [4, 7) were sent
            assert (await client.get_session(session.id)).frames_returned == 7  # the server's count: a gap
            with pytest.raises(ValueError, match="returned only 7"):
                await client.get_session(session.id, frames_returned=8)
            again = await client.get_session(session.id, frames_returned=held)
            rest = [unit async for unit in again.stream([LATENTS], prompt=PROMPT, prompt_mask=MASK,
                                                        from_session_start=True)]
            return kept, rest

    kept, rest = asyncio.run(run())
    assert [(unit.frame_start, unit.frame_end) for unit in rest][:2] == [(1, 4), (4, 7)]
    assert np.array_equal(concat(kept + rest), reference)
    with Client(server.base_url) as client:
        assert client.get_session(client.create_session().id, frames_returned=0).frames_returned == 0


def test_a_closed_loop_source_that_waits_for_the_replayed_units_is_not_waited_for_first(server, reference):
    """A program continuing a session it holds units of (``get_session(id, frames_returned=K)``) with a source that
    yields its next chunk only once the units a resume replays have come (a closed loop: the next input follows the
    last output). The stream must connect before it has that chunk; it read the first chunk first (for the size
    that bounds what may come back), and both waited for each other for ever."""

    async def run():
        async with AsyncClient(server.base_url) as client:
            session, kept = await _stream_cancelled_after_its_first_unit(client)
            again = await client.get_session(session.id, frames_returned=kept[-1].frame_end)
            replayed = asyncio.Event()

            async def closed_loop():
                await asyncio.wait_for(replayed.wait(), 30)  # the next input follows the last output
                yield LATENTS[:, :, 8:]

            rest = []
            async for unit in again.stream(closed_loop()):
                rest.append(unit)
                replayed.set()
            return kept, rest

    kept, rest = asyncio.run(run())
    assert [(unit.frame_start, unit.frame_end) for unit in rest][:2] == [(1, 4), (4, 7)]
    assert np.array_equal(concat(kept + rest), reference)


def test_sessions_info_state_watch_and_delete(server):
    with Client(server.base_url) as client:
        info = client.info()
        assert info["limits"]["max_window_frames"] >= 1
        session = client.create_session(block_size=2, kv_max_frames=7)
        assert session.config["block_size"] == 2
        seen = []
        watching = threading.Thread(target=lambda: seen.extend(session.watch()))
        watching.start()
        deadline = time.monotonic() + 30
        while session.state().raw["watchers"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        units = list(session.stream([LATENTS[:, :, :8]], prompt=PROMPT, prompt_mask=MASK))
        watching.join(30)
        assert [type(item).__name__ for item in seen].count("Unit") == len(units)
        watched = [item for item in seen if isinstance(item, wm.Unit)]
        assert [(w.seq, w.latency_ms) for w in watched] == [(u.seq, u.latency_ms) for u in units]  # the same bytes
        assert [u.seq for u in units] == [0, 0, 0, 0, 1]  # one message of 8 frames, then the flush
        blocks = [item for item in seen if isinstance(item, wm.BlockEvent)]
        assert [(b.frame_start, b.frame_end) for b in blocks] == [(u.frame_start, u.frame_end) for u in units[1:]]
        listed = {s.session_id: s for s in client.sessions(page_size=1)}  # several pages
        assert listed[session.id].flushed and listed[session.id].frames_returned == 8
        session.delete()
        assert session.id not in {s.session_id for s in client.sessions()}
        with pytest.raises(wm.SessionNotFoundError) as missing:
            session.state()
        assert missing.value.status == 404 and missing.value.code == "session_not_found"


def test_errors_are_typed(server):
    with Client(server.base_url) as client:
        with pytest.raises(wm.InvalidConfigError) as bad_config:
            client.create_session(kv_max_frames=2, block_size=3)
        assert isinstance(bad_config.value, wm.UnprocessableError) and bad_config.value.status == 422
        session = client.create_session()
        with pytest.raises(wm.MissingInputError):
            session.send(LATENTS[:, :, :4])  # the first chunk needs the prompt
        with pytest.raises(wm.MissingInputError):
            list(session.stream([LATENTS[:, :, :4]]))
        session.send(LATENTS[:, :, :4], PROMPT, flush=True)
        with pytest.raises(wm.StreamClosedError):
            session.send(LATENTS[:, :, 4:6])
        with pytest.raises(TypeError):
            client.create_session(block_sise=3)


def test_api_key_from_the_environment_or_an_argument(make_settings, monkeypatch):
    with ThreadServer(make_settings(api_key="s3cret", warmup=False)) as live:
        monkeypatch.delenv("WM_REFINER_API_KEY", raising=False)
        with Client(live.base_url, api_key="s3cret") as client:
            session = client.create_session()
        with Client(live.base_url) as keyless:
            with pytest.raises(wm.UnauthorizedError):
                keyless.info()
            with pytest.raises(wm.UnauthorizedError):  # the WebSocket handshake, refused with 401
                list(wm.Session(keyless, session.id, {}).stream([LATENTS[:, :, :5]], prompt=PROMPT))
        monkeypatch.setenv("WM_REFINER_API_KEY", "s3cret")
        with Client(live.base_url) as client:
            units = list(client.get_session(session.id).stream([LATENTS[:, :, :5]], prompt=PROMPT))
        assert sum(u.frames for u in units) == 5


def test_http_chunk_whose_response_is_lost_is_sent_again_with_its_seq(server, reference):
    with Proxy(server.port) as proxy, Client(proxy.base_url, retry=FAST_RETRY) as client:
        session = client.create_session()
        first = session.send(LATENTS[:, :, :6], PROMPT, MASK)
        proxy.swallow_responses(1)  # the server refines the chunk; its answer never arrives
        second = session.send(LATENTS[:, :, 6:])
        assert proxy.swallowed == 1 and second.replayed and second.seq == 1
        last = session.flush()
        state = session.state()
    assert state.frames_received == 14 and state.next_seq == 3  # the retried chunk was appended once
    assert np.array_equal(concat([first, second, last]), reference)


def test_a_send_that_raised_is_retried_by_sending_it_again_and_other_frames_under_its_seq_are_refused(server,
                                                                                                     reference):
    """The chunk was taken but its answer lost, and no retry was left: the next ``send`` keeps that seq. With the same
    arguments it is the same request (the same bytes) and gets the stored answer; with other frames it used to get
    that stored answer too, the new frames silently dropped; now SeqConflictError says so and changes nothing."""
    with Proxy(server.port) as proxy, Client(proxy.base_url, retry=RetryPolicy(attempts=1)) as client:
        session = client.create_session()
        first = session.send(LATENTS[:, :, :6], PROMPT, MASK)
        proxy.swallow_responses(1)  # the server refines seq 1; its answer never arrives
        with pytest.raises(wm.TransportError):
            session.send(LATENTS[:, :, 6:10])
        assert proxy.swallowed == 1
        before = session.state()
        assert (before.frames_received, before.next_seq) == (10, 2)
        with pytest.raises(wm.SeqConflictError) as refused:
            session.send(LATENTS[:, :, 10:], flush=True)
        message = str(refused.value)
        assert "seq=1 was accepted already for another request" in message and "use seq=2" in message, message
        after = session.state()
        assert (after.frames_received, after.frames_returned, after.next_seq, after.flushed) == \
            (before.frames_received, before.frames_returned, before.next_seq, before.flushed)
        second = session.send(LATENTS[:, :, 6:10])
        assert second.replayed and second.seq == 1
        last = session.send(LATENTS[:, :, 10:], flush=True)
        assert not last.replayed and last.seq == 2
    assert np.array_equal(concat([first, second, last]), reference)


def test_stream_absorbs_a_dropped_connection(server, reference):
    """The connection is cut after two units while chunks are still to come: the client reconnects with
    resume_from, resends what the server lacks, and yields each frame once (the server resends units whole)."""
    cut_done = threading.Event()

    def chunks():
        parts = chunks_of(LATENTS, [4, 3, 3, 2])
        yield from parts[:2]
        assert cut_done.wait(30)
        yield from parts[2:]  # sent into the dead connection first, then again after the reconnect

    with Proxy(server.port) as proxy, Client(proxy.base_url, retry=FAST_RETRY) as client:
        session = client.create_session()
        stream = session.stream(chunks(), prompt=PROMPT, prompt_mask=MASK)
        units = []
        for unit in stream:
            units.append(unit)
            if len(units) == 2 and not cut_done.is_set():
                assert proxy.cut() >= 1
                cut_done.set()
        state = session.state()
    assert stream.stats.reconnects >= 1
    ranges = [(u.frame_start, u.frame_end) for u in units]
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and ranges[0][0] == 0 and ranges[-1][1] == 14
    assert np.array_equal(concat(units), reference)
    assert state.frames_received == 14


def test_engine_busy_is_retried_over_http_and_streams(make_settings):
    """engine_queue_depth=1 and the engine held: a chunk of another session fills the queue, so the client's
    requests are refused with 503 engine_busy until the hold is released; it retries and gets the right bytes."""
    with ThreadServer(make_settings(engine_queue_depth=1)) as live, Client(live.base_url, retry=FAST_RETRY) as client:
        expected = client.refine(LATENTS, PROMPT, MASK).latents
        for path in ("http", "stream"):
            hold = EngineHold()
            blocker = live.on_loop(live.services.engine.call(hold))
            hold.wait_started()
            filler = client.create_session()
            queued = threading.Thread(target=filler.send, args=(LATENTS[:, :, :4], PROMPT))
            queued.start()
            _wait(lambda: live.services.engine.outstanding == 1, "the filler chunk to be queued")
            before = _rejected(live, "engine_busy")
            releaser = threading.Thread(target=_release_after_rejection, args=(live, before, hold))
            releaser.start()
            session = client.create_session()
            if path == "http":
                units = [session.send(LATENTS[:, :, :8], PROMPT, MASK), session.send(LATENTS[:, :, 8:], flush=True)]
            else:
                units = list(session.stream(chunks_of(LATENTS, [8]), prompt=PROMPT, prompt_mask=MASK))
            releaser.join(30)
            blocker.result(30)
            queued.join(30)
            assert _rejected(live, "engine_busy") > before, path
            assert np.array_equal(concat(units), expected), path


def test_units_over_a_mebibyte_need_max_size_none(server):
    """Why the README's raw examples pass max_size=None: websockets refuses messages over 1 MiB by default, and a
    block of 3 frames at 32 x 32 latents is 1.5 MB. The client lifts the limit."""
    latents, prompt, _ = clip(4, height=32, width=32)
    with Client(server.base_url) as client:
        units = list(client.create_session().stream([latents], prompt=prompt))
        assert units[1].latents.nbytes > 2**20
        session = client.create_session()
        session.send(latents[:, :, :1], prompt)
    url = f"{server.ws_url}/v1/sessions/{session.id}/stream"
    with connect(url) as ws:  # websockets' default max_size
        ws.send(wm.units.encode({"latents": latents[:, :, 1:]}))
        with pytest.raises(Exception) as too_big:
            ws.recv(timeout=30)
    assert "1009" in str(too_big.value) or "too big" in str(too_big.value).lower()


def _rejected(live, reason: str) -> float:
    import httpx

    text = httpx.get(f"{live.base_url}/metrics").text
    return metric_samples(text, "refiner_rejected_requests_total").get(
        f'refiner_rejected_requests_total{{reason="{reason}"}}', 0.0)


def _release_after_rejection(live, before: float, hold: EngineHold) -> None:
    try:
        _wait(lambda: _rejected(live, "engine_busy") > before, "a request refused with engine_busy")
    finally:
        hold.release.set()


def _wait(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def test_async_stream_absorbs_a_dropped_connection(server, reference):
    async def run():
        cut_done = asyncio.Event()

        async def chunks():
            parts = chunks_of(LATENTS, [4, 3, 3, 2])
            for part in parts[:2]:
                yield part
            await asyncio.wait_for(cut_done.wait(), 30)
            for part in parts[2:]:
                yield part

        with Proxy(server.port) as proxy:
            async with AsyncClient(proxy.base_url, retry=FAST_RETRY) as client:
                session = await client.create_session()
                stream = session.stream(chunks(), prompt=PROMPT, prompt_mask=MASK)
                units = []
                async for unit in stream:
                    units.append(unit)
                    if len(units) == 2 and not cut_done.is_set():
                        assert proxy.cut() >= 1
                        cut_done.set()
                return units, stream.stats, await session.state()

    units, stats, state = asyncio.run(run())
    assert stats.reconnects >= 1 and state.frames_received == 14
    assert np.array_equal(concat(units), reference)


def test_a_watch_asks_for_its_own_video_encoding():
    """``watch(video_format=, video_quality=)`` reach the route's query (the JS client and the route had them, the
    Python clients did not); None leaves each to the session."""
    from wm_refiner_client._common import watch_query

    assert watch_query(None, None, None) == {}
    assert watch_query(["latents", "video"], "jpeg", 85) == {"outputs": "latents,video", "video_format": "jpeg",
                                                             "video_quality": "85"}


def test_a_watch_s_video_encoding_reaches_the_server(server):
    with Client(server.base_url) as client:
        session = client.create_session()  # latents only: a video encoding is refused, naming it
        with pytest.raises(wm.APIError) as refused:
            next(iter(session.watch(video_format="jpeg")))
    assert refused.value.status == 422 and "video_format" in refused.value.message, refused.value


def test_a_watch_with_resume_from_gets_the_kept_units_from_there(server):
    """``Session.watch(resume_from=N)`` (and the asyncio one): the units the session kept from frame N (the one
    straddling N whole), the same bytes the stream got, then done; past the frames returned, the server's refusal;
    not a frame count, a ValueError before anything is sent."""
    with Client(server.base_url) as client:
        session = client.create_session()
        units = list(session.stream([LATENTS[:, :, :8]], prompt=PROMPT, prompt_mask=MASK))
        assert [(u.frame_start, u.frame_end) for u in units] == [(0, 1), (1, 4), (4, 7), (7, 8)]
        with session.watch(resume_from=2) as watch:
            seen = list(watch)
        replayed = [item for item in seen if isinstance(item, wm.Unit)]
        assert [(u.frame_start, u.frame_end, u.seq) for u in replayed] == [
            (u.frame_start, u.frame_end, u.seq) for u in units[1:]]
        assert all(np.array_equal(w.latents, u.latents) for w, u in zip(replayed, units[1:]))
        assert [(b.frame_start, b.frame_end) for b in seen if isinstance(b, wm.BlockEvent)] == [(1, 4), (4, 7), (7, 8)]
        assert (watch.frame_end, watch.frames) == (8, 8)
        with pytest.raises(wm.APIError) as refused:
            list(session.watch(resume_from=9))
        assert refused.value.code == "invalid_request" and "outside [0, 8]" in refused.value.message
        with pytest.raises(ValueError, match="resume_from=-1"):
            session.watch(resume_from=-1)

    async def run():
        async with AsyncClient(server.base_url) as client:
            again = await client.get_session(session.id)
            return [item async for item in again.watch(resume_from=4) if isinstance(item, wm.Unit)]

    watched = asyncio.run(run())
    assert [(u.frame_start, u.frame_end) for u in watched] == [(4, 7), (7, 8)]
    assert all(np.array_equal(w.latents, u.latents) for w, u in zip(watched, units[2:]))
