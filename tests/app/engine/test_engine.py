"""The engine on its own: forwards of several sessions batched into one model call, fair turns, order within a
session, bounded queues, failure isolation (also inside a batch), atomic rollback, pause, and a warm-up that
reaches the steady-state window."""

from __future__ import annotations

import asyncio

import pytest
import torch

from app.core.error_kinds import from_exception
from app.core.metrics import Metrics
from app.core.settings import Settings
from app.engine.engine_errors import Draining, EngineBusy, EngineError, OutputFailed
from app.engine.worker import Engine, EngineSession, Work
from app.runtime.services import warmup_work
from models import RefinerSession, SessionConfig

from tests.faults import failing_forwards

from tests.app.conftest import DEADLINE_S, EngineHold, expected_clip, make_clip


def run_with_engine(refiner, coroutine_fn, queue_depth=16, session_depth=4, **options):
    engine = Engine(Metrics(), queue_depth, session_depth, **options)
    engine.model = refiner.model
    engine.start()
    try:
        return asyncio.run(asyncio.wait_for(coroutine_fn(engine), DEADLINE_S))
    finally:
        engine.stop()


def target(refiner, name, **config) -> EngineSession:
    return EngineSession(session=RefinerSession(refiner, SessionConfig(**config)), name=name)


class Recorder:
    """Model calls as they happen: which sessions' forwards each one carried."""

    def __init__(self, model):
        self.calls: list[list[str]] = []
        self.names: dict[int, str] = {}
        self._handle = model.transformer_blocks[0].register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        rows = kwargs["kv_cache"].rows
        self.calls.append([self.names.get(id(row.owner), "?") for row in rows])

    def name(self, engine_session: EngineSession) -> EngineSession:
        self.names[id(engine_session.session)] = engine_session.name
        return engine_session

    def close(self):
        self._handle.remove()


async def held(engine):
    """Occupy the engine thread until the returned hold is released, so work submitted meanwhile queues."""
    hold = EngineHold()
    task = asyncio.ensure_future(engine.call(hold))
    await asyncio.to_thread(hold.wait_started)
    return hold, task


def run_together(refiner, clips: dict, **engine_options):
    """Queue every clip (name -> (latents, embeds, mask)) on its own session while the engine is held, release
    it, and return (the results by name, the sessions each model call carried)."""
    recorder = Recorder(refiner.model)

    async def scenario(engine):
        hold, task = await held(engine)
        futures = {
            name: engine.submit(Work(recorder.name(target(refiner, name)), *clip, flush=True))
            for name, clip in clips.items()
        }
        hold.release.set()
        await task
        return {name: await future for name, future in futures.items()}

    try:
        results = run_with_engine(refiner, scenario, **engine_options)
    finally:
        recorder.close()
    return results, recorder.calls


def test_forwards_of_ready_sessions_share_model_calls(refiner):
    """Four sessions queued together: every model call carries all four (same token count); their bytes equal
    each session refined alone."""
    clips = {name: make_clip(frames=10, seed=seed) for seed, name in enumerate("abcd")}
    results, calls = run_together(refiner, clips)
    for name, clip in clips.items():
        assert torch.equal(torch.cat([u.latents for u in results[name].units], dim=2), expected_clip(refiner, *clip))
    # 1 sink forward + 3 blocks x 4 forwards, each carrying every session
    assert len(calls) == 13 and all(sorted(call) == list("abcd") for call in calls)


