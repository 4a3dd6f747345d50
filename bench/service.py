"""The service path of the benchmark: per-block latency over the WebSocket of a real local server versus the
same block refined in-process, and the first refined block of a new session versus a steady-state block.

Everything runs in one process (the guide's rule for noisy machines: ratios against a baseline run in the same
process): uvicorn serves on a thread at 127.0.0.1, the WebSocket client (``wm_refiner_client``'s stream, driven
closed-loop by ``bench.closed_loop``) runs here, and the in-process baseline
is a ``RefinerSession`` on a second copy of the same weights, timed while the server is idle. Rounds alternate
(service block, in-process block) so load changes hit both sides alike.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from app.core.settings import Settings
from bench.closed_loop import ClosedLoop
from bench.live import ThreadServer
from models import RefinerSession, SessionConfig, load_refiner
from models.checkpoints import write_checkpoint

TARGET_STEADY_RATIO = 1.10  # WebSocket per-block latency / in-process block time
TARGET_FIRST_BLOCK_RATIO = 1.20  # first refined block of a new session / steady-state block (both over the socket)


class _Stream(ClosedLoop):
    """One session over the WebSocket: send frames, wait for the unit that ends at a given frame."""

    def __init__(self, server: ThreadServer, config: dict[str, Any]):
        super().__init__(server.base_url, config)
        self.open()

    def send(self, tensors: dict[str, torch.Tensor]) -> None:
        super().send({"latents": tensors["latents"], "prompt": tensors.get("prompt_embeds")})


def service_benchmark(args, preset: str, height: int, width: int, blocks: int, threads: int) -> dict[str, Any]:
    """Measure and return the figures (seconds); ``format_service`` renders them."""
    config = SessionConfig()
    sink, block = config.sink_frames, config.block_size
    fill = (config.kv_max_frames - config.sink_frames) // config.block_size + 1
    total_frames = sink + (fill + blocks) * block
    generator = torch.Generator().manual_seed(4321)
    with tempfile.TemporaryDirectory(prefix="wm-bench-") as tmp:
        folder = write_checkpoint(Path(tmp) / preset, preset=preset)
        local = load_refiner(folder, device=args.device, dtype=args.dtype)
        latents = torch.randn(1, local.info.in_channels, total_frames, height, width, generator=generator)
        embeds = torch.randn(1, 16, local.info.caption_channels, generator=generator)
        settings = Settings(
            model=str(folder),
            device=args.device,
            dtype=args.dtype,
            torch_threads=threads,
            log_level="warning",
            # Warm up at the geometry clients will send, so the first client pays no first-shape costs.
            warmup_height=height,
            warmup_width=width,
            warmup_prompt_tokens=embeds.shape[1],
        )
        with ThreadServer(settings) as server:
            return _measure(server, local, config, latents, embeds, fill, blocks)


def _measure(server, local, config, latents, embeds, fill, blocks) -> dict[str, Any]:
    sink, block = config.sink_frames, config.block_size

    # First refined block of a brand-new session: sink + one block in one message, timed to the block's unit.
    first_block = []
    for _ in range(3):
        stream = _Stream(server, {})
        started = time.perf_counter()
        stream.send({"latents": latents[:, :, : sink + block], "prompt_embeds": embeds})
        stream.until(sink + block)
        first_block.append(time.perf_counter() - started)
        stream.close()

    # Steady state: one long stream; every round sends one block over the socket, then refines the same block
    # of an in-process session on the same weights while the server idles.
    stream = _Stream(server, {})
    inproc = RefinerSession(local, config)
    stream.send({"latents": latents[:, :, : sink + block], "prompt_embeds": embeds})
    stream.until(sink + block)
    inproc.push(latents[:, :, : sink + block], embeds)
    for index in range(1, fill):
        start = sink + index * block
        stream.send({"latents": latents[:, :, start : start + block]})
        stream.until(start + block)
        inproc.push(latents[:, :, start : start + block])
    socket_times, server_times, inproc_times = [], [], []
    for index in range(fill, fill + blocks):
        start = sink + index * block
        chunk = latents[:, :, start : start + block]
        began = time.perf_counter()
        stream.send({"latents": chunk})
        unit = stream.until(start + block)
        socket_times.append(time.perf_counter() - began)
        server_times.append((unit.latency_ms if unit.latency_ms is not None else float("nan")) / 1000)
        began = time.perf_counter()
        inproc.push(chunk)
        inproc_times.append(time.perf_counter() - began)
    stream.close()

    steady_socket = statistics.median(socket_times)
    steady_inproc = statistics.median(inproc_times)
    return {
        "blocks_timed": blocks,
        "websocket_block_median_s": steady_socket,
        "server_reported_latency_median_s": statistics.median(server_times),
        "in_process_block_median_s": steady_inproc,
        "steady_ratio": steady_socket / steady_inproc,
        "steady_target": TARGET_STEADY_RATIO,
        "paired_ratio_median": statistics.median(s / i for s, i in zip(socket_times, inproc_times)),
        "first_block_s": first_block,
        "first_block_median_s": statistics.median(first_block),
        "first_block_ratio": statistics.median(first_block) / steady_socket,
        "first_block_target": TARGET_FIRST_BLOCK_RATIO,
    }


def format_service(figures: dict[str, Any]) -> list[str]:
    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.1f} ms"

    steady_met = figures["steady_ratio"] <= figures["steady_target"]
    first_met = figures["first_block_ratio"] <= figures["first_block_target"]
    return [
        "## Service path (WebSocket on 127.0.0.1, same process)",
        "",
        f"- steady-state block over the WebSocket (send -> unit received), median of {figures['blocks_timed']}: "
        f"{ms(figures['websocket_block_median_s'])}; server-reported latency "
        f"{ms(figures['server_reported_latency_median_s'])}",
        f"- the same block in-process (`session.push`): {ms(figures['in_process_block_median_s'])}",
        f"- ratio WebSocket / in-process: {figures['steady_ratio']:.3f} (median of paired rounds "
        f"{figures['paired_ratio_median']:.3f}); target <= {figures['steady_target']:.2f}: "
        f"**{'met' if steady_met else 'missed'}**",
        f"- first refined block of a new session (sink + block in one message -> block received): "
        f"{', '.join(ms(t) for t in figures['first_block_s'])}; median / steady-state block "
        f"{figures['first_block_ratio']:.3f}; target <= {figures['first_block_target']:.2f}: "
        f"**{'met' if first_met else 'missed'}**",
        "",
    ]
