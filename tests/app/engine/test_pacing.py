"""Real-time pacing (app.engine.pacing): block deadlines and late blocks on a deterministic clock, through the engine
and the service (session JSON, /metrics), and admission by the measured cost per row (503 over_capacity)."""

from __future__ import annotations

import pytest

from app.core.error_kinds import ApiError
from app.engine.pacing import CostModel, Demand, Pacer, Pacing, check_admission

from tests.app.conftest import OCTET, make_clip, metric_value, payload, running_app, wait_until


# --- deadlines, on a clock the test owns ---------------------------------------------------------------------------
def test_a_block_is_late_when_committed_after_its_last_frame_arrived_plus_its_playback_time():
    pacing = Pacing(fps=16.0, temporal=8)  # one latent frame = 8 pixel frames = 0.5 s; a 3-frame block: 1.5 s
    assert pacing.playback_seconds(3) == 1.5
    pacing.arrived(4, at=0.0)  # sink (frame 0) and block [1, 4) in one chunk at t = 0
    pacing.arrived(7, at=1.0)  # block [4, 7) at t = 1
    pacing.arrived(8, at=2.0)  # the first frame of block [7, 10)
    pacing.arrived(10, at=5.0)  # its last two frames
    assert pacing.committed(1, 4, at=1.25) == -0.25  # deadline 0 + 1.5: early
    assert pacing.committed(4, 7, at=3.0) == 0.5  # deadline 1 + 1.5: late by 0.5 s
    assert pacing.committed(7, 10, at=6.0) == -0.5  # its last frame (9) arrived at 5: deadline 6.5
    assert pacing.status() == {"late_blocks": 1, "paced_blocks": 3, "last_lateness_s": -0.5, "worst_lateness_s": 0.5}
    assert not pacing.arrivals  # every arrival was consumed


def test_frames_sent_again_after_a_rollback_take_their_new_arrival():
    pacing = Pacing(fps=16.0, temporal=8)
    pacing.arrived(4, at=0.0)
    pacing.arrived(7, at=1.0)  # a chunk that failed and was rolled back...
    pacing.arrived(7, at=9.0)  # ... and retried
    assert pacing.committed(1, 4, at=1.0) < 0
    assert pacing.committed(4, 7, at=10.0) == pytest.approx(-0.5)  # from the retry: 9 + 1.5


def test_an_undone_block_puts_the_pacing_back_as_it_was_before_it():
    pacing = Pacing(fps=16.0, temporal=8)
    pacing.arrived(4, at=0.0)
    pacer = Pacer(clock=lambda: 9.0)
    paced = pacer.committed(pacing, "block", 1, 4, verdict_pending=True)
    assert paced.lateness == 7.5 and pacing.status()["late_blocks"] == 1 and not pacing.arrivals
    pacer.undo(paced)
    assert pacing.status() == Pacing(fps=16.0, temporal=8).status() and list(pacing.arrivals) == [(4, 0.0)]


