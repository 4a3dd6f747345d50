"""Two replicas sharing a snapshot folder without checkpoints (issue 25 item 4): a live session holds its lease
from its creation, so another replica never forks it, and a sweep deletes only what no replica used within its
retention. Two in-process servers on one folder."""

from __future__ import annotations

import asyncio
import time

import httpx

from app.persistence.leases import generations

from tests.app.conftest import DEADLINE_S, OCTET, LiveServer, make_clip, payload, wait_until


def test_a_session_live_on_one_replica_is_not_created_again_on_another(make_settings, tmp_path):
    """Before: a PUT of an id live on A, sent to B, answered 201 (B saw no file and no lease): two live copies.
    Now B answers 503 session_moved naming A (with Retry-After) for as long as A holds the session, whatever the
    config; once A ends the session its lease goes and B may create the id."""
    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=4)
    common = dict(warmup=False, snapshot_dir=folder, session_lease_s=1.5)
    with LiveServer(make_settings(replica_id="replica-a", **common)) as a, \
            LiveServer(make_settings(replica_id="replica-b", **common)) as b, \
            httpx.Client(base_url=a.base_url, timeout=DEADLINE_S) as on_a, \
            httpx.Client(base_url=b.base_url, timeout=DEADLINE_S) as on_b:
        assert on_a.put("/v1/sessions/forked-session-1", json={"block_size": 2}).status_code == 201
        assert generations(folder, "forked-session-1") == [1], "the lease is taken at creation, no checkpoint needed"
        posted = on_a.post("/v1/sessions").json()["session_id"]  # a server-named session holds one too
        assert generations(folder, posted) == [1]
        for attempt in range(4):  # across more than a lease period: A keeps renewing it
            body = {"block_size": 2} if attempt % 2 == 0 else {"block_size": 2, "seed": 5}
            refused = on_b.put("/v1/sessions/forked-session-1", json=body)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "session_moved" and "replica-a" in error["message"], error
            assert 1 <= int(refused.headers["retry-after"]) <= 2
            time.sleep(0.6)
        assert "forked-session-1" not in {h.id for h in b.services.registry.handles()}
        reply = on_a.post("/v1/sessions/forked-session-1/chunks?seq=0", content=payload(latents, embeds, mask),
                          headers=OCTET)
        assert reply.status_code == 200 and reply.headers["x-replica"] == "replica-a"
        assert on_b.put("/v1/sessions/forked-session-1", json={"block_size": 2}).status_code == 503

        assert on_a.delete("/v1/sessions/forked-session-1").status_code == 204
        wait_until(lambda: generations(folder, "forked-session-1") == [], "the ended session's lease to go")
        created = on_b.put("/v1/sessions/forked-session-1", json={"block_size": 2})
        assert created.status_code == 201 and created.headers["x-replica"] == "replica-b", created.text
        assert on_a.put("/v1/sessions/forked-session-1", json={"block_size": 2}).status_code == 503


async def _sweep(sweep) -> list[str]:
    return await asyncio.to_thread(sweep.expired_files)


def test_a_spilled_session_polled_through_its_owner_survives_another_replicas_sweep(make_settings, tmp_path):
    """Before: B's sweep read the file's age (its write time) and deleted a session spilled on A that a client
    polled through A every few seconds. Now each GET of a spilled session records its use in the folder (the
    file's modification time), so B deletes only the spilled session nobody asked for within its retention.
    (A's retention is long here so that only B's sweep deletes anything.)"""
    folder = tmp_path / "shared"
    latents, embeds, mask = make_clip(frames=4)
    spill = dict(warmup=False, snapshot_dir=folder, park_after_s=0.1, spill_after_s=0.2)
    with LiveServer(make_settings(replica_id="replica-a", session_retention_s=600, **spill)) as a, \
            LiveServer(make_settings(replica_id="replica-b", session_retention_s=2.0, warmup=False,
                                     snapshot_dir=folder)) as b, \
            httpx.Client(base_url=a.base_url, timeout=DEADLINE_S) as on_a:
        for session_id in ("polled-session-1", "forgotten-session-1"):
            assert on_a.put(f"/v1/sessions/{session_id}", json={"block_size": 2}).status_code == 201
            assert on_a.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=payload(latents, embeds, mask),
                             headers=OCTET).status_code == 200
        for session_id in ("polled-session-1", "forgotten-session-1"):
            wait_until(lambda: on_a.get(f"/v1/sessions/{session_id}").json()["state"] == "spilled",
                       f"{session_id} to spill")
        assert generations(folder, "polled-session-1") == [], "a spilled session is adoptable at once"
        polling_until = time.monotonic() + 3.0  # past B's retention (2 s) since the spill
        while time.monotonic() < polling_until:
            polled = on_a.get("/v1/sessions/polled-session-1")
            assert polled.status_code == 200 and polled.json()["state"] == "spilled"
            time.sleep(0.4)
        forgotten = b.on_loop(_sweep(b.services.sweep)).result(DEADLINE_S)
        assert forgotten == ["forgotten-session-1"], forgotten
        assert (folder / "polled-session-1.session.safetensors").is_file()
        assert not (folder / "forgotten-session-1.session.safetensors").exists()
        kept = on_a.get("/v1/sessions/polled-session-1")
        assert kept.status_code == 200 and kept.json()["frames_received"] == 4
