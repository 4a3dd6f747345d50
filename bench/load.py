"""``python -m bench load``: what batching buys when many sessions stream at once, over real WebSockets.

Two servers run side by side as real processes (``python -m app serve``), one with batching on and one with it
off, on the same random checkpoint (medium by default), both warmed up at the benchmark's latent size. The
clients are ``wm_refiner_client.AsyncClient`` streams in this process, one connection per session, driven
closed-loop (``bench.closed_loop``).

Every session first fills its window (sink + enough blocks that the history is full; untimed), so every timed
block attends to the full steady-state window. A *phase* then lets the first k sessions stream closed-loop, as a
live generator would: each sends one block, waits for its refined unit, sends the next, for ``blocks`` blocks.
A phase's figures: aggregate blocks/s (blocks delivered / wall time of the phase) and each block's latency
(send -> unit received, at the client). Rounds run every (server, k) phase in an order that rotates, so a slow
spell of a shared machine hits all of them; the figures pool the rounds.

Headline: aggregate blocks/s of the largest k divided by that of one session alone, on the batching server, next
to the same ratio without batching, all measured interleaved in one run. The benchmark reports; it never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.closed_loop import AsyncClosedLoop
from bench.live import ServerProcess, free_port, metric_samples
from models import SessionConfig
from models.checkpoints import PRESETS, write_checkpoint

TARGET_RATIO = 1.25
PROMPT_TOKENS = 16


class Client:
    """One session streaming blocks over one WebSocket, closed-loop. ``config``: the session's fields (its seed is
    the client's index unless given)."""

    def __init__(self, server: ServerProcess, index: int, height: int, width: int, caption_channels: int,
                 config: dict[str, Any] | None = None):
        self.server = server
        self.index = index
        self.height, self.width = height, width
        self.generator = torch.Generator().manual_seed(1000 + index)
        self.embeds = torch.randn(1, PROMPT_TOKENS, caption_channels, generator=self.generator)
        self.config = SessionConfig()
        self.stream = AsyncClosedLoop(server.base_url, {"seed": index, **(config or {})})
        self.sent = 0

    @property
    def session_id(self) -> str | None:
        return self.stream.session_id

    async def open(self) -> None:
        await self.stream.open()

    def _frames(self, count: int) -> torch.Tensor:
        return torch.randn(1, 128, count, self.height, self.width, generator=self.generator)  # (B, C, t, H, W)

    async def send(self, frames: int) -> int:
        """Send ``frames`` new frames (the first message carries the prompt); the frame the unit will end at."""
        self.stream.send({"latents": self._frames(frames), "prompt": self.embeds if self.sent == 0 else None})
        self.sent += frames
        return self.sent

    async def until(self, frame_end: int):
        return await self.stream.until(frame_end)

    async def fill(self) -> None:
        """The sink and blocks until the history is full: the window every timed block sees."""
        config = self.config
        blocks = -(-config.max_history_frames // config.block_size)
        await self.until(await self.send(config.sink_frames + blocks * config.block_size))

    async def block(self) -> float:
        began = time.perf_counter()
        await self.until(await self.send(self.config.block_size))
        return time.perf_counter() - began

    async def close(self) -> None:
        await self.stream.close()


async def phase(clients: list[Client], blocks: int) -> dict[str, Any]:
    latencies: list[float] = []

    async def run(client: Client) -> None:
        for _ in range(blocks):
            latencies.append(await client.block())

    began = time.perf_counter()
    await asyncio.gather(*(run(client) for client in clients))
    seconds = time.perf_counter() - began
    return {"blocks": len(latencies), "seconds": seconds, "latencies": latencies}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def _measure(servers: dict[str, ServerProcess], counts: list[int], rounds: int, blocks: int, height: int,
                   width: int, caption_channels: int) -> dict[str, Any]:
    pools = {name: [Client(server, i, height, width, caption_channels) for i in range(max(counts))]
             for name, server in servers.items()}
    try:
        for clients in pools.values():
            for client in clients:
                await client.open()
            await asyncio.gather(*(client.fill() for client in clients))
        plan = [(name, count) for name in servers for count in counts]
        results: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in plan}
        for round_index in range(rounds):
            shift = round_index % len(plan)
            for name, count in plan[shift:] + plan[:shift]:
                results[(name, count)].append(await phase(pools[name][:count], blocks))
    finally:
        for clients in pools.values():
            await asyncio.gather(*(client.close() for client in clients), return_exceptions=True)
    figures: dict[str, Any] = {}
    for (name, count), runs in results.items():
        latencies = [lat for run in runs for lat in run["latencies"]]
        blocks_done = sum(run["blocks"] for run in runs)
        seconds = sum(run["seconds"] for run in runs)
        figures.setdefault(name, {})[count] = {
            "sessions": count,
            "blocks": blocks_done,
            "seconds": seconds,
            "blocks_per_s": blocks_done / seconds,
            "per_round_blocks_per_s": [run["blocks"] / run["seconds"] for run in runs],
            "latency_p50_s": statistics.median(latencies),
            "latency_p99_s": _percentile(latencies, 0.99),
            "latency_max_s": max(latencies),
        }
    return figures


