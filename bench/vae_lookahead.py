"""``python -m bench vae-lookahead``: what a bounded video look-ahead costs in fidelity, against the exact decode.

A random LTX-2 video VAE with the released decoder's depth (5 resnets per stage, ``released-depth-vae``: an exact
decode waits 22 latent frames) decodes one clip of random latents as a stream, refined blocks of 3 latent frames
arriving one at a time, with ``video_lookahead`` N = 0..8 and exact. For each N: the error of the emitted video
against the exact one (max abs in [0, 1] pixel values, PSNR over the whole clip and over its worst frame), and the
latency the look-ahead buys: latent frames a pixel frame waits for (N, against 22), and how many video frames
had been emitted when the stream's last block arrived. Random weights give an idea of the error's shape, not of
a trained VAE's; run it with ``--vae DIR`` on real weights for the numbers that matter.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from models.checkpoints import build_vae
from models.vae import StreamingDecoder, load_vae, new_video, push_video, video_tensor


def _stream(decoder, latents, block: int, lookahead):
    video, chunks = new_video(decoder, drop=1, lookahead=lookahead), []
    for start in range(0, latents.shape[2], block):
        video, chunk = push_video(decoder, video, latents[:, :, start : start + block])
        chunks.append(chunk)
    before_flush = video.emitted - 1
    video, chunk = push_video(decoder, video, None, final=True)
    chunks.append(chunk)
    frames = torch.cat([c.frames for c in chunks if c.count], dim=2)
    return video_tensor(frames, "float32", 1, 0, 0)[0], before_flush  # (F, 3, H, W) in [0, 1]


def _psnr(error_mse: float) -> float:
    return float("inf") if error_mse == 0 else 10 * math.log10(1.0 / error_mse)


def measure(decoder: StreamingDecoder, frames: int = 40, height: int = 4, width: int = 4, block: int = 3,
            lookaheads=range(0, 9)) -> dict:
    latents = torch.randn(1, decoder.info.latent_channels, frames, height, width,
                          generator=torch.Generator().manual_seed(0))
    began = time.perf_counter()
    exact, exact_before_flush = _stream(decoder, latents, block, None)
    seconds = time.perf_counter() - began
    rows = []
    for lookahead in lookaheads:
        video, before_flush = _stream(decoder, latents, block, lookahead)
        diff = (video - exact).float()
        per_frame = diff.pow(2).mean(dim=(1, 2, 3))
        rows.append({
            "lookahead": lookahead,
            "max_abs": diff.abs().max().item(),
            "psnr_db": _psnr(diff.pow(2).mean().item()),
            "worst_frame_psnr_db": _psnr(per_frame.max().item()),
            "frames_before_flush": before_flush,
        })
    return {"exact_lookahead": decoder.lookahead, "frames": exact.shape[0], "latent_frames": frames,
            "exact_frames_before_flush": exact_before_flush, "rows": rows, "exact_seconds": seconds,
            "geometry": f"{height}x{width}", "block": block}


def format_report(report: dict) -> str:
    lines = [
        "## Bounded video look-ahead against the exact decode",
        "",
        f"{report['latent_frames']} latent frames of {report['geometry']} in blocks of {report['block']} -> "
        f"{report['frames']} video frames; the exact decode waits {report['exact_lookahead']} latent frames "
        f"({report['exact_lookahead'] / 2:.1f} s of video at 16 fps) and had emitted "
        f"{report['exact_frames_before_flush']} frames when the last block arrived.",
        "",
        "| video_lookahead N (latent frames waited) | max abs error | PSNR (clip) | PSNR (worst frame) | frames out before the flush |",
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['lookahead']} | {row['max_abs']:.4f} | {row['psnr_db']:.1f} dB | "
            f"{row['worst_frame_psnr_db']:.1f} dB | {row['frames_before_flush']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench vae-lookahead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", help="a real AutoencoderKLLTX2Video folder (default: a random one, released depth)")
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--height", type=int, default=4)
    parser.add_argument("--width", type=int, default=4)
    args = parser.parse_args(argv)
    vae = (load_vae(args.vae, torch.device("cpu"), torch.float32) if args.vae
           else build_vae("released-depth-vae"))
    print(format_report(measure(StreamingDecoder(vae), args.frames, args.height, args.width)))
    return 0
