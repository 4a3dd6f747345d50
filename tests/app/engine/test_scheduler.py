"""The scheduler alone, without a model: plain records in, a plan out (app.engine.scheduler)."""

from __future__ import annotations

import pytest

from app.engine.scheduler import ModelCall, Ready, Scheduler


def woken(*sessions, **kwargs) -> Scheduler:
    scheduler = Scheduler(**kwargs)
    for session in sessions:
        scheduler.wake(session)
    return scheduler


def run(scheduler: Scheduler, ready: list[Ready]) -> tuple:
    """Plan one call, hand it back as served; the sessions it holds."""
    call = scheduler.plan_call(ready)
    assert call is not None
    scheduler.served(call)
    return call.sessions


def test_the_first_ready_session_and_the_following_ones_of_its_group_form_the_call():
    scheduler = woken("a", "b", "c", "d")
    call = scheduler.plan_call([Ready("d", 1, 16), Ready("c", 1, 16), Ready("b", 1, 64), Ready("a", 1, 16)])
    # Turn order decides, not the order the records came in; b is of another group and waits.
    assert call.sessions == ("a", "c", "d") and call.rows == 3


def test_a_session_of_another_group_goes_first_next_time_and_no_group_starves():
    scheduler = woken("a1", "a2", "a3", "b")
    ready = [Ready("a1", 1, "A"), Ready("a2", 1, "A"), Ready("a3", 1, "A"), Ready("b", 1, "B")]
    assert run(scheduler, ready) == ("a1", "a2", "a3")
    assert scheduler.ring == ("b", "a1", "a2", "a3")  # served ones went to the back
    assert run(scheduler, ready) == ("b",)
    # Groups alternate however many sessions one group has: B is served every other call.
    served = [run(scheduler, ready) for _ in range(6)]
    assert served[1::2] == [("b",)] * 3 and all("b" not in call for call in served[0::2])


def test_the_call_holds_at_most_max_batch_rows_rows_and_later_fitting_ones_still_join():
    scheduler = woken("a", "b", "c", "d", max_batch_rows=4)
    call = scheduler.plan_call([Ready("a", 2, "g"), Ready("b", 3, "g"), Ready("c", 1, "g"), Ready("d", 1, "g")])
    assert call.sessions == ("a", "c", "d") and call.rows == 4  # b (3 rows) would make 5
    scheduler.served(call)
    assert scheduler.ring == ("b", "a", "c", "d")


def test_a_forward_wider_than_the_limit_still_runs_alone():
    scheduler = woken("wide", "narrow", max_batch_rows=2)
    assert run(scheduler, [Ready("wide", 3, "g"), Ready("narrow", 1, "g")]) == ("wide",)
    assert run(scheduler, [Ready("wide", 3, "g"), Ready("narrow", 1, "g")]) == ("narrow",)


def test_batching_off_puts_one_session_in_each_call_in_turn():
    scheduler = woken("a", "b", "c", batching=False)
    ready = [Ready(s, 1, "g") for s in ("a", "b", "c")]
    assert [run(scheduler, ready) for _ in range(4)] == [("a",), ("b",), ("c",), ("a",)]


def test_nothing_ready_is_no_call_and_a_session_that_sleeps_leaves_the_ring():
    scheduler = woken("a", "b")
    assert scheduler.plan_call([]) is None
    scheduler.sleep("a")
    scheduler.wake("b")  # already in: keeps its place
    scheduler.wake("c")
    assert scheduler.ring == ("b", "c") and "a" not in scheduler
    with pytest.raises(ValueError, match="not in the ring"):
        scheduler.plan_call([Ready("a", 1, "g")])


def test_a_session_that_left_the_ring_during_its_call_is_not_put_back():
    scheduler = woken("a", "b")
    call = scheduler.plan_call([Ready("a", 1, "g"), Ready("b", 1, "g")])
    scheduler.sleep("a")  # its work settled while the call ran
    scheduler.served(call)
    assert scheduler.ring == ("b",)


def test_output_steps_run_one_per_waiting_session_per_iteration_in_the_order_they_started_waiting():
    scheduler = woken("v1", "v2", "plain")
    assert not scheduler.outputs_pending and scheduler.plan_outputs() == ()
    scheduler.output_pending("v2")
    scheduler.output_pending("v1")
    scheduler.output_pending("v2")  # a second pending step: still one turn per iteration, same place
    assert scheduler.outputs_pending and scheduler.plan_outputs() == ("v2", "v1")
    scheduler.output_idle("v2")
    assert scheduler.plan_outputs() == ("v1",)
    scheduler.output_pending("v2")
    assert scheduler.plan_outputs() == ("v1", "v2")


def test_output_steps_interleave_with_model_calls():
    """A driver like the engine's loop: each iteration one call, then one step per session with steps pending. A
    decoding session with many pending steps delays the others' calls by one step per iteration, no more."""
    scheduler = woken("video", "plain")
    pending = {"video": 0}
    timeline = []
    for _ in range(4):
        call = scheduler.plan_call([Ready("video", 1, "g"), Ready("plain", 1, "g")])
        scheduler.served(call)
        timeline.append(("call", call.sessions))
        pending["video"] += 2  # each call commits units that need two steps (say, a slow decoder)
        scheduler.output_pending("video")
        steps = scheduler.plan_outputs()
        timeline.append(("steps", steps))
        for session in steps:
            pending[session] -= 1
            if not pending[session]:
                scheduler.output_idle(session)
    assert [entry for entry in timeline if entry[0] == "call"] == [("call", ("video", "plain"))] * 4
    assert [entry for entry in timeline if entry[0] == "steps"] == [("steps", ("video",))] * 4
    assert pending["video"] == 4  # the backlog waits; the model calls never did


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_batch_rows"):
        Scheduler(max_batch_rows=0)


def test_a_model_call_counts_its_rows():
    assert ModelCall((Ready("a", 2, "g"), Ready("b", 3, "g"))).rows == 5