async def _batching_stats(server: ServerProcess) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        samples = metric_samples((await http.get("/metrics")).text, "refiner_batch_rows")
    calls = samples.get("refiner_batch_rows_count", 0.0)
    return {"model_calls": calls, "mean_rows": samples.get("refiner_batch_rows_sum", 0.0) / max(calls, 1.0)}


def run_load(preset: str = "medium", height: int = 8, width: int = 8, counts=(1, 4, 8), rounds: int = 3,
             blocks: int = 3, threads: int | None = None, compare: bool = True, device: str = "auto",
             dtype: str = "auto", compile_step: bool = False) -> dict[str, Any]:
    counts = sorted(set(counts))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wm-load-") as tmp:
        folder = write_checkpoint(Path(tmp) / preset, preset=preset)
        common = dict(
            model=str(folder), log_level="warning", max_sessions=max(16, max(counts)),
            warmup_height=height, warmup_width=width, warmup_prompt_tokens=PROMPT_TOKENS,
            engine_queue_depth=max(64, 4 * max(counts)), device=device, dtype=dtype, compile_step=compile_step,
        )
        modes = {"batching": True, **({"no batching": False} if compare else {})}
        servers: dict[str, ServerProcess] = {}
        try:
            for name, batching in modes.items():
                server = ServerProcess(free_port(), Path(tmp) / "cache", None, Path(tmp) / f"{name}.log",
                                       threads=threads, batching=batching, max_batch_rows=max(8, max(counts)), **common)
                servers[name] = server.start(ready_timeout=600)
            caption_channels = PRESETS[preset]["caption_channels"]
            figures = asyncio.run(_measure(servers, counts, rounds, blocks, height, width, caption_channels))
            engine = {name: asyncio.run(_batching_stats(server)) for name, server in servers.items()}
        finally:
            for server in servers.values():
                server.kill()
    largest = counts[-1]
    ratios = {name: runs[largest]["blocks_per_s"] / runs[counts[0]]["blocks_per_s"] for name, runs in figures.items()}
    return {
        "command": (f"python -m bench load --preset {preset} --height {height} --width {width} --sessions "
                    f"{','.join(map(str, counts))} --rounds {rounds} --blocks {blocks}"
                    + (f" --threads {threads}" if threads else "") + ("" if compare else " --no-compare")
                    + (f" --device {device}" if device != "auto" else "") + (f" --dtype {dtype}" if dtype != "auto" else "")
                    + (" --compile" if compile_step else "")),
        "torch_threads": threads or "server default (all cores)",
        "sessions": counts,
        "rounds": rounds,
        "blocks_per_phase_per_session": blocks,
        "figures": figures,
        "engine": engine,
        "ratio_largest_to_one": ratios,
        "target": TARGET_RATIO,
        "met": ratios["batching"] >= TARGET_RATIO,
        "elapsed_s": time.perf_counter() - started,
    }


def format_load(report: dict[str, Any]) -> str:
    counts = report["sessions"]
    lines = [
        "## Many sessions at once (WebSockets, one server per mode, closed-loop clients)",
        "",
        f"`{report['command']}` ({report['elapsed_s']:.0f} s; server torch threads: {report['torch_threads']})",
        "",
        "| server | sessions | blocks | aggregate blocks/s | per-round blocks/s | latency p50 | p99 | max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in report["figures"].items():
        for count in counts:
            run = runs[count]
            rounds = ", ".join(f"{v:.2f}" for v in run["per_round_blocks_per_s"])
            lines.append(
                f"| {name} | {count} | {run['blocks']} | {run['blocks_per_s']:.2f} | {rounds} | "
                f"{run['latency_p50_s'] * 1000:.0f} ms | {run['latency_p99_s'] * 1000:.0f} ms | "
                f"{run['latency_max_s'] * 1000:.0f} ms |"
            )
    lines.append("")
    for name, ratio in report["ratio_largest_to_one"].items():
        engine = report["engine"][name]
        lines.append(
            f"- {name}: {counts[-1]} sessions / 1 session = **{ratio:.2f}x** aggregate blocks/s "
            f"({engine['model_calls']:.0f} model calls, {engine['mean_rows']:.2f} rows per call on average)"
        )
    lines.append(f"- target (batching) >= {report['target']:.2f}x: **{'met' if report['met'] else 'NOT met'}**")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    parser.add_argument("--height", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--sessions", default="1,4,8", help="comma-separated session counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=3, help="blocks per session per phase")
    parser.add_argument("--threads", type=int, default=None, help="the servers' torch threads (default: all cores)")
    parser.add_argument("--no-compare", action="store_true", help="skip the server without batching")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compile", action="store_true", help="serve with compile_step on")
    parser.add_argument("--output", help="also write the report (markdown) to this file")
    args = parser.parse_args(argv)
    counts = [int(part) for part in args.sessions.split(",") if part.strip()]
    report = run_load(args.preset, args.height, args.width, counts, args.rounds, args.blocks, args.threads,
                      compare=not args.no_compare, device=args.device, dtype=args.dtype, compile_step=args.compile)
    text = format_load(report)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
