"""``python -m bench checkpoint``: what crash checkpoints cost, over real WebSockets.

Two servers (``python -m app serve``, the medium refiner by default) run side by side on the same checkpoint, one
with ``checkpoint_every_blocks`` = N (a snapshot folder on this machine's disk) and one without. The same
closed-loop clients as ``bench load`` stream blocks in rounds that alternate between the servers; the figures are
the block latency (p50/p99) with and without checkpoints, and what the server wrote: bytes and seconds per
checkpoint (its Prometheus metrics). It reports; it never asserts.
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

from bench.live import ServerProcess, free_port, metric_samples
from bench.load import PROMPT_TOKENS, Client, _percentile, phase
from models.checkpoints import PRESETS, write_checkpoint


async def _measure(servers: dict[str, ServerProcess], sessions: int, rounds: int, blocks: int, height: int,
                   width: int, caption_channels: int) -> dict[str, list[float]]:
    pools = {name: [Client(server, i, height, width, caption_channels) for i in range(sessions)]
             for name, server in servers.items()}
    latencies: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for clients in pools.values():
            for client in clients:
                await client.open()
            await asyncio.gather(*(client.fill() for client in clients))
        names = list(servers)
        for round_index in range(rounds):
            for name in names[round_index % 2:] + names[: round_index % 2]:
                latencies[name] += (await phase(pools[name], blocks))["latencies"]
    finally:
        for clients in pools.values():
            await asyncio.gather(*(client.close() for client in clients), return_exceptions=True)
    return latencies


def _written(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    seconds = metric_samples(text, "refiner_checkpoint_write_seconds")
    count = seconds.get("refiner_checkpoint_write_seconds_count", 0.0)
    written = metric_samples(text, "refiner_checkpoint_bytes_total").get("refiner_checkpoint_bytes_total", 0.0)
    return {"checkpoints": count, "bytes_per_checkpoint": written / max(count, 1.0),
            "write_s_per_checkpoint": seconds.get("refiner_checkpoint_write_seconds_sum", 0.0) / max(count, 1.0)}


def run_checkpoint(preset: str = "medium", every: int = 1, height: int = 8, width: int = 8, sessions: int = 1,
                   rounds: int = 6, blocks: int = 4, threads: int | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wm-checkpoint-") as tmp:
        folder = write_checkpoint(Path(tmp) / preset, preset=preset)
        common = dict(model=str(folder), log_level="warning", warmup_height=height, warmup_width=width,
                      warmup_prompt_tokens=PROMPT_TOKENS)
        servers: dict[str, ServerProcess] = {}
        try:
            servers["no checkpoints"] = ServerProcess(free_port(), Path(tmp) / "cache", None, Path(tmp) / "a.log",
                                                      threads=threads, **common).start(ready_timeout=600)
            servers[f"checkpoint every {every} block(s)"] = ServerProcess(
                free_port(), Path(tmp) / "cache", Path(tmp) / "snapshots", Path(tmp) / "b.log", threads=threads,
                checkpoint_every_blocks=every, **common).start(ready_timeout=600)
            latencies = asyncio.run(_measure(servers, sessions, rounds, blocks, height, width,
                                             PRESETS[preset]["caption_channels"]))
            written = _written(servers[f"checkpoint every {every} block(s)"])
        finally:
            for server in servers.values():
                server.kill()
    figures = {name: {"blocks": len(values), "latency_p50_s": statistics.median(values),
                      "latency_p99_s": _percentile(values, 0.99)} for name, values in latencies.items()}
    names = list(figures)
    return {
        "command": (f"python -m bench checkpoint --preset {preset} --every {every} --height {height} --width {width} "
                    f"--sessions {sessions} --rounds {rounds} --blocks {blocks}" + (f" --threads {threads}" if threads else "")),
        "figures": figures,
        "written": written,
        "latency_ratio": figures[names[1]]["latency_p50_s"] / figures[names[0]]["latency_p50_s"],
        "elapsed_s": time.perf_counter() - started,
    }


def format_checkpoint(report: dict[str, Any]) -> str:
    written = report["written"]
    lines = [
        "## Crash checkpoints: block latency with and without (WebSockets, closed-loop clients)",
        "",
        f"`{report['command']}` ({report['elapsed_s']:.0f} s)",
        "",
        "| server | blocks | latency p50 | p99 |",
        "|---|---|---|---|",
    ]
    for name, run in report["figures"].items():
        lines.append(f"| {name} | {run['blocks']} | {run['latency_p50_s'] * 1000:.0f} ms | "
                     f"{run['latency_p99_s'] * 1000:.0f} ms |")
    lines += [
        "",
        f"- with / without checkpoints: **{report['latency_ratio']:.2f}x** block latency (p50)",
        f"- {written['checkpoints']:.0f} checkpoints, {written['bytes_per_checkpoint'] / 1e6:.2f} MB and "
        f"{written['write_s_per_checkpoint'] * 1000:.1f} ms (on a worker thread) each",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    parser.add_argument("--every", type=int, default=1, help="checkpoint_every_blocks of the second server")
    parser.add_argument("--height", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", help="also write the report (markdown) to this file")
    args = parser.parse_args(argv)
    report = run_checkpoint(args.preset, args.every, args.height, args.width, args.sessions, args.rounds, args.blocks,
                            args.threads)
    text = format_checkpoint(report)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