def test_batching_off_runs_one_session_per_call_in_turns(refiner):
    _, calls = run_together(refiner, {name: make_clip(frames=4, seed=i) for i, name in enumerate("ab")},
                            batching=False)
    assert all(len(call) == 1 for call in calls)
    # Round robin forward by forward: the sessions alternate.
    assert [call[0] for call in calls] == ["a", "b"] * (len(calls) // 2)


def test_max_batch_rows_caps_a_call_and_every_session_keeps_its_turn(refiner):
    """Five sessions, at most two rows per call: no call is bigger, the sessions left out go first next time,
    and nobody starves (every session is served within three consecutive calls)."""
    _, calls = run_together(refiner, {name: make_clip(frames=4, seed=i) for i, name in enumerate("abcde")},
                            max_batch_rows=2)
    assert max(len(call) for call in calls) == 2
    served_at = {name: [i for i, call in enumerate(calls) if name in call] for name in "abcde"}
    for name, indices in served_at.items():
        assert len(indices) == 5, f"{name}: 1 sink + 4 forwards of its block"
        assert all(b - a <= 3 for a, b in zip(indices, indices[1:])), f"{name} waited too long: {indices}"


def test_sessions_of_other_shapes_run_in_their_own_calls(refiner):
    _, calls = run_together(refiner, {"small": make_clip(frames=4, height=4, width=4),
                                      "large": make_clip(frames=4, height=4, width=5)})
    assert all(len(call) == 1 for call in calls)
    assert sorted(name for call in calls for name in call) == ["large"] * 5 + ["small"] * 5


def test_queue_bounds_refuse_at_once(refiner):
    async def scenario(engine):
        hold, task = await held(engine)
        latents, embeds, _ = make_clip(frames=1)
        one, two = target(refiner, "one"), target(refiner, "two")
        first = engine.submit(Work(one, latents, embeds))
        with pytest.raises(EngineBusy) as session_full:
            engine.submit(Work(one, latents, embeds))
        wire = from_exception(session_full.value)  # what the client gets
        assert wire.kind == "engine_busy" and "session_queue_depth" in wire.message
        second = engine.submit(Work(two, latents, embeds))
        with pytest.raises(EngineBusy) as engine_full:
            engine.submit(Work(target(refiner, "three"), latents, embeds))
        wire = from_exception(engine_full.value)
        assert wire.kind == "engine_busy" and "engine_queue_depth" in wire.message
        assert engine.outstanding == 2
        hold.release.set()
        await asyncio.gather(task, first, second)
        assert engine.outstanding == 0
        engine.stop_accepting()
        with pytest.raises(Draining) as draining:
            engine.submit(Work(one, latents, embeds))
        assert from_exception(draining.value).kind == "draining"

    run_with_engine(refiner, scenario, queue_depth=2, session_depth=1)


@pytest.mark.parametrize("batching", [True, False])
def test_a_failing_forward_inside_a_batch_fails_only_its_session(refiner, batching):
    """Three sessions share every call; one session's forwards fail on the device from its second block on. The
    batched calls fail, the engine runs each forward alone: only that session's atomic work fails, and its
    session is exactly as before the work (a retry gives the untroubled bytes); the other two never notice."""
    clips = [make_clip(frames=8, seed=seed) for seed in range(3)]
    expected = [expected_clip(refiner, *clip) for clip in clips]

    async def scenario(engine):
        hold, task = await held(engine)
        sessions = [target(refiner, name) for name in "xyz"]
        broken = sessions[1]
        before = broken.session.state
        with failing_forwards(refiner.model, broken.session, when=lambda n: n >= 6) as failures:
            futures = [engine.submit(Work(s, *clip, flush=True, atomic=True)) for s, clip in zip(sessions, clips)]
            hold.release.set()
            await task
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
        assert failures, "the fault never fired"
        assert isinstance(outcomes[1], RuntimeError) and "out of memory" in str(outcomes[1])
        assert broken.session.state is before and broken.session.kv is None, "rolled back to before the work"
        retried = await engine.submit(Work(broken, *clips[1], flush=True, atomic=True))
        return [outcomes[0], retried, outcomes[2]]

    results = run_with_engine(refiner, scenario, batching=batching)
    for result, want in zip(results, expected):
        assert torch.equal(torch.cat([u.latents for u in result.units], dim=2), want)


def test_non_atomic_work_keeps_its_committed_blocks_and_the_next_work_retries(refiner):
    latents, embeds, mask = make_clip(frames=8, seed=5)
    expected = expected_clip(refiner, latents, embeds, mask)

    async def scenario(engine):
        stream = target(refiner, "stream")
        units = []
        with failing_forwards(refiner.model, stream.session, when=lambda n: n == 7):  # inside block [4, 7)
            with pytest.raises(RuntimeError):
                await engine.submit(Work(stream, latents, embeds, mask, on_unit=units.append))
        state = stream.session.state
        assert [u.frame_end for u in units] == [1, 4] and state.frames_returned == 4 and state.pending_frames == 4
        result = await engine.submit(Work(stream, None, flush=True, on_unit=units.append))
        assert [u.frame_end for u in result.units] == [7, 8]
        return units

    units = run_with_engine(refiner, scenario)
    assert torch.equal(torch.cat([u.latents for u in units], dim=2), expected)


def test_pause_rolls_back_atomic_work_keeps_committed_stream_blocks_and_stops_everything(refiner):
    """The drain's pause between two iterations: the HTTP-like (atomic) work in progress is undone, the stream's
    committed units stay committed (and were all handed on), everything unfinished fails with draining, and no
    forward runs afterwards."""
    clip = make_clip(frames=13, seed=9)

    async def scenario(engine):
        atomic, stream = target(refiner, "atomic"), target(refiner, "stream")
        handed = []
        before = atomic.session.state
        futures = [
            engine.submit(Work(atomic, *clip, flush=True, atomic=True)),
            engine.submit(Work(stream, *clip, flush=True, on_unit=handed.append)),
        ]
        while len(handed) < 2:  # both sessions are mid-clip
            await asyncio.sleep(0.001)
        stopped = await engine.pause()
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        assert stopped == 2 and all(isinstance(o, Draining) and from_exception(o).kind == "draining" for o in outcomes)
        assert atomic.session.state is before, "atomic work rolled back"
        state = stream.session.state
        assert state.frames_returned == handed[-1].frame_end, "every committed unit was handed on"
        assert state.frames_returned < 13 and state.frames_received == 13
        with pytest.raises(EngineError):
            engine.submit(Work(stream, None, flush=True))
        assert await engine.call(lambda: 42) == 42, "call jobs still run while paused"

    run_with_engine(refiner, scenario)


def test_warm_up_reaches_the_steady_state_window(refiner):
    settings = Settings(default_block_size=2, default_kv_max_frames=7, default_sink_frames=2, warmup_height=3)
    work = warmup_work(refiner, settings)

    async def scenario(engine):
        await engine.submit(work)

    run_with_engine(refiner, scenario)
    state = work.target.session.state
    config = work.target.session.config
    assert state.geometry.height == 3 and state.geometry.width == 4
    assert state.history_frames == config.max_history_frames, "the last block attended to a full window"
    assert state.blocks_refined >= 2 and state.pending_frames == 0
    # The history was already full before the last block, so that block ran at the steady-state shape.
    assert (state.blocks_refined - 1) * config.block_size >= config.max_history_frames


def test_a_session_whose_bookkeeping_raises_fails_alone_and_the_engine_goes_on(refiner, monkeypatch):
    """Not a forward but the session's own step (here its Euler update) raises: that session's work fails with
    the error, the engine thread survives, and the session it shared model calls with finishes untouched."""
    clips = {name: make_clip(frames=7, seed=i) for i, name in enumerate("xy")}

    async def scenario(engine):
        hold, task = await held(engine)
        broken, healthy = target(refiner, "x"), target(refiner, "y")

        def advance(run, velocity):
            raise ValueError("a bug in the step (injected)")

        monkeypatch.setattr(broken.session, "advance", advance)
        futures = [engine.submit(Work(broken, *clips["x"], flush=True, atomic=True)),
                   engine.submit(Work(healthy, *clips["y"], flush=True))]
        hold.release.set()
        await task
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        assert isinstance(outcomes[0], ValueError) and broken.session.state.frames_received == 0
        assert await engine.call(lambda: "alive") == "alive"
        return outcomes[1]

    result = run_with_engine(refiner, scenario)
    assert torch.equal(torch.cat([u.latents for u in result.units], dim=2), expected_clip(refiner, *clips["y"]))


def test_engine_errors_keep_their_wire_codes_statuses_and_messages():
    """The engine raises its own types; the client sees what it saw when the engine raised ApiError."""
    busy = from_exception(EngineBusy("session", 3))
    assert (busy.kind, busy.status, busy.spec.retry_after) == ("engine_busy", 503, True)
    assert busy.message == ("this session already has 3 chunks queued (session_queue_depth); wait for their "
                            "responses before sending more")
    assert from_exception(EngineBusy("engine", 64)).message == (
        "the engine already has 64 jobs queued (engine_queue_depth); retry shortly")
    draining = from_exception(Draining("the engine has stopped"))
    assert (draining.kind, draining.status, draining.message) == ("draining", 503, "the engine has stopped")
    broken = from_exception(OutputFailed("video", "decoding this session's video", RuntimeError("x"), 7))
    assert (broken.kind, broken.status, broken.spec.ws_close) == ("internal_error", 500, 1011)
    assert broken.message == ("decoding this session's video failed (RuntimeError('x')); its refined latents up to "
                              "frame 7 are kept, but the session cannot produce video any more: start a new session")


def test_a_paged_in_session_waits_for_its_copies_before_its_chunk_touches_them(refiner, monkeypatch):
    """On CUDA a page-in's copies run on a side stream (``models.move``) and ``EngineSession.ready`` is their event:
    the engine's stream must wait for it before the session's tensors are read or written on the device, and the
    first such access is appending the next chunk to the paged-in pending frames (``_start``), before any model
    call. A stub stands in for torch.cuda's current stream: the order of the engine's steps is what is tested."""
    order = []

    class StubStream:
        def wait_event(self, event):
            order.append(("wait", event))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: StubStream())
    clip = make_clip(frames=7, seed=0)
    paged = target(refiner, "paged")
    paged.ready = event = object()  # what Parking.activate leaves for the engine
    append = paged.session.append

    def recording_append(chunk, flush=False):
        order.append(("append", None))
        return append(chunk, flush=flush)

    monkeypatch.setattr(paged.session, "append", recording_append)

    async def scenario(engine):
        return await engine.submit(Work(paged, *clip, flush=True))

    result = run_with_engine(refiner, scenario)
    assert order == [("wait", event), ("append", None)] and paged.ready is None
    assert torch.equal(torch.cat([u.latents for u in result.units], dim=2), expected_clip(refiner, *clip))


