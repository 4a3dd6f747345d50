"""``python -m bench.soak``: many WebSocket sessions against a real server process, with faults, checked bit for bit.

The server runs as ``python -m app serve`` (the embedded tiny refiner, one torch thread, a snapshot folder).
Each session streams a seeded random clip in random splits over one WebSocket at a time. Faults are drawn up
front from the seed (``FaultPlan``): a client drops its connection abruptly (TCP abort, no close frame) right
after a given unit arrives or right after sending a given message, and once, when a given share of all frames has come back, the server gets SIGTERM and a new
server process is started on the same port and snapshot folder. Clients reconnect with ``?resume_from=<frames
received>``, read the ``session`` event, resend the frames the server does not have, and carry on.

Checked: every unit starts exactly where the previous one ended (nothing lost, nothing duplicated), every session
ends with ``done`` and its frames equal ``models.refine_clip`` of the same clip on the same checkpoint, computed in
this process, bit for bit; and the server's resident memory (VmRSS from /proc, sampled all along) stays flat:
the second half's peak does not exceed the first half's by more than a margin. Every wait has a deadline, so a
broken server fails the run instead of hanging it. The figures are printed (and returned by ``run_soak``).

Why the clients here speak the raw wire instead of ``wm_refiner_client``: the soak checks the server's side of the
resume protocol, so it must see what the server sends as it is (the library trims a replayed unit and would hide a
server that resends frames it should not), and it injects faults at points the library does not expose (a TCP
abort right after a given message was written). The library's own reconnects are tested in ``tests/client``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.live import ServerFailure, ServerProcess, free_port, metric_samples

MiB = 1024 * 1024


@dataclass(frozen=True)
class SoakConfig:
    sessions: int = 8
    blocks: int = 50  # refined blocks per session, after the sink
    block_size: int = 3
    sink_frames: int = 1
    height: int = 2
    width: int = 2
    prompt_tokens: int = 6
    max_chunk_frames: int = 6  # a client sends 1..this many frames per message
    seed: int = 0
    drops_after_unit: int = 2  # per session: aborts right after receiving a unit
    drops_after_send: int = 2  # per session: aborts right after sending a message (frames in flight)
    restart_at: float = 0.4  # share of all frames returned when the server gets SIGTERM
    send_pause_s: float = 0.02  # upper bound of a random pause between messages, so the run spans some time
    deadline_s: float = 240.0
    rss_margin_fraction: float = 0.10
    rss_margin_bytes: int = 32 * MiB

    @property
    def frames(self) -> int:
        return self.sink_frames + self.blocks * self.block_size


class SoakFailure(ServerFailure):
    pass


class RssSampler:
    """Samples the current server's VmRSS in a thread: (seconds since start, server generation, bytes)."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int]] = []
        self.server: ServerProcess | None = None
        self.generation = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._started = time.monotonic()

    def watch(self, server: ServerProcess) -> None:
        self.server = server
        self.generation += 1

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            server, generation = self.server, self.generation
            if server is None:
                continue
            rss = server.rss_bytes()
            if rss is not None:
                self.samples.append((time.monotonic() - self._started, generation, rss))


def refiner_config(config: dict):
    """The refiner's part of a session's config (the service adds its outputs fields beside it)."""
    from models import SessionConfig

    return SessionConfig.from_dict({k: v for k, v in config.items() if k in SessionConfig.__dataclass_fields__})