# --- a block undone by a late NaN/Inf verdict ---------------------------------------------------------------------
def _paced_with_a_poisoned_block(deferred: bool, atomic: bool) -> dict:
    """A real-time session (16 fps: a 3-frame block plays 1.5 s) on an engine whose pacing clock the test sets: sink
    and two blocks on time, then a block refined to NaN (tests/app/outputs/test_delivery_finite.py's ``Poison``)
    that would be 7.5 s late, then its retry on time. ``deferred``: its verdict read after its commit (the
    accelerator's path, ``RefinerSession.defer_finite_check``), so the engine commits the block and then undoes it;
    otherwise the commit refuses it (the CPU's path) and the pacer never sees it."""
    import asyncio

    from app.core.metrics import Metrics
    from app.engine.worker import Engine, EngineSession, Work
    from models import RefinerSession, SessionConfig, from_model
    from models.checkpoints import build_model
    from models.errors import NonFiniteOutputError
    from tests.app.outputs.test_delivery_finite import CONFIG, Poison
    from tests.models.conftest import make_inputs

    refiner = from_model(build_model("tiny"))
    latents, embeds = make_inputs(frames=10, seed=3)
    poison = Poison(refiner.model)
    session = RefinerSession(refiner, SessionConfig(**CONFIG))
    session.defer_finite_check = deferred
    target = EngineSession(session=session, name="paced", pacing=Pacing(fps=16.0, temporal=8))
    metrics = Metrics()
    engine = Engine(metrics, 8, 4)
    engine.model = refiner.model
    now = [0.5]
    engine.pacer.clock = lambda: now[0]
    seen = {}

    def work(frames, at, **options):
        return Work(target, frames, atomic=atomic, submitted_at=at, **options)

    async def scenario():
        await engine.run(work(latents[:, :, :7], 0.0, prompt_embeds=embeds))  # blocks [1, 4), [4, 7) by 0.5: early
        seen["before"] = await engine.call(lambda: target.pacing.status())
        now[0], poison.armed = 10.0, True  # arrived at 1.0, deadline 2.5: 7.5 s late if it counted
        with pytest.raises(NonFiniteOutputError):
            await engine.run(work(latents[:, :, 7:10], 1.0))
        poison.armed = False
        seen["after"] = await engine.call(lambda: (target.pacing.status(), list(target.pacing.arrivals)))
        await engine.run(work(latents[:, :, 7:10], 9.5))  # the retry: deadline 11.0, committed at 10.0
        seen["retried"] = target.pacing.status()

    engine.start()
    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        engine.stop()
        poison.close()
    seen["metrics"] = tuple(metrics.registry.get_sample_value(f"refiner_{name}_blocks_total")
                            for name in ("paced", "late"))
    return seen


@pytest.mark.parametrize("atomic", [True, False], ids=["http_chunk", "stream_message"])
def test_a_block_undone_by_a_late_verdict_is_neither_paced_nor_late_and_its_retry_has_its_own_deadline(atomic):
    late = _paced_with_a_poisoned_block(deferred=True, atomic=atomic)
    at_commit = _paced_with_a_poisoned_block(deferred=False, atomic=atomic)
    assert late == at_commit  # the undone block counts exactly as the block the CPU path never committed
    early = {"late_blocks": 0, "paced_blocks": 2, "last_lateness_s": -1.0, "worst_lateness_s": -1.0}
    assert late["before"] == early
    assert late["after"] == (early, [(10, 1.0)])  # its frames' arrival listed again, as before the block
    assert late["retried"] == {"late_blocks": 0, "paced_blocks": 3, "last_lateness_s": -1.0,
                               "worst_lateness_s": -1.0}
    assert late["metrics"] == (3.0, 0.0)


def test_the_cost_model_is_an_ewma_per_row_by_tokens_and_scales_unseen_token_counts():
    cost = CostModel(weight=0.5)
    assert cost.per_row(48) is None
    cost.observe(48, rows=2, seconds=0.4)  # 0.2 s per row
    cost.observe(48, rows=1, seconds=0.4)  # 0.4: the average moves half way
    assert cost.per_row(48) == pytest.approx(0.3)
    assert cost.per_row(96) == pytest.approx(0.6)  # scaled from the nearest measured count
    cost.observe(96, rows=1, seconds=0.5)
    assert cost.per_row(96) == 0.5


# --- through the service ---------------------------------------------------------------------------------------------
def metric(client, name: str) -> float:
    return metric_value(client.get("/metrics").text, name)