def _stream_whole(client, session_id: str, latents, embeds, mask) -> None:
    """The clip over the session's WebSocket stream in one message, flushed, read until ``done``."""
    from tests.app.conftest import payload

    with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
        ws.send_bytes(payload(latents, embeds, mask))
        ws.send_text('{"type": "flush"}')
        while not (text := ws.receive().get("text")) or '"done"' not in text:
            pass


def test_a_deleted_session_is_not_held_by_the_idle_engine_thread(make_settings):
    """The engine thread kept the work it last admitted in its loop's locals while it waited for more: a stream's
    work holds its unit callback, so the last session streamed (its handle, its KV cache: device memory on CUDA)
    stayed referenced after it was deleted, until other work came. Nothing else runs here after the deletion."""
    import gc
    import weakref

    from tests.app.conftest import running_app, wait_until

    latents, embeds, mask = make_clip(frames=4)
    with running_app(make_settings(warmup=False, batching="false")) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        _stream_whole(client, session_id, latents, embeds, mask)
        live = client.app.state.services.registry.get(session_id)
        handle, session = weakref.ref(live), weakref.ref(live.session)
        del live
        assert client.delete(f"/v1/sessions/{session_id}").status_code == 204

        def let_go() -> bool:
            gc.collect()
            return handle() is None and session() is None

        wait_until(let_go, "the deleted session and its model state to be let go", timeout=10)