# --- one client ----------------------------------------------------------------------------------------------
@dataclass
class FaultPlan:
    """Where one session's client splits its clip and drops its connection, drawn up front from the seed, so
    the same seed injects the same faults at the same frames however the run's timing falls."""

    boundaries: list[int]  # the clip is sent as messages ending at these frames
    drop_after_unit_end: set[int]  # abort once the unit ending at this frame has arrived
    drop_after_send_end: set[int]  # abort once the message ending at this frame has been sent

    @classmethod
    def draw(cls, config: SoakConfig, index: int) -> FaultPlan:
        rng = random.Random(f"soak-{config.seed}-{index}")
        boundaries, cursor = [], 0
        while cursor < config.frames:
            cursor = min(cursor + rng.randint(1, config.max_chunk_frames), config.frames)
            boundaries.append(cursor)
        unit_ends = list(range(config.sink_frames, config.frames, config.block_size))  # every unit but the last
        after_unit = set(rng.sample(unit_ends, min(config.drops_after_unit, len(unit_ends))))
        after_send = set(rng.sample(boundaries[:-1], min(config.drops_after_send, len(boundaries) - 1)))
        return cls(boundaries, after_unit, after_send)

    def next_boundary(self, cursor: int) -> int:
        """The end of the next message from ``cursor`` (after a resume, ``cursor`` may fall inside one)."""
        return next(end for end in self.boundaries if end > cursor)


# --- one client --------------------------------------------------------------------------------------------
@dataclass
class ClientStats:
    units: int = 0
    frames: int = 0
    connections: int = 0
    drops: int = 0
    sent_high: int = 0  # frames sent so far over all connections (some may never have arrived)
    resent_frames: int = 0  # frames sent again because the session event showed they never arrived
    reconnect_refusals: int = 0  # connection attempts refused (down) or answered 503 (not ready) during the restart


@dataclass
class Shared:
    config: SoakConfig
    deadline: float
    frames_returned: int = 0
    restart_done: asyncio.Event = field(default_factory=asyncio.Event)
    restart_wanted: asyncio.Event = field(default_factory=asyncio.Event)
    server: ServerProcess | None = None

    def check_deadline(self, what: str) -> None:
        if time.monotonic() > self.deadline:
            raise SoakFailure(f"deadline passed while {what}")