def test_a_session_whose_blocks_come_later_than_its_fps_counts_late_blocks_and_one_in_time_none(make_settings):
    """Two realtime sessions get the same clip in the same chunks. The engine's pacing clock runs 20 s ahead of the
    arrival clock, standing in for an engine 20 s behind: at 16 fps a 3-frame block plays 1.5 s, so every block of
    that session is late; at fps 0.5 it plays 48 s, so none is (whatever the real compute time, far under 28 s)."""
    latents, embeds, mask = make_clip(frames=10)
    with running_app(make_settings(warmup=False, batching=False)) as client:
        pacer = client.app.state.services.engine.pacer
        real_clock = pacer.clock
        pacer.clock = lambda: real_clock() + 20.0
        fast = client.post("/v1/sessions", json={"realtime": True, "fps": 16.0}).json()
        slow = client.post("/v1/sessions", json={"realtime": True, "fps": 0.5}).json()
        plain = client.post("/v1/sessions", json={}).json()
        assert fast["config"]["realtime"] is True and plain["config"]["realtime"] is False
        for created in (fast, slow, plain):
            sid = created["session_id"]
            for seq, start in enumerate(range(0, 10, 4)):
                prompt = (embeds, mask) if start == 0 else (None, None)
                response = client.post(f"/v1/sessions/{sid}/chunks?seq={seq}", content=payload(
                    latents[:, :, start : start + 4], *prompt), headers=OCTET)
                assert response.status_code == 200, response.text
        states = {name: client.get(f"/v1/sessions/{c['session_id']}").json()
                  for name, c in (("fast", fast), ("slow", slow), ("plain", plain))}
        listed = {s["session_id"]: s for s in client.get("/v1/sessions").json()["sessions"]}
        late_total = metric(client, "refiner_late_blocks_total")
        paced_total = metric(client, "refiner_paced_blocks_total")
    blocks = states["fast"]["blocks_refined"]
    assert blocks == 3  # frames [1, 4), [4, 7), [7, 10) after the sink
    assert states["fast"]["late_blocks"] == states["fast"]["paced_blocks"] == blocks
    assert 18.0 < states["fast"]["last_lateness_s"] <= states["fast"]["worst_lateness_s"] < 20.0
    assert states["slow"]["late_blocks"] == 0 and states["slow"]["paced_blocks"] == blocks
    assert -48.0 + 20.0 < states["slow"]["worst_lateness_s"] < 0
    assert states["plain"]["late_blocks"] is None and states["plain"]["config"]["realtime"] is False
    assert listed[fast["session_id"]]["late_blocks"] == blocks and listed[fast["session_id"]]["realtime"] is True
    assert (late_total, paced_total) == (blocks, 2 * blocks)


def test_realtime_must_be_a_json_boolean(make_settings):
    with running_app(make_settings(warmup=False, batching=False)) as client:
        response = client.post("/v1/sessions", json={"realtime": "yes"})
        assert response.status_code == 422 and "realtime" in response.json()["error"]["message"]
        assert client.post("/v1/sessions", json={"realtime": 1}).status_code == 422
        put = client.put("/v1/sessions/realtime-0001", json={"realtime": True})
        assert put.status_code == 201, put.text
        again = client.put("/v1/sessions/realtime-0001", json={"realtime": False})
        assert again.status_code == 409 and "realtime: True there, False asked" in again.json()["error"]["message"]


