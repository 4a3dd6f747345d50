"""``python -m bench encode``: what encoded video (``video_format`` jpeg / h264) saves and costs.

1. Codecs, offline, through the service's own encoder (``app.outputs.encoders``): bytes per frame against raw uint8,
   PSNR against the raw frames, and encode ms per frame on this CPU, for JPEG at quality 75/85/95 and H.264 at CRF
   23 and 28, encoded one unit (``--unit-frames``) at a time as the service does. On two clips at 832x480:
   a synthetic natural-looking one (smooth moving shapes and gradients, soft edges, a little sensor grain: not
   noise) and the tiny random VAE's decode of random latents (noise: the worst case).
2. The producer's block latency (send a block, get its unit, closed loop, WebSocket) on a server with the tiny
   refiner and the tiny VAE at 832x480, with no watcher and with ``--watchers`` watchers asking
   ``?video_format=jpeg`` (the producer gets uint8): the JPEG encodes run on the watchers' encoder threads.

It reports; it never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.outputs.encoders import encode_video
from wm_refiner_client import EncodedVideo

HEIGHT, WIDTH = 480, 832
SETTINGS = [("jpeg", 75), ("jpeg", 85), ("jpeg", 95), ("h264", 23), ("h264", 28)]


def natural_clip(frames: int, height: int = HEIGHT, width: int = WIDTH, seed: int = 0) -> np.ndarray:
    """uint8 (1, F, H, W, 3): a sky-like vertical gradient over a drifting sine-shaded ground with a smooth texture
    panning under it, three soft discs moving on smooth paths, and Gaussian grain of 1.5 levels (a camera's);
    deterministic."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    # Ground texture: noise smoothed to ~8 px features (grass, gravel), panned 2 px a frame like a moving camera.
    coarse = torch.from_numpy(rng.normal(0, 1, (1, 1, height // 8 + 1, (width + 2 * frames) // 8 + 1))).float()
    texture = torch.nn.functional.interpolate(coarse, scale_factor=8, mode="bicubic", align_corners=False)[0, 0].numpy()
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        sky = np.stack([0.35 + 0.25 * y / height, 0.55 + 0.2 * y / height, 0.85 - 0.2 * y / height], -1)
        ground = 0.5 + 0.15 * np.sin(x / 37.0 + t * 0.15) * np.cos(y / 53.0 - t * 0.05) \
            + 0.12 * texture[:height, 2 * t : 2 * t + width]
        horizon = 1 / (1 + np.exp(-(y - height * (0.6 + 0.03 * np.sin(t * 0.07))) / 6.0))
        image = sky * (1 - horizon[..., None]) + np.stack([0.3 * ground, 0.55 * ground, 0.2 * ground], -1) * horizon[
            ..., None]
        for k, colour in enumerate(((0.9, 0.3, 0.2), (0.95, 0.85, 0.3), (0.3, 0.4, 0.9))):
            cx = width * (0.2 + 0.3 * k) + 90 * np.sin(t * 0.06 + k)
            cy = height * (0.4 + 0.1 * k) + 40 * np.cos(t * 0.08 + 2 * k)
            radius = 50 + 15 * k
            disc = 1 / (1 + np.exp((np.sqrt((x - cx) ** 2 + (y - cy) ** 2) - radius) / 2.5))
            image = image * (1 - disc[..., None]) + np.array(colour, np.float32) * disc[..., None]
        image = image * 255 + rng.normal(0, 1.5, image.shape)
        out[t] = np.clip(image, 0, 255).round().astype(np.uint8)
    return out[None]


def vae_clip(frames: int, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """uint8 (1, F, H, W, 3): the tiny random VAE's decode of random latents (what the test servers show)."""
    from diffusers import AutoencoderKLLTX2Video

    from models.checkpoints import write_vae_checkpoint

    with tempfile.TemporaryDirectory(prefix="wm-encode-vae-") as tmp:
        vae = AutoencoderKLLTX2Video.from_pretrained(str(write_vae_checkpoint(Path(tmp) / "vae", "tiny-vae"))).eval()
    scale, temporal = 32, 8  # what its decoder does (its config's ratios describe the full-size VAE)
    latent_frames = max(2, -(-(frames - 1) // temporal) + 1)
    latents = torch.randn(1, vae.config.latent_channels, latent_frames, height // scale, width // scale,
                          generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        video = vae.decode(latents).sample  # (B, 3, F, H, W) in [-1, 1]
    if video.shape[-2:] != (height, width) or video.shape[2] < frames:
        raise RuntimeError(f"the tiny VAE decoded {tuple(video.shape[2:])}, not {frames} frames of {(height, width)}")
    video = ((video[:, :, :frames].clamp(-1, 1) * 0.5 + 0.5) * 255).round().to(torch.uint8)
    return video.permute(0, 2, 3, 4, 1).numpy()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def measure_codecs(clip: np.ndarray, unit_frames: int, fps: float = 16.0) -> list[dict[str, Any]]:
    frames = clip.shape[1]
    raw_per_frame = clip[0, 0].nbytes
    rows = []
    for fmt, quality in SETTINGS:
        total_bytes, seconds, decoded = 0, 0.0, []
        for start in range(0, frames, unit_frames):
            unit = np.ascontiguousarray(clip[:, start : start + unit_frames])
            began = time.perf_counter()
            encoded = encode_video(unit, fmt, quality, start, fps)
            seconds += time.perf_counter() - began
            total_bytes += encoded.nbytes
            pieces, at = [], 0
            for row in encoded.sizes.tolist():
                pieces.append(tuple(encoded.data[at + sum(row[:i]) : at + sum(row[: i + 1])] for i in range(len(row))))
                at += sum(row)
            init = tuple(int(v) for v in encoded.init_sizes) if encoded.init_sizes is not None else ()
            decoded.append(EncodedVideo(fmt, encoded.codec, quality, tuple(pieces), init).decode())
        back = np.concatenate(decoded, axis=1)
        per_frame = [psnr(back[0, f], clip[0, f]) for f in range(frames)]
        rows.append({
            "format": fmt, "quality": quality, "bytes_per_frame": total_bytes / frames,
            "ratio_vs_raw": raw_per_frame / (total_bytes / frames), "psnr_mean_db": statistics.fmean(per_frame),
            "psnr_min_db": min(per_frame), "encode_ms_per_frame": seconds / frames * 1000,
        })
    return rows


# --- the producer's latency with JPEG watchers -------------------------------------------------------------------
def measure_watchers(watchers: int, blocks: int, threads: int | None, pixels: tuple[int, int] = (HEIGHT, WIDTH),
                     ) -> dict[str, Any]:
    import httpx
    from websockets.sync.client import connect

    from bench.live import ServerProcess, free_port
    from models.checkpoints import PRESETS, write_checkpoint, write_vae_checkpoint

    height, width = pixels[0] // 32, pixels[1] // 32  # the tiny VAE's 32x
    block = 3
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="wm-encode-") as tmp:
        model = write_checkpoint(Path(tmp) / "tiny", preset="tiny")
        vae = write_vae_checkpoint(Path(tmp) / "vae", "tiny-vae")
        server = ServerProcess(free_port(), Path(tmp) / "cache", None, Path(tmp) / "server.log", threads=threads,
                               model=str(model), vae=str(vae), log_level="warning", warmup_height=height,
                               warmup_width=width, max_watchers=max(8, watchers))
        caption = PRESETS["tiny"]["caption_channels"]
        try:
            server.start(ready_timeout=600)
            for count in (0, watchers, 0):
                generator = torch.Generator().manual_seed(count)
                latents = torch.randn(1, 128, 1 + block * (blocks + 1), height, width, generator=generator)
                embeds = torch.randn(1, 8, caption, generator=generator)
                session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=60, json={
                    "outputs": ["video"], "video_lookahead": 0}).json()["session_id"]
                received = [0] * count
                sockets = [connect(f"{server.ws_url}/v1/sessions/{session_id}/watch?video_format=jpeg",
                                   max_size=None, open_timeout=60) for _ in range(count)]

                def read(index: int, ws) -> None:
                    try:
                        while True:
                            message = ws.recv(timeout=600)
                            if isinstance(message, bytes):
                                received[index] += 1
                            elif json.loads(message)["type"] == "done":
                                return
                    except Exception:
                        return

                readers = [threading.Thread(target=read, args=(i, ws), daemon=True) for i, ws in enumerate(sockets)]
                for reader in readers:
                    reader.start()
                latencies = produce(server, session_id, latents, embeds, block, blocks)
                for reader in readers:
                    reader.join(120)
                for sock in sockets:
                    sock.close()
                name = f"{count} JPEG watchers" if count else "no watcher"
                if name in results:
                    name += " (again)"
                latencies.sort()
                results[name] = {"blocks": len(latencies), "p50_ms": statistics.median(latencies) * 1000,
                                 "max_ms": latencies[-1] * 1000, "units_per_watcher": received}
        finally:
            server.kill()
    return results


def produce(server, session_id: str, latents: torch.Tensor, embeds: torch.Tensor, block: int, blocks: int) -> list[float]:
    """The producer's stream: the sink and a first block, then ``blocks`` blocks one at a time, each timed from its
    send to its unit; then a flush. Returns the blocks' latencies in seconds."""
    from websockets.sync.client import connect

    latencies = []
    with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", max_size=None, open_timeout=60) as ws:
        at = 1 + block
        ws.send(_payload(latents[:, :, :at], embeds))
        _wait_for(ws, at)
        for _ in range(blocks):
            began = time.perf_counter()
            ws.send(_payload(latents[:, :, at : at + block]))
            at += block
            _wait_for(ws, at)
            latencies.append(time.perf_counter() - began)
        ws.send(json.dumps({"type": "flush"}))
        while isinstance(ws.recv(timeout=600), bytes):
            pass
    return latencies


def _payload(latents: torch.Tensor, embeds: torch.Tensor | None = None) -> bytes:
    from safetensors.torch import save

    tensors = {"latents": latents.contiguous()}
    if embeds is not None:
        tensors["prompt_embeds"] = embeds.contiguous()
    return save(tensors)


def _wait_for(ws, frame_end: int) -> None:
    """Read the stream until the unit ending at latent frame ``frame_end`` arrived."""
    from app.core.codec import read_metadata

    while True:
        message = ws.recv(timeout=600)
        if isinstance(message, bytes) and int(read_metadata(message)["frame_end"]) >= frame_end:
            return


# --- the report ----------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def format_report(report: dict[str, Any]) -> str:
    lines = ["## Encoded video (jpeg, h264): bytes, quality, encode time", "",
             f"`{report['command']}` on {report['cpu']} (torch threads {torch.get_num_threads()}, load average "
             f"{report.get('load', '?')}); raw uint8 "
             f"{HEIGHT}x{WIDTH} = {HEIGHT * WIDTH * 3:,} bytes/frame; units of {report['unit_frames']} frames.", ""]
    for clip, rows in report["codecs"].items():
        lines += [f"**{clip}** ({report['frames']} frames)", "",
                  "| format | quality | bytes/frame | x fewer than raw | PSNR mean | PSNR min | encode ms/frame |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            label = f"q {r['quality']}" if r["format"] == "jpeg" else f"CRF {r['quality']}"
            lines.append(f"| {r['format']} | {label} | {r['bytes_per_frame']:,.0f} | {r['ratio_vs_raw']:.1f}x | "
                         f"{r['psnr_mean_db']:.1f} dB | {r['psnr_min_db']:.1f} dB | {r['encode_ms_per_frame']:.1f} |")
        lines.append("")
    if report.get("watchers"):
        lines += ["**Producer block latency** (tiny refiner + tiny VAE, 832x480 video, closed loop, uint8 to the "
                  "producer)", "", "| phase | blocks | p50 | max | units each watcher got |", "|---|---|---|---|---|"]
        for name, r in report["watchers"].items():
            lines.append(f"| {name} | {r['blocks']} | {r['p50_ms']:.0f} ms | {r['max_ms']:.0f} ms | "
                         f"{r['units_per_watcher'] or '-'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench encode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=48, help="frames of each clip (default 48: 3 s at 16 fps)")
    parser.add_argument("--unit-frames", type=int, default=24,
                        help="frames per encoded unit (default 24: a block of 3 latent frames)")
    parser.add_argument("--watchers", type=int, default=4, help="JPEG watchers in the latency phase (0: skip it)")
    parser.add_argument("--blocks", type=int, default=8, help="timed blocks per latency phase")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads (default: all)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    command = (f"python -m bench encode --frames {args.frames} --unit-frames {args.unit_frames} --watchers "
               f"{args.watchers} --blocks {args.blocks}" + (f" --threads {args.threads}" if args.threads else ""))
    report: dict[str, Any] = {"command": command, "cpu": cpu_model(), "frames": args.frames,
                              "unit_frames": args.unit_frames, "codecs": {}}
    report["codecs"]["synthetic natural clip, 832x480"] = measure_codecs(natural_clip(args.frames), args.unit_frames)
    report["codecs"]["tiny random VAE's output, 832x480"] = measure_codecs(vae_clip(args.frames), args.unit_frames)
    if args.watchers:
        report["watchers"] = measure_watchers(args.watchers, args.blocks, args.threads)
    report["load"] = " ".join(f"{v:.1f}" for v in os.getloadavg())
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
