"""``python -m bench realtime``: how many real-time sessions a server keeps on time, batching on and off.

A server per mode (``python -m app serve``, real processes, side by side; phases interleaved) serves random
``medium`` refiner sessions created with ``realtime: true`` at the stream's ``fps``. Each client is a
``wm_refiner_client.AsyncClient`` stream paced like a live generator: it sends one block (``block_size`` latent
frames) every block playback time (``block_size x 8 / fps`` seconds: 1.5 s at 16 fps), open loop, whatever the
server does; the k clients of a phase start spread evenly over one block period. Before a phase every session filled
its window (untimed, its late blocks not counted); the phase's late blocks are the change of each session's
``late_blocks`` (the server's own count: a block committed after its last frame's arrival + its playback time).
Each client also times its blocks: a unit received later than its frames' send + the playback time is late at the
client (that adds the response's encoding and the socket to the server's figure).

A phase with k sessions holds when none of its blocks was late. Phases run k = 1, 2, ..., each k on one server
then the other (the order alternating), so a busy spell of a shared machine falls on both modes; a mode stops after
two failed phases in a row (or at ``--max-sessions``). Each phase records the machine's load average. The server's measured cost per row (``/v1/info`` -> ``engine.realtime``) is reported too,
with what ``admission: realtime`` would admit by it at ``admission_max_load`` 0.9. The benchmark reports; it never
asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.closed_loop import AsyncClosedLoop
from bench.live import ServerProcess, free_port
from models import SessionConfig
from models.checkpoints import PRESETS, write_checkpoint

PROMPT_TOKENS = 16
TEMPORAL = 8  # pixel frames per latent frame (LTX-2's VAE)


class Paced:
    """One realtime session, fed one block per playback period."""

    def __init__(self, base_url: str, index: int, height: int, width: int, caption_channels: int, fps: float):
        self.config = SessionConfig(fps=fps)
        self.generator = torch.Generator().manual_seed(2000 + index)
        self.embeds = torch.randn(1, PROMPT_TOKENS, caption_channels, generator=self.generator)
        self.height, self.width = height, width
        self.stream = AsyncClosedLoop(base_url, {"seed": index, "fps": fps, "realtime": True})
        self.sent = 0

    def send(self, frames: int) -> int:
        latents = torch.randn(1, 128, frames, self.height, self.width, generator=self.generator)
        self.stream.send({"latents": latents, "prompt": self.embeds if self.sent == 0 else None})
        self.sent += frames
        return self.sent

    async def fill(self) -> None:
        config = self.config
        blocks = -(-config.max_history_frames // config.block_size)
        await self.stream.until(self.send(config.sink_frames + blocks * config.block_size))

    async def paced(self, blocks: int, period: float, offset: float) -> list[float]:
        """Send ``blocks`` blocks one ``period`` apart; each block's lateness as this client sees it: its unit's
        arrival minus (the send of its frames + its playback time)."""
        await asyncio.sleep(offset)
        began = time.perf_counter()
        sent: asyncio.Queue = asyncio.Queue()

        async def collect() -> list[float]:
            lateness = []
            for _ in range(blocks):
                frame_end, at = await sent.get()
                await self.stream.until(frame_end)
                lateness.append(time.perf_counter() - (at + period))
            return lateness

        collector = asyncio.create_task(collect())
        for i in range(blocks):
            await asyncio.sleep(max(0.0, began + i * period - time.perf_counter()))
            sent.put_nowait((self.send(self.config.block_size), time.perf_counter()))
        return await collector


async def _state(http: httpx.AsyncClient, session_id: str) -> dict[str, Any]:
    return (await http.get(f"/v1/sessions/{session_id}")).json()


async def _phase(base_url: str, count: int, blocks: int, height: int, width: int, caption_channels: int,
                 fps: float) -> dict[str, Any]:
    """``count`` fresh realtime sessions: fill their windows, then ``blocks`` paced blocks each; deleted after."""
    period = SessionConfig().block_size * TEMPORAL / fps
    clients = [Paced(base_url, i, height, width, caption_channels, fps) for i in range(count)]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        try:
            for client in clients:
                await client.stream.open()
            await asyncio.gather(*(client.fill() for client in clients))
            before = {c.stream.session_id: (await _state(http, c.stream.session_id))["late_blocks"] for c in clients}
            began = time.perf_counter()
            seen = await asyncio.gather(*(c.paced(blocks, period, i * period / count) for i, c in enumerate(clients)))
            seconds = time.perf_counter() - began
            after = [await _state(http, c.stream.session_id) for c in clients]
        finally:
            await asyncio.gather(*(c.stream.close() for c in clients), return_exceptions=True)
            for client in clients:
                if client.stream.session_id:
                    await http.delete(f"/v1/sessions/{client.stream.session_id}")
    late = sum(s["late_blocks"] - before[s["session_id"]] for s in after)
    client_side = [x for per_client in seen for x in per_client]
    return {"sessions": count, "blocks": count * blocks, "late_blocks": late,
            "client_late_blocks": sum(x > 0 for x in client_side), "client_worst_lateness_s": max(client_side),
            "seconds": seconds, "load_average": _load_average()}


async def _summary(base_url: str, phases: list[dict[str, Any]], height: int, width: int, fps: float) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        info = (await http.get("/v1/info")).json()["engine"]
    period = SessionConfig().block_size * TEMPORAL / fps
    held = [p["sessions"] for p in phases if p["late_blocks"] == 0]
    tokens = SessionConfig().block_size * height * width
    per_row = info["realtime"]["seconds_per_row_by_tokens"].get(str(tokens))
    load = None if per_row is None else (SessionConfig().steps + 1) * per_row / period
    return {
        "phases": phases,
        "holds": max(held) if held else 0,
        "seconds_per_row": per_row,
        "load_per_session": load,
        "admission_would_admit": None if load is None else int(0.9 // load),
        "batched": info["batched"],
    }


def _load_average() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def run_realtime(preset: str, height: int, width: int, fps: float, blocks: int, max_sessions: int,
                 modes: list[str], threads: int | None) -> dict[str, Any]:
    """Both servers run side by side; for k = 1, 2, ... each mode's phase of k sessions runs in turn (the order
    alternating with k), so a busy spell of a shared machine falls on both. A mode stops after two failed phases in
    a row."""
    started = time.perf_counter()
    caption_channels = PRESETS[preset]["caption_channels"]
    phases: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="wm-realtime-") as tmp:
        folder = write_checkpoint(Path(tmp) / preset, preset=preset)
        servers: dict[str, ServerProcess] = {}
        try:
            for mode in modes:
                servers[mode] = ServerProcess(
                    free_port(), Path(tmp) / "cache", None, Path(tmp) / f"{mode}.log", threads=threads,
                    model=str(folder), log_level="warning", max_sessions=max(16, max_sessions),
                    warmup_height=height, warmup_width=width, warmup_prompt_tokens=PROMPT_TOKENS,
                    batching=mode == "batching", max_batch_rows=max(8, max_sessions),
                    engine_queue_depth=max(64, 8 * max_sessions),
                ).start(ready_timeout=1200)
            failures = {mode: 0 for mode in modes}
            for count in range(1, max_sessions + 1):
                order = modes if count % 2 else modes[::-1]
                for mode in order:
                    if failures[mode] >= 2:
                        continue
                    phase = asyncio.run(_phase(servers[mode].base_url, count, blocks, height, width,
                                               caption_channels, fps))
                    phases[mode].append(phase)
                    failures[mode] = failures[mode] + 1 if phase["late_blocks"] else 0
                    print(f"  {mode}, {count} session(s): {phase['late_blocks']} of {phase['blocks']} blocks late "
                          f"(server), worst lateness at the client {phase['client_worst_lateness_s']:+.3f} s, load "
                          f"average {phase['load_average']}", file=sys.stderr)
                if all(failures[mode] >= 2 for mode in modes):
                    break
            for mode in modes:
                results[mode] = asyncio.run(_summary(servers[mode].base_url, phases[mode], height, width, fps))
        finally:
            for server in servers.values():
                server.kill()
    return {
        "command": (f"python -m bench realtime --preset {preset} --height {height} --width {width} --fps {fps:g} "
                    f"--blocks {blocks} --max-sessions {max_sessions}" + (f" --threads {threads}" if threads else "")),
        "block_seconds": SessionConfig().block_size * TEMPORAL / fps,
        "modes": results,
        "elapsed_s": time.perf_counter() - started,
        "cpu": _lscpu(),
    }


def _lscpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "lscpu unavailable"
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Flags")
    lines = [line for line in out.splitlines() if line.split(":")[0].strip() in keep]
    return "\n".join(line if not line.startswith("Flags") else _flags(line) for line in lines)


def _flags(line: str) -> str:
    flags = line.split(":", 1)[1].split()
    wanted = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    return "Flags (vector): " + " ".join(wanted)


def format_realtime(report: dict[str, Any]) -> str:
    lines = [
        "## Real-time sessions on this CPU (paced clients, `realtime: true`)",
        "",
        f"`{report['command']}` ({report['elapsed_s']:.0f} s; a block plays {report['block_seconds']:g} s)",
        "",
        "| server | sessions | blocks | late (server's count) | late at the client | worst lateness at the client "
        "| load average | holds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, result in report["modes"].items():
        for phase in result["phases"]:
            lines.append(f"| {mode} | {phase['sessions']} | {phase['blocks']} | {phase['late_blocks']} | "
                         f"{phase['client_late_blocks']} | {phase['client_worst_lateness_s']:+.3f} s | "
                         f"{phase['load_average']} | {'yes' if phase['late_blocks'] == 0 else 'no'} |")
    lines.append("")
    for mode, result in report["modes"].items():
        admit = result["admission_would_admit"]
        cost = ("" if result["seconds_per_row"] is None else
                f"; measured {result['seconds_per_row'] * 1000:.1f} ms per row per forward, a session's load "
                f"{result['load_per_session']:.2f}, so `admission: realtime` (0.9) would admit {admit}")
        lines.append(f"- {mode}: holds **{result['holds']}** session(s) with no late block{cost}")
    lines += ["", "```text", report["cpu"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench realtime", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    parser.add_argument("--height", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--fps", type=float, default=16.0)
    parser.add_argument("--blocks", type=int, default=6, help="paced blocks per session per phase")
    parser.add_argument("--max-sessions", type=int, default=8)
    parser.add_argument("--modes", default="batching,no batching")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads (default: all cores)")
    parser.add_argument("--json", help="also write the report as JSON here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ("batching", "no batching")]
    if unknown:
        parser.error(f"--modes: {unknown} unknown; use 'batching', 'no batching' or both")
    report = run_realtime(args.preset, args.height, args.width, args.fps, args.blocks, args.max_sessions, modes,
                          args.threads)
    print(format_realtime(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
