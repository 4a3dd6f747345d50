"""``python -m bench decode``: what video output costs a stream, over real WebSockets.

One server (``python -m app serve``, the medium refiner and the tiny VAE by default) holds two pools of sessions
on the same checkpoint: *latents* sessions (``outputs: ["latents"]``) and *video* sessions (``outputs: ["latents",
"video"]``, exact look-ahead, uint8). After every session filled its window (untimed), phases stream closed-loop
(send a block, wait for its unit) in a rotating order, as ``bench load`` does:

- ``latents x1`` / ``video x1``: one session alone: the per-block cost of refine alone vs refine + decode;
- ``latents xK`` / ``video xK``: K sessions at once: the decode steps run between the batched model calls, so
  what video costs the aggregate throughput once other sessions' forwards share the engine;
- ``video x1 + stalled watcher``: the same single video session while a watcher that never reads is attached
  (api.md: a slow watcher never slows the producer).

It also reads the server's own figures: engine seconds per decode step and per model call (Prometheus). It reports;
it never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.live import ServerProcess, free_port, metric_samples
from bench.load import PROMPT_TOKENS, Client, _percentile, phase
from models.checkpoints import PRESETS, write_checkpoint, write_vae_checkpoint


class OutputClient(Client):
    """A ``bench load`` client whose session asks for ``outputs``."""

    def __init__(self, *args, outputs: list[str], **kwargs):
        super().__init__(*args, config={"outputs": outputs}, **kwargs)
        self.outputs = outputs


def stalled_watcher(server: ServerProcess, session_id: str) -> socket.socket:
    """A WebSocket watcher that completes the handshake and never reads again (a small receive window). Raw on
    purpose: what is measured is a peer that stops reading at the TCP level, which no client library lets one be."""
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    raw.sendall(
        (f"GET /v1/sessions/{session_id}/watch HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
         "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        .encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += raw.recv(1)  # the handshake answer only, byte by byte: nothing of the stream is read
    if b" 101 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"the watch was refused: {head!r}")
    return raw


def _stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = [lat for run in runs for lat in run["latencies"]]
    blocks = sum(run["blocks"] for run in runs)
    seconds = sum(run["seconds"] for run in runs)
    return {"blocks": blocks, "blocks_per_s": blocks / seconds, "latency_p50_s": statistics.median(latencies),
            "latency_p99_s": _percentile(latencies, 0.99)}


async def _measure(server: ServerProcess, sessions: int, rounds: int, blocks: int, height: int, width: int,
                   caption_channels: int) -> dict[str, Any]:
    pools = {
        kind: [OutputClient(server, i + 100 * index, height, width, caption_channels,
                            outputs=["latents", "video"] if kind != "latents" else ["latents"])
               for i in range(sessions if kind != "watched" else 1)]
        for index, kind in enumerate(("latents", "video", "watched"))
    }
    watcher = None
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for clients in pools.values():
            for client in clients:
                await client.open()
            await asyncio.gather(*(client.fill() for client in clients))
        # A session of its own has a watcher that never reads, attached for the whole run.
        watcher = stalled_watcher(server, pools["watched"][0].session_id)
        plan = [("latents", 1), ("video", 1), ("latents", sessions), ("video", sessions), ("watched", 1)]
        names = {("watched", 1): "video x1 + stalled watcher"}
        for round_index in range(rounds):
            shift = round_index % len(plan)
            for kind, count in plan[shift:] + plan[:shift]:
                name = names.get((kind, count), f"{kind} x{count}")
                results.setdefault(name, []).append(await phase(pools[kind][:count], blocks))
    finally:
        if watcher is not None:
            watcher.close()
        for clients in pools.values():
            await asyncio.gather(*(client.close() for client in clients), return_exceptions=True)
    return {name: _stats(runs) for name, runs in results.items()}


def _engine_figures(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    out = {}
    for name, key in (("refiner_decode_step_seconds", "decode_step"), ("refiner_model_call_seconds", "model_call")):
        samples = metric_samples(text, name)
        count = samples.get(f"{name}_count", 0.0)
        out[f"{key}_count"] = count
        out[f"{key}_mean_s"] = samples.get(f"{name}_sum", 0.0) / max(count, 1.0)
    out["watch_units_dropped"] = metric_samples(text, "refiner_watch_units_dropped_total").get(
        "refiner_watch_units_dropped_total", 0.0)
    return out


def run_decode(preset: str = "medium", vae_preset: str = "tiny-vae", height: int = 8, width: int = 8,
               sessions: int = 4, rounds: int = 3, blocks: int = 3, threads: int | None = None,
               device: str = "auto") -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wm-decode-") as tmp:
        model = write_checkpoint(Path(tmp) / preset, preset=preset)
        vae = write_vae_checkpoint(Path(tmp) / vae_preset, vae_preset)
        server = ServerProcess(
            free_port(), Path(tmp) / "cache", None, Path(tmp) / "server.log", threads=threads, model=str(model),
            vae=str(vae), log_level="warning", max_sessions=2 * sessions + 5, warmup_height=height,
            warmup_width=width, warmup_prompt_tokens=PROMPT_TOKENS, device=device,
            max_batch_rows=max(8, sessions), watch_queue_units=2,
        )
        try:
            server.start(ready_timeout=600)
            info = httpx.get(f"{server.base_url}/v1/info", timeout=30).json()
            figures = asyncio.run(_measure(server, sessions, rounds, blocks, height, width,
                                           PRESETS[preset]["caption_channels"]))
            engine = _engine_figures(server)
        finally:
            server.kill()
    alone = figures["video x1"]["latency_p50_s"] / figures["latents x1"]["latency_p50_s"]
    shared = figures[f"video x{sessions}"]["blocks_per_s"] / figures[f"latents x{sessions}"]["blocks_per_s"]
    watched = figures["video x1 + stalled watcher"]["latency_p50_s"] / figures["video x1"]["latency_p50_s"]
    return {
        "command": (f"python -m bench decode --preset {preset} --vae-preset {vae_preset} --height {height} --width "
                    f"{width} --sessions {sessions} --rounds {rounds} --blocks {blocks}"
                    + (f" --threads {threads}" if threads else "") + (f" --device {device}" if device != "auto" else "")),
        "torch_threads": threads or "server default (all cores)",
        "vae": info["vae"],
        "sessions": sessions,
        "figures": figures,
        "engine": engine,
        "video_over_latents_latency_alone": alone,
        "video_over_latents_throughput_shared": shared,
        "stalled_watcher_over_none_latency": watched,
        "elapsed_s": time.perf_counter() - started,
    }


def format_decode(report: dict[str, Any]) -> str:
    vae, engine = report["vae"], report["engine"]
    lines = [
        "## Video output: refine + decode vs refine alone (WebSockets, closed-loop clients)",
        "",
        f"`{report['command']}` ({report['elapsed_s']:.0f} s; server torch threads: {report['torch_threads']}; VAE: "
        f"{vae['spatial_compression']}x spatial, {vae['temporal_compression']}x temporal, exact look-ahead "
        f"{vae['lookahead_latent_frames']} latent frames)",
        "",
        "| phase | blocks | aggregate blocks/s | latency p50 | p99 |",
        "|---|---|---|---|---|",
    ]
    for name, run in report["figures"].items():
        lines.append(f"| {name} | {run['blocks']} | {run['blocks_per_s']:.2f} | {run['latency_p50_s'] * 1000:.0f} ms "
                     f"| {run['latency_p99_s'] * 1000:.0f} ms |")
    sessions = report["sessions"]
    lines += [
        "",
        f"- one session: refine + decode / refine alone = **{report['video_over_latents_latency_alone']:.2f}x** "
        "block latency (p50)",
        f"- {sessions} sessions at once: video / latents = **{report['video_over_latents_throughput_shared']:.2f}x** "
        "aggregate blocks/s",
        f"- engine: {engine['decode_step_mean_s'] * 1000:.1f} ms per decode step ({engine['decode_step_count']:.0f} "
        f"steps) vs {engine['model_call_mean_s'] * 1000:.1f} ms per model call ({engine['model_call_count']:.0f} calls)",
        f"- a watcher that never reads: producer latency p50 with it / without = "
        f"**{report['stalled_watcher_over_none_latency']:.2f}x** ({engine['watch_units_dropped']:.0f} units dropped "
        "for it)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    parser.add_argument("--vae-preset", default="tiny-vae")
    parser.add_argument("--height", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", help="also write the report (markdown) to this file")
    args = parser.parse_args(argv)
    report = run_decode(args.preset, args.vae_preset, args.height, args.width, args.sessions, args.rounds,
                        args.blocks, args.threads, args.device)
    text = format_decode(report)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