async def stream_session(index: int, session_id: str, clip: torch.Tensor, prompt: torch.Tensor, shared: Shared,
                         stats: ClientStats) -> torch.Tensor:
    """Stream ``clip`` through session ``session_id`` until ``done``, surviving drops and a server restart."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

    from app.core.codec import decode_response

    config = shared.config
    plan = FaultPlan.draw(config, index)
    jitter = random.Random(f"jitter-{config.seed}-{index}")  # pauses only: timing, never what is checked
    total = clip.shape[2]
    units: list[torch.Tensor] = []
    frames_got = 0
    while True:
        shared.check_deadline(f"session {index} had {frames_got}/{total} frames")
        server = shared.server
        url = f"{server.ws_url}/v1/sessions/{session_id}/stream?resume_from={frames_got}"
        try:
            async with connect(url, max_size=None, open_timeout=10, close_timeout=2, ping_interval=None) as ws:
                stats.connections += 1
                event = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if event.get("type") != "session":
                    raise SoakFailure(f"session {index}: expected the session event, got {event}")
                if event["frames_returned"] < frames_got:
                    raise SoakFailure(f"session {index}: server returned {event['frames_returned']} < {frames_got}")
                sent_from = event["frames_received"]
                stats.resent_frames += max(0, stats.sent_high - sent_from)
                sender = asyncio.create_task(_send(ws, clip, prompt, sent_from, event["flushed"], plan, jitter, config, stats))
                try:
                    while True:
                        message = await asyncio.wait_for(ws.recv(), 60)
                        if isinstance(message, str):
                            event = json.loads(message)
                            if event.get("type") == "done":
                                if event["frames"] != total or frames_got != total:
                                    raise SoakFailure(f"session {index}: done with {event} after {frames_got}")
                                return torch.cat(units, dim=2)
                            if event.get("error", {}).get("code") == "draining":
                                # The server is stopping and did not take that message; it closes the stream
                                # next, and the session event after the reconnect says what to send again.
                                continue
                            raise SoakFailure(f"session {index}: unexpected event {event}")
                        tensors, metadata = decode_response(message)
                        start, end = int(metadata["frame_start"]), int(metadata["frame_end"])
                        if start != frames_got:
                            kind = "duplicated" if start < frames_got else "lost"
                            raise SoakFailure(f"session {index}: frames {kind}: unit [{start}, {end}) after {frames_got}")
                        units.append(tensors["latents"])
                        frames_got = end
                        stats.units += 1
                        stats.frames = frames_got
                        shared.frames_returned += end - start
                        if shared.frames_returned >= config.restart_at * config.sessions * total:
                            shared.restart_wanted.set()
                        if end in plan.drop_after_unit_end:
                            plan.drop_after_unit_end.discard(end)
                            stats.drops += 1
                            ws.transport.abort()  # abrupt: no close frame, as a lost network would
                            raise ConnectionResetError("injected drop")
                finally:
                    sender.cancel()
                    await asyncio.gather(sender, return_exceptions=True)
        except SoakFailure:
            raise
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status != 503:
                raise SoakFailure(f"session {index}: handshake refused with {status}: {exc.response.body!r}")
            stats.reconnect_refusals += 1
        except ConnectionRefusedError:
            stats.reconnect_refusals += 1  # the server is down (restarting)
        except (ConnectionClosed, InvalidHandshake, OSError, asyncio.TimeoutError):
            # Our own injected drop, or the server's 1012 on restart.
            pass
        await asyncio.sleep(jitter.uniform(0.01, 0.1))


async def _send(ws, clip, prompt, sent_from: int, flushed: bool, plan: FaultPlan, jitter: random.Random,
                config: SoakConfig, stats: ClientStats) -> None:
    """Send the frames from ``sent_from`` on in random splits (the first carrying the prompt), then the flush."""
    from safetensors.torch import save

    total = clip.shape[2]
    cursor = sent_from
    if not flushed:
        while cursor < total:
            end = plan.next_boundary(cursor)
            tensors = {"latents": clip[:, :, cursor:end].contiguous()}
            if cursor == 0:
                tensors["prompt_embeds"] = prompt
            await ws.send(save(tensors))
            cursor = end
            stats.sent_high = max(stats.sent_high, cursor)
            if end in plan.drop_after_send_end:
                plan.drop_after_send_end.discard(end)
                stats.drops += 1
                # The message may or may not have reached the server; the next session event says which.
                ws.transport.abort()
                return
            await asyncio.sleep(jitter.uniform(0, config.send_pause_s))
    await ws.send(json.dumps({"type": "flush"}))


# --- the run -----------------------------------------------------------------------------------------------
def make_clip(config: SoakConfig, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(config.seed * 1000 + index)
    latents = torch.randn(1, 128, config.frames, config.height, config.width, generator=generator)  # (B, C, T, H, W)
    prompt = torch.randn(1, config.prompt_tokens, 32, generator=generator)  # (B, L, D)
    return latents, prompt


def run_soak(config: SoakConfig = SoakConfig(), workdir: Path | None = None) -> dict[str, Any]:
    """Run the soak; the figures, or SoakFailure. ``workdir`` keeps the server log and snapshots (a temporary
    folder otherwise)."""
    torch.set_num_threads(1)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="wm-soak-") as folder:
            return asyncio.run(_soak(config, Path(folder)))
    workdir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_soak(config, workdir))


async def _soak(config: SoakConfig, workdir: Path) -> dict[str, Any]:
    from models import load_refiner, refine_clip

    started = time.monotonic()
    shared = Shared(config, deadline=started + config.deadline_s)
    port = free_port()
    cache_dir, snapshot_dir = workdir / "cache", workdir / "snapshots"
    # The last server's drain leaves the run's sessions here; a reused workdir must not restore them.
    if snapshot_dir.is_dir():
        shutil.rmtree(snapshot_dir)
    server_settings = dict(
        log_level="warning",
        max_sessions=max(16, config.sessions),
        # Long enough that a session never expires between its client's reconnects, restart included.
        ws_reattach_grace_s=config.deadline_s,
        default_block_size=config.block_size,
        default_sink_frames=config.sink_frames,
        warmup_height=config.height,
        warmup_width=config.width,
    )

    def new_server() -> ServerProcess:
        return ServerProcess(port, cache_dir, snapshot_dir, workdir / "server.log", **server_settings)

    figures: dict[str, Any] = {}
    servers: list[ServerProcess] = []
    with RssSampler() as sampler:
        try:
            servers.append(await asyncio.to_thread(new_server().start))
            shared.server = servers[-1]
            sampler.watch(shared.server)
            async with httpx.AsyncClient(base_url=shared.server.base_url, timeout=30) as http:
                sessions = []
                for index in range(config.sessions):
                    created = await http.post("/v1/sessions", json={"seed": 1000 + index})
                    created.raise_for_status()
                    sessions.append(created.json())
            # The expected outputs: the same checkpoint (the one the server built), in this process.
            refiner = load_refiner(cache_dir / "tiny", device="cpu", dtype="float32")
            clips = [make_clip(config, index) for index in range(config.sessions)]
            expected = [
                refine_clip(refiner, latents, prompt, None, refiner_config(created["config"]))
                for (latents, prompt), created in zip(clips, sessions)
            ]
            stats = [ClientStats() for _ in sessions]
            stream_started = time.monotonic()
            restarter = asyncio.create_task(_restart_once(shared, servers, sampler, snapshot_dir, new_server, figures))
            clients = [
                asyncio.create_task(stream_session(i, created["session_id"], *clips[i], shared, stats[i]))
                for i, created in enumerate(sessions)
            ]
            try:
                remaining = shared.deadline - time.monotonic()
                done, pending = await asyncio.wait(clients, timeout=remaining, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    task.result()  # the first failure, as it was raised
                if pending:
                    raise SoakFailure(f"{len(pending)} session(s) unfinished at the deadline")
            finally:
                for task in (*clients, restarter):
                    task.cancel()
                await asyncio.gather(*clients, restarter, return_exceptions=True)
            stream_seconds = time.monotonic() - stream_started
            if not figures.get("restarts"):
                raise SoakFailure("the server restart never happened (restart_at too high?)")
            frames_checked = 0
            for index, (task, want) in enumerate(zip(clients, expected)):
                got = task.result()
                if got.shape != want.shape or not torch.equal(got, want):
                    raise SoakFailure(f"session {index}: output differs from its uninterrupted run")
                frames_checked += got.shape[2]
            async with httpx.AsyncClient(base_url=shared.server.base_url, timeout=30) as http:
                for created in sessions:
                    state = (await http.get(f"/v1/sessions/{created['session_id']}")).json()
                    if state["frames_returned"] != config.frames or not state["flushed"]:
                        raise SoakFailure(f"server state after the run: {state}")
            figures["snapshots_left_at_end"] = len(list(snapshot_dir.glob("*.session.safetensors")))
            await batching_figures(shared.server, figures.setdefault("batching", {}))
            exit_code = await asyncio.to_thread(shared.server.terminate)
        finally:
            for server in servers:
                server.kill()
    memory = memory_figures(sampler.samples, config)
    batching = figures.pop("batching")
    figures.update(
        model_calls=int(batching["model_calls"]),
        model_calls_with_several_sessions=int(batching["batched_calls"]),
        mean_rows_per_model_call=round(batching["rows"] / max(batching["model_calls"], 1), 2),
        sessions=config.sessions,
        blocks_per_session=config.blocks,
        frames_per_session=config.frames,
        latent_hw=f"{config.height}x{config.width}",
        frames_checked=frames_checked,
        units_received=sum(s.units for s in stats),
        disconnects_injected=sum(s.drops for s in stats),
        reconnects=sum(s.connections for s in stats) - config.sessions,
        reconnect_attempts_refused=sum(s.reconnect_refusals for s in stats),
        frames_resent_by_clients=sum(s.resent_frames for s in stats),
        last_exit_code=exit_code,
        stream_seconds=round(stream_seconds, 1),
        duration_s=round(time.monotonic() - started, 1),
        seed=config.seed,
        **memory,
    )
    if not memory["rss_flat"]:
        raise SoakFailure(f"server memory grew: {memory}")
    return figures


async def batching_figures(server: ServerProcess, into: dict[str, float]) -> None:
    """Add the server's model calls and the rows they carried (its ``refiner_batch_rows`` histogram) to ``into``."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        text = (await http.get("/metrics")).text
    samples = metric_samples(text, "refiner_batch_rows")
    calls = samples.get("refiner_batch_rows_count", 0.0)
    single = samples.get('refiner_batch_rows_bucket{le="1.0"}', 0.0)
    into["model_calls"] = into.get("model_calls", 0) + calls
    into["rows"] = into.get("rows", 0) + samples.get("refiner_batch_rows_sum", 0.0)
    into["batched_calls"] = into.get("batched_calls", 0) + calls - single


