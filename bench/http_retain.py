"""``python -m bench http-retain``: what keeping an HTTP response's units for a resuming watcher costs a chunk.

An HTTP-fed session keeps the units it returns (its last ``ws_resume_units``), so that a watcher can resume it with
``resume_from``; a chunk's response is kept back until they are. Two servers run side by side on this machine (tiny
refiner + tiny VAE, each a ``python -m app serve`` subprocess): one with the default ``ws_resume_units``, one with
``ws_resume_units: 0`` (nothing kept, nothing waited for). For each output kind (``latents``; ``video`` as ``jpeg``
and as ``h264``, ``video_lookahead: 0`` so that every chunk returns its own frames) a session on each server gets the
sink and a first block, two untimed chunks, then ``--chunks`` one-block chunks posted alternately to the two (which goes first swaps
every round, so the machine's load shifts both alike), each timed from its POST to its response read. The figures:
per-chunk latency p50 and p95 on each server and their ratio (kept / not kept), in the same run. It reports; it
never asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from bench.encode import _payload, cpu_model
from bench.load import _percentile

# The output kinds measured: (name, the session's fields).
KINDS = {
    "latents": {"outputs": ["latents"]},
    "jpeg": {"outputs": ["video"], "video_format": "jpeg", "video_lookahead": 0},
    "h264": {"outputs": ["video"], "video_format": "h264", "video_lookahead": 0},
}
BLOCK = 3  # the tiny refiner's default block_size, latent frames
WARMUP_CHUNKS = 2  # untimed one-block chunks per session first (a new session's first-shape costs)


def run(kinds: list[str], chunks: int, pixels: tuple[int, int], threads: int | None,
        resume_units: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """Per kind, as it is measured: (kind, the chunk latency p50/p95 on the server that keeps the units
    (``resume_units``, None: the setting's default) and on the one that keeps none, and their ratios)."""
    import httpx

    from bench.live import ServerProcess, free_port
    from models.checkpoints import PRESETS, write_checkpoint, write_vae_checkpoint

    height, width = pixels[0] // 32, pixels[1] // 32  # the tiny VAE's 32x
    caption = PRESETS["tiny"]["caption_channels"]
    with tempfile.TemporaryDirectory(prefix="wm-http-retain-") as tmp:
        model = write_checkpoint(Path(tmp) / "tiny", preset="tiny")
        vae = write_vae_checkpoint(Path(tmp) / "vae", "tiny-vae")
        common = dict(threads=threads, model=str(model), vae=str(vae), log_level="warning", warmup_height=height,
                      warmup_width=width)
        kept_units = {} if resume_units is None else {"ws_resume_units": resume_units}
        servers = {
            "kept": ServerProcess(free_port(), Path(tmp) / "cache-kept", None, Path(tmp) / "kept.log",
                                  **common, **kept_units),
            "none": ServerProcess(free_port(), Path(tmp) / "cache-none", None, Path(tmp) / "none.log",
                                  **common, ws_resume_units=0),
        }
        try:
            for server in servers.values():
                server.start(ready_timeout=600)
            with httpx.Client(timeout=600) as http:
                for number, kind in enumerate(kinds):
                    generator = torch.Generator().manual_seed(number)
                    latents = torch.randn(1, 128, 1 + BLOCK * (WARMUP_CHUNKS + chunks + 1), height, width, generator=generator)
                    embeds = torch.randn(1, 8, caption, generator=generator)
                    sessions = {}
                    for name, server in servers.items():
                        created = http.post(f"{server.base_url}/v1/sessions", json=KINDS[kind])
                        created.raise_for_status()
                        sessions[name] = f"{server.base_url}/v1/sessions/{created.json()['session_id']}/chunks"
                        _post(http, sessions[name], _payload(latents[:, :, : 1 + BLOCK], embeds))
                    times: dict[str, list[float]] = {name: [] for name in servers}
                    for index in range(WARMUP_CHUNKS + chunks):
                        start = 1 + BLOCK * (index + 1)
                        body = _payload(latents[:, :, start : start + BLOCK])
                        order = list(servers) if index % 2 == 0 else list(reversed(servers))
                        for name in order:
                            began = time.perf_counter()
                            _post(http, sessions[name], body)
                            if index >= WARMUP_CHUNKS:
                                times[name].append(time.perf_counter() - began)
                    yield kind, _figures(times["kept"], times["none"])
        finally:
            for server in servers.values():
                server.kill()


def _post(http, url: str, body: bytes) -> None:
    reply = http.post(url, content=body, headers={"content-type": "application/octet-stream"})
    if reply.status_code != 200:
        raise SystemExit(f"chunk refused: {reply.status_code} {reply.text}")


def _figures(kept: list[float], none: list[float]) -> dict[str, Any]:
    def p95(values: list[float]) -> float:
        return _percentile(values, 0.95)

    return {"chunks": len(kept), "kept_p50_ms": statistics.median(kept) * 1000, "kept_p95_ms": p95(kept) * 1000,
            "none_p50_ms": statistics.median(none) * 1000, "none_p95_ms": p95(none) * 1000,
            "p50_ratio": statistics.median(kept) / statistics.median(none), "p95_ratio": p95(kept) / p95(none),
            "paired_ratio": statistics.median(k / n for k, n in zip(kept, none))}


def header(resume_units: int | None) -> list[str]:
    kept = "default" if resume_units is None else str(resume_units)
    return [f"| kind | chunks | p50 ws_resume_units {kept} | p50 at 0 | p50 ratio | p95 {kept} | p95 at 0 | "
            "p95 ratio | paired ratio (median) |", "|---|---|---|---|---|---|---|---|---|"]


def row(kind: str, r: dict[str, Any]) -> str:
    return (f"| {kind} | {r['chunks']} | {r['kept_p50_ms']:.1f} ms | {r['none_p50_ms']:.1f} ms | "
            f"**{r['p50_ratio']:.3f}x** | {r['kept_p95_ms']:.1f} ms | {r['none_p95_ms']:.1f} ms | "
            f"{r['p95_ratio']:.3f}x | {r['paired_ratio']:.3f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench http-retain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    parser.add_argument("--chunks", type=int, default=20, help="timed one-block chunks per server and kind")
    parser.add_argument("--height", type=int, default=480, help="video pixels (the tiny VAE's 32x latents)")
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--resume-units", type=int, default=None,
                        help="ws_resume_units of the server that keeps units (default: the setting's default)")
    parser.add_argument("--threads", type=int, default=None, help="each server's torch threads (default: all)")
    args = parser.parse_args(argv)
    command = (f"python -m bench http-retain --kinds {' '.join(args.kinds)} --chunks {args.chunks} --height "
               f"{args.height} --width {args.width}" + (f" --resume-units {args.resume_units}"
                                                         if args.resume_units is not None else "")
               + (f" --threads {args.threads}" if args.threads else ""))
    print(f"`{command}` on {cpu_model()} ({os.cpu_count()} cores)\n")
    print("\n".join(header(args.resume_units)), flush=True)
    for kind, figures in run(args.kinds, args.chunks, (args.height, args.width), args.threads, args.resume_units):
        print(row(kind, figures), flush=True)
    print(f"\nload average after: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