# --- admission -------------------------------------------------------------------------------------------------------
def test_admission_refuses_the_session_that_would_overload_the_engine_by_the_measured_cost(make_settings):
    """The measured cost is injected: 93.75 ms per row at the warm-up geometry's 48 tokens per block (4x4 latents,
    3 frames). A default realtime session runs 4 forwards per 1.5 s block: 0.25 s of model time per second of video.
    With admission_max_load 1.0, four fit and the fifth is refused; sessions that are not real time still come in,
    and one realtime session fewer makes room again."""
    settings = make_settings(warmup=False, batching=False, admission="realtime", admission_max_load=1.0,
                             warmup_height=4, warmup_width=4, retry_after_s=3)
    with running_app(settings) as client:
        # Before any model call there is no figure to refuse by.
        first = client.post("/v1/sessions", json={"realtime": True})
        assert first.status_code == 201
        client.app.state.services.engine.pacer.cost.set(48, 0.09375)
        admitted = [first.json()["session_id"]]
        admitted += [client.post("/v1/sessions", json={"realtime": True}).json()["session_id"] for _ in range(3)]
        refused = client.post("/v1/sessions", json={"realtime": True})
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"] == "3"
        error = refused.json()["error"]
        assert error["code"] == "over_capacity"
        for figure in ("4 real-time session(s) held need 1.00 s", "this one 0.25 s", "93.8 ms measured per row",
                       "48 tokens", "1.25 in all", "admission_max_load of 1"):
            assert figure in error["message"], (figure, error["message"])
        # The same figures as fields (issue 25 item 6), so that a client never parses the prose.
        assert (error["load_held"], error["load_needed"], error["max_load"]) == (1.0, 0.25, 1.0)
        assert client.post("/v1/sessions", json={}).status_code == 201  # not real time: by count only
        info = client.get("/v1/info").json()["engine"]["realtime"]
        assert info["realtime_sessions"] == 4 and info["realtime_load"] == pytest.approx(1.0)
        assert info["seconds_per_row_by_tokens"] == {"48": 0.09375}
        assert client.delete(f"/v1/sessions/{admitted[0]}").status_code == 204
        assert client.post("/v1/sessions", json={"realtime": True}).status_code == 201
        assert client.post("/v1/sessions", json={"realtime": True}).status_code == 503


@pytest.mark.parametrize("admission", ["none", "count"])  # count: the specification's name for none
def test_without_admission_realtime_sessions_are_admitted_by_count(make_settings, admission):
    with running_app(make_settings(warmup=False, batching=False, max_sessions=3, admission=admission)) as client:
        client.app.state.services.engine.pacer.cost.set(48, 10.0)  # hopeless, but admission is none
        assert [client.post("/v1/sessions", json={"realtime": True}).status_code for _ in range(4)] == [201] * 3 + [503]


def test_a_session_costed_at_its_own_geometry_once_known():
    cost = CostModel()
    cost.set(48, 0.1)
    held = [Demand(forwards=4, rows=2, tokens=192, block_seconds=1.5)]  # 8x8 latents, batch 2: 4 x 2 x 0.4 / 1.5
    new = Demand(forwards=4, rows=1, tokens=48, block_seconds=1.5, known=False)
    assert held[0].load(cost) == pytest.approx(4 * 2 * 0.4 / 1.5)
    with pytest.raises(ApiError, match="costed at the warm-up geometry") as refused:
        check_admission(cost, held, new, max_load=2.2)
    assert refused.value.kind == "over_capacity"
    check_admission(cost, held, new, max_load=2.5)  # 2.4 in all fits


def test_a_spilled_realtime_session_comes_back_realtime(make_settings, tmp_path):
    """A session's file carries its realtime flag: paged back in from snapshot_dir (as after a drain or on another
    replica), it keeps its deadlines and its count goes on."""
    latents, embeds, mask = make_clip(frames=10)
    settings = make_settings(warmup=False, batching=False, snapshot_dir=tmp_path / "spill", park_after_s=0.1,
                             spill_after_s=0.3)
    with running_app(settings) as client:
        sid = client.post("/v1/sessions", json={"realtime": True, "fps": 16.0}).json()["session_id"]
        first = client.post(f"/v1/sessions/{sid}/chunks?seq=0", content=payload(latents[:, :, :7], embeds, mask),
                            headers=OCTET)
        assert first.status_code == 200, first.text
        wait_until(lambda: client.get(f"/v1/sessions/{sid}").json()["state"] == "spilled", "the session to spill")
        assert client.app.state.services.registry.handles() == []
        second = client.post(f"/v1/sessions/{sid}/chunks?seq=1", content=payload(latents[:, :, 7:]), headers=OCTET)
        assert second.status_code == 200, second.text
        state = client.get(f"/v1/sessions/{sid}").json()
    assert state["state"] == "active" and state["config"]["realtime"] is True
    assert state["paced_blocks"] == 1 and state["blocks_refined"] == 3  # the block refined after the page-in
