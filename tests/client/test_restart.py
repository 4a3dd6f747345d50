"""A server restart in the middle of ``session.stream(...)``: ``python -m app serve`` with a snapshot_dir is
SIGTERMed (it drains, saves the session, closes the stream with 1012) and started again on the same port while
the client still has chunks to send. The client reconnects by itself and the refined clip is bit-identical to an
uninterrupted stream on the same server."""

from __future__ import annotations

import threading

import numpy as np

from bench.live import ServerProcess, free_port
from wm_refiner_client import Client, RetryPolicy, concat

from .conftest import chunks_of, clip

LATENTS, PROMPT, MASK = clip(17)
SIZES = [4, 3, 3, 3, 2]


def test_stream_survives_sigterm_and_restart(checkpoint_dir, tmp_path):
    port = free_port()
    settings = dict(model=str(checkpoint_dir), device="cpu", dtype="float32")
    first = ServerProcess(port, tmp_path / "cache", tmp_path / "snapshots", tmp_path / "server.log", **settings)
    first.start()
    restarted: list[ServerProcess] = []
    restart_done = threading.Event()
    try:
        # Patient enough for a restart (a few seconds here), quick to notice it is back.
        with Client(first.base_url, retry=RetryPolicy(attempts=60, backoff_s=0.1, max_backoff_s=1.0)) as client:
            uninterrupted = concat(client.create_session().stream(chunks_of(LATENTS, SIZES), prompt=PROMPT,
                                                                   prompt_mask=MASK))
            assert np.array_equal(uninterrupted, client.refine(LATENTS, PROMPT, MASK).latents)

            stopped = threading.Event()

            def chunks():
                parts = chunks_of(LATENTS, SIZES)
                yield from parts[:2]
                assert stopped.wait(60)
                yield from parts[2:]  # to a server that is gone or not back yet: resent after the reconnect

            def restart() -> None:
                try:
                    first.terminate()  # SIGTERM: drain, snapshot, close 1012
                    stopped.set()
                    restarted.append(ServerProcess(port, tmp_path / "cache", tmp_path / "snapshots",
                                                   tmp_path / "server.log", **settings).start())
                finally:
                    stopped.set()
                    restart_done.set()

            session = client.create_session()
            stream = session.stream(chunks(), prompt=PROMPT, prompt_mask=MASK)
            units = []
            for unit in stream:
                units.append(unit)
                if len(units) == 2:  # the sink and the first block are in: restart mid-stream
                    threading.Thread(target=restart, daemon=True).start()
            assert restart_done.wait(120) and restarted, first.log()
            state = session.state()
    finally:
        first.kill()
        for server in restarted:
            server.terminate()
    assert stream.stats.reconnects >= 1
    assert [(u.frame_start, u.frame_end) for u in units][0] == (0, 1) and units[-1].frame_end == 17
    assert np.array_equal(concat(units), uninterrupted)
    assert state.frames_received == 17 and state.flushed