async def _restart_once(shared: Shared, servers, sampler: RssSampler, snapshot_dir: Path, new_server, figures):
    """SIGTERM the server once the set share of frames is back, then start a new one on the same folder."""
    await shared.restart_wanted.wait()
    old = shared.server
    await batching_figures(old, figures.setdefault("batching", {}))
    began = time.monotonic()
    code = await asyncio.to_thread(old.terminate)
    if code not in (0, -signal.SIGTERM):
        raise SoakFailure(f"the server exited with {code} on SIGTERM:\n{old.log()}")
    saved = sorted(p.name for p in snapshot_dir.glob("*.session.safetensors"))
    servers.append(await asyncio.to_thread(new_server().start))
    shared.server = servers[-1]
    sampler.watch(shared.server)
    left = sorted(p.name for p in snapshot_dir.glob("*.session.safetensors"))
    figures.update(
        restarts=1,
        restart_at_frames=shared.frames_returned,
        snapshots_written=len(saved),
        # Nothing is claimed at start-up: each session is adopted (and its file removed) on its first request.
        snapshots_waiting_after_restart=len(left),
        restart_downtime_s=round(time.monotonic() - began, 1),
    )
    shared.restart_done.set()


def memory_figures(samples: list[tuple[float, int, int]], config: SoakConfig) -> dict[str, Any]:
    """Peak RSS of the first and the second half of the run (by time, over both server processes), per server,
    and whether the second half stayed within the margin of the first."""
    if len(samples) < 4:
        return {"rss_samples": len(samples), "rss_flat": False}
    begin, end = samples[0][0], samples[-1][0]
    middle = (begin + end) / 2
    first = max(rss for t, _, rss in samples if t < middle)
    second = max(rss for t, _, rss in samples if t >= middle)
    allowed = first + max(first * config.rss_margin_fraction, config.rss_margin_bytes)
    per_server: dict[int, int] = {}
    for _, generation, rss in samples:
        per_server[generation] = max(per_server.get(generation, 0), rss)
    return {
        "rss_samples": len(samples),
        "rss_peak_first_half_mib": round(first / MiB, 1),
        "rss_peak_second_half_mib": round(second / MiB, 1),
        "rss_allowed_mib": round(allowed / MiB, 1),
        "rss_peak_per_server_mib": [round(per_server[g] / MiB, 1) for g in sorted(per_server)],
        "rss_flat": second <= allowed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    defaults = SoakConfig()
    parser.add_argument("--sessions", type=int, default=defaults.sessions)
    parser.add_argument("--blocks", type=int, default=defaults.blocks)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--height", type=int, default=defaults.height)
    parser.add_argument("--width", type=int, default=defaults.width)
    parser.add_argument("--deadline-s", type=float, default=defaults.deadline_s)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the server log and snapshots here")
    args = parser.parse_args(argv)
    config = SoakConfig(
        sessions=args.sessions,
        blocks=args.blocks,
        seed=args.seed,
        height=args.height,
        width=args.width,
        deadline_s=args.deadline_s,
    )
    try:
        figures = run_soak(config, args.workdir)
    except SoakFailure as exc:
        print(f"soak FAILED: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
