"""A crash checkpoint behind the frames the client already got (issue 16 item 9): replica A is killed (kill -9)
after units went past its last checkpoint; replica B, on the same snapshot folder, adopts that checkpoint once A's
lease expired. The client (sync and asyncio share the state machine: ``protocol.StreamProtocol``) kept every
message that was not durable yet, resends from the checkpoint, and ends with the frames of an uninterrupted run,
no unit twice. Also: what it keeps is bounded."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from bench.live import ServerProcess, free_port
from wm_refiner_client import Client, ProtocolError, RetryPolicy, concat
from wm_refiner_client.resume import ChunkSource

from .conftest import chunks_of, clip
from .proxy import Proxy

LATENTS, PROMPT, MASK = clip(17)
SIZES = [2] * 8 + [1]  # one block a message: a checkpoint every 3 blocks falls between messages, behind the units


def test_a_stream_survives_a_kill_after_its_units_went_past_the_last_checkpoint(checkpoint_dir, tmp_path):
    folder = tmp_path / "shared"
    common = dict(model=str(checkpoint_dir), device="cpu", dtype="float32", checkpoint_every_blocks=3,
                  session_lease_s=1.0)
    a = ServerProcess(free_port(), tmp_path / "cache", folder, tmp_path / "a.log", replica_id="replica-a", **common)
    b = ServerProcess(free_port(), tmp_path / "cache", folder, tmp_path / "b.log", replica_id="replica-b", **common)
    a.start()
    b.start()
    retry = RetryPolicy(attempts=60, backoff_s=0.1, max_backoff_s=1.0)
    try:
        with Client(b.base_url, retry=retry) as direct:
            uninterrupted = concat(direct.create_session(block_size=2).stream(chunks_of(LATENTS, SIZES),
                                                                              prompt=PROMPT, prompt_mask=MASK))
        with Proxy(a.port) as router, Client(router.base_url, retry=retry) as client:
            killed = threading.Event()

            def chunks():
                parts = chunks_of(LATENTS, SIZES)
                yield from parts[:6]  # frames [0, 12): refined up to 11; the last checkpoint covers 8
                assert killed.wait(60)
                yield from parts[6:]

            session = client.create_session(block_size=2)
            stream = session.stream(chunks(), prompt=PROMPT, prompt_mask=MASK)
            units, durable_seen = [], []
            for unit in stream:
                units.append(unit)
                durable_seen.append(int(unit.metadata.get("durable_frames", -1)))
                if unit.frame_end == 11 and not killed.is_set():
                    state = httpx.get(f"{a.base_url}/v1/sessions/{session.id}").json()
                    assert state["durable_frames"] == 8 and state["frames_returned"] == 11, state
                    a.kill()  # kill -9: no drain, no goodbye
                    router.target = ("127.0.0.1", b.port)  # the router sends the session's id elsewhere now
                    router.cut()
                    killed.set()
            final = session.state()
    finally:
        a.kill()
        b.terminate()
    assert stream.stats.reconnects >= 1
    assert final.frames_received == 17 and final.flushed
    assert [(u.frame_start, u.frame_end) for u in units][:2] == [(0, 1), (1, 3)]
    assert all(earlier.frame_end == later.frame_start for earlier, later in zip(units, units[1:])), "a unit twice"
    assert units[-1].frame_end == 17
    assert np.array_equal(concat(units), uninterrupted)
    assert max(durable_seen) >= 8 and min(durable_seen) >= 0, "every unit says what is durable"


def test_what_the_client_keeps_for_a_crash_is_bounded():
    """Refined but not durable input is kept up to max_kept_bytes; input not refined yet is always kept; a rewind
    behind what was let go says why."""
    latents = np.zeros((1, 4, 10, 2, 2), dtype=np.float32)  # 64 bytes a frame
    source = ChunkSource(max_kept_bytes=64 * 4)
    for start in range(0, 10, 2):
        source.add(latents[:, :, start : start + 2])
    source.durable(0)  # the server checkpoints: keep until durable
    source.confirm(6)
    assert source.kept_frames == 10 - 2, "frames [2, 6) fit the bound, [0, 2) went"
    source.confirm(10)
    assert source.kept_frames == 4, "refined: only the bound's worth is kept"
    source.durable(8)
    assert source.kept_frames == 2
    with pytest.raises(ProtocolError, match="max_resend_bytes"):
        source.rewind(4)
    plain = ChunkSource(max_kept_bytes=64 * 4)
    plain.add(latents[:, :, :6])
    plain.add(latents[:, :, 6:])
    plain.confirm(6)
    assert plain.kept_frames == 4, "a server without checkpoints: kept until refined"
    unbounded = ChunkSource()
    unbounded.add(latents)
    unbounded.durable(0)
    unbounded.confirm(10)
    assert unbounded.kept_frames == 10, "no bound: kept until durable"


def unit_payload(start: int, end: int, durable: int | None) -> bytes:
    from safetensors.numpy import save

    metadata = {"frame_start": str(start), "frame_end": str(end), "latency_ms": "1.0"}
    if durable is not None:
        metadata["durable_frames"] = str(durable)
    return save({"latents": np.zeros((1, 4, end - start, 2, 2), dtype=np.float32)}, metadata=metadata)


def session_event(frames_received: int, frames_returned: int, durable: int | None) -> str:
    import json

    event = {"type": "session", "session_id": "s", "frames_received": frames_received,
             "frames_returned": frames_returned, "pending_frames": frames_received - frames_returned, "next_seq": 0,
             "flushed": False, "resume_from": 0, "resent_from": frames_returned}
    if durable is not None:
        event["durable_frames"] = durable
    return json.dumps(event)


def test_the_stream_state_machine_resends_from_a_checkpoint_behind_its_units():
    """What both clients run (``StreamProtocol``), without a server: units come back to frame 11 while the last
    checkpoint covers 8; the next connection's session event says the server has 8 frames (it adopted that
    checkpoint): the messages from frame 8 on are resent, and the units it refines again are not handed out twice."""
    from wm_refiner_client.protocol import NEED_CHUNK, StreamProtocol
    from wm_refiner_client.units import decode

    protocol = StreamProtocol("s", {"sink_frames": 1, "block_size": 2}, RetryPolicy())
    assert protocol.opened(session_event(0, 0, 0))
    latents = np.arange(1 * 4 * 12 * 2 * 2, dtype=np.float32).reshape(1, 4, 12, 2, 2)
    for start in range(0, 12, 2):
        assert protocol.next_message() == NEED_CHUNK
        protocol.add(latents[:, :, start : start + 2])
    for start, end, durable in [(0, 1, 0), (1, 3, 0), (3, 5, 0), (5, 7, 0), (7, 9, 8), (9, 11, 8)]:
        assert protocol.received(unit_payload(start, end, durable)) is not None
    assert protocol.source.kept_frames == 4, "frames [8, 12) are not durable yet"
    assert protocol.opened(session_event(8, 7, 8))  # another replica, from the checkpoint
    resent = [decode(protocol.next_message())["latents"] for _ in range(2)]
    assert np.array_equal(np.concatenate(resent, axis=2), latents[:, :, 8:12])
    assert protocol.received(unit_payload(7, 9, 8)) is None, "the caller has these frames"
    fresh = protocol.received(unit_payload(9, 12, 8))  # 12 frames were sent: a unit ends there at most
    assert (fresh.frame_start, fresh.frame_end) == (11, 12), "a straddling unit is trimmed to what is new"