@pytest.mark.parametrize("deferred", [False, True], ids=["cpu-check", "deferred-check"])
def test_served_blocks_leave_no_tensor_to_the_cyclic_collector(make_settings, monkeypatch, deferred):
    """A session's blocks served over HTTP free every tensor they made by reference counting: none waits for Python's
    cyclic collector, which runs when it likes (on a GPU, memory that grows block by block until it does: a cycle
    in the model's cache view did that on an H200). ``deferred``: the finite check read late, as on an accelerator."""
    import gc

    from tests.app.conftest import OCTET, payload, running_app

    monkeypatch.setattr(RefinerSession, "defer_finite_check", deferred)
    latents, embeds, mask = make_clip(frames=1 + 3 * 7, seed=5)
    with running_app(make_settings()) as client:
        sid = client.post("/v1/sessions").json()["session_id"]
        reply = client.post(f"/v1/sessions/{sid}/chunks?seq=0", content=payload(latents[:, :, :4], embeds, mask),
                            headers=OCTET)
        assert reply.status_code == 200, reply.text
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for seq in range(1, 7):
                chunk = latents[:, :, 1 + 3 * seq : 4 + 3 * seq]
                reply = client.post(f"/v1/sessions/{sid}/chunks?seq={seq}", content=payload(chunk), headers=OCTET)
                assert reply.status_code == 200, reply.text
            gc.collect()
            left = [(tuple(o.shape), o.dtype) for o in gc.garbage if isinstance(o, torch.Tensor)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            if collecting:
                gc.enable()
        assert not left, f"tensors freed only by the cyclic collector: {left[:8]}"


@pytest.mark.parametrize("fed", ["http", "stream"])
def test_a_deleted_session_is_freed_without_the_cyclic_collector(make_settings, fed):
    """A deleted session (its handle, its model state: the KV cache, ~9.6 GiB of device memory at 720p) is freed
    by reference counting alone. Its deliveries' callbacks held the handle that holds them: a cycle, so every ended
    session stayed until Python's cyclic collector happened to run (the test above collects, and did not see it)."""
    import gc
    import weakref

    from tests.app.conftest import OCTET, payload, running_app, wait_until

    latents, embeds, mask = make_clip(frames=7, seed=3)
    with running_app(make_settings(warmup=False, batching="false")) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            if fed == "http":
                for seq, chunk in enumerate((latents[:, :, :4], latents[:, :, 4:])):
                    body = payload(chunk, embeds, mask) if seq == 0 else payload(chunk)
                    reply = client.post(f"/v1/sessions/{session_id}/chunks?seq={seq}", content=body, headers=OCTET)
                    assert reply.status_code == 200, reply.text
            else:
                _stream_whole(client, session_id, latents, embeds, mask)
            live = client.app.state.services.registry.get(session_id)
            handle, session = weakref.ref(live), weakref.ref(live.session)
            del live
            assert client.delete(f"/v1/sessions/{session_id}").status_code == 204
            wait_until(lambda: handle() is None and session() is None,
                       "the deleted session to be freed with no collection", timeout=10)
        finally:
            if collecting:
                gc.enable()
