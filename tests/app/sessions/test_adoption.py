"""Adopting sessions from the shared snapshot folder under concurrency (issue 16 item 8): one adoption per id at a
time however the lookups interleave, and never more sessions than ``max_sessions`` however many adoptions run at
once."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from app.core.metrics import Metrics
from app.outputs.catalog import build_stages
from app.sessions.store import SessionStore

from tests.app.conftest import DEADLINE_S, OCTET, EngineHold, make_clip, payload, running_app, wait_until


def test_one_adoption_per_id_at_a_time_whatever_order_the_lookups_come_in(make_settings, tmp_path):
    """A lookup that arrives while an earlier one still waits for the id's adoption lock must queue behind it, not
    take a new lock of its own because the first holder already dropped the lock from the table."""
    folder = tmp_path / "shared"
    folder.mkdir()
    session_id = "adopted-session-1"
    (folder / f"{session_id}.session.safetensors").write_bytes(b"not read: _adopt is replaced")
    store = SessionStore(make_settings(snapshot_dir=folder), Metrics(), engine=SimpleNamespace(pacer=None),
                         encoder=None, refiner=lambda: None, stages=build_stages, deliveries=lambda handle: None)
    running, most = [0], [0]

    async def adopt(folder, session_id):
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.05)
        running[0] -= 1
        return None  # as when another replica won the file: the next waiter tries again

    store._adopt = adopt

    async def lookup() -> None:
        try:
            await store.lookup(session_id)
        except Exception:
            pass  # 404: nothing was adopted

    async def scenario() -> None:
        first = asyncio.ensure_future(lookup())
        await asyncio.sleep(0.01)  # the first holds the lock
        second = asyncio.ensure_future(lookup())
        await first  # the second now holds it; a third must wait for it
        await asyncio.sleep(0.01)
        third = asyncio.ensure_future(lookup())
        await asyncio.gather(second, third)

    asyncio.run(scenario())
    assert most[0] == 1, f"{most[0]} adoptions of one id ran at once"
    assert store._adopting == {}, "the lock table keeps no entry once nobody waits"


def test_concurrent_adoptions_never_exceed_max_sessions(make_settings, tmp_path):
    """Two sessions in the folder, a replica with room for one: both lookups pass the capacity check while their
    loads wait for the engine; only one may end up held, the other is refused with 503 too_many_sessions and its
    file stays in the folder."""
    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=4)
    ids = ["waiting-session-1", "waiting-session-2"]
    with running_app(make_settings(snapshot_dir=folder)) as a:
        for session_id in ids:
            assert a.put(f"/v1/sessions/{session_id}", json={}).status_code == 201
            assert a.post(f"/v1/sessions/{session_id}/chunks", content=payload(latents, embeds, mask),
                          headers=OCTET).status_code == 200
    with running_app(make_settings(snapshot_dir=folder, max_sessions=1)) as b:
        services = b.app.state.services
        hold = EngineHold()
        blocker = b.portal.start_task_soon(services.engine.call, hold)
        hold.wait_started()
        loads, call = [], services.engine.call

        async def counted(fn):
            loads.append(fn)
            return await call(fn)

        services.engine.call = counted
        statuses: dict[str, int] = {}
        threads = [threading.Thread(target=lambda s=s: statuses.update({s: b.get(f"/v1/sessions/{s}").status_code}))
                   for s in ids]
        for thread in threads:
            thread.start()
        # Both lookups are past the capacity check, their loads queued behind the hold (or refused already).
        wait_until(lambda: len(loads) + len(statuses) >= 2, "both adoptions to be under way")
        hold.release.set()
        blocker.result(DEADLINE_S)
        for thread in threads:
            thread.join(DEADLINE_S)
        assert sorted(statuses.values()) == [200, 503], statuses
        assert len(services.registry) == 1
        refused = next(s for s, status in statuses.items() if status == 503)
        assert (folder / f"{refused}.session.safetensors").is_file(), "the refused session's file stays"
