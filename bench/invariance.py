"""``python -m bench invariance``: what batch invariance by construction costs.

The timestep embedding runs one row at a time (``models.step.time_embedding``: its GEMMs at M = 1 whatever the
batch) instead of once for all rows (M = R). This measures, in one process and interleaved so that a noisy machine
hurts both alike: a model call of R = 1, 4 and 8 rows (medium refiner, steady-state windows) with each form, the
time embedding alone in each form, and how long the start-up probes take (one per class the warm-up's size
meets: its block, its sink, each short last block). It reports; it never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import models.step as step
from models import SessionConfig, from_model, run_batch
from models.checkpoints import build_model
from models.determinism import probe_batch_invariance


def _batched_time_embedding(model, timestep, dtype):
    """The form before: one call for all rows (M = R), as diffusers does it (per token, M = B x N)."""
    rows = timestep.shape[0]
    temb, embedded = model.time_embed(timestep, batch_size=rows, hidden_dtype=dtype)
    return temb.view(rows, 1, -1), embedded.view(rows, 1, -1)


def steady_forwards(refiner, count: int, height: int, width: int) -> list:
    """The next forward of ``count`` sessions whose windows are full (the steady state)."""
    from models import RefinerSession, SessionConfig

    forwards = []
    for seed in range(count):
        config = SessionConfig(seed=seed)
        generator = torch.Generator().manual_seed(seed)
        frames = config.kv_max_frames + 2 * config.block_size
        latents = torch.randn(1, refiner.info.in_channels, frames, height, width, generator=generator)  # (1, C, T, H, W)
        embeds = torch.randn(1, 16, refiner.info.caption_channels, generator=generator)  # (1, L, caption)
        session = RefinerSession(refiner, config)
        session.push(latents[:, :, : frames - config.block_size], embeds)
        session.append(session.check(latents[:, :, frames - config.block_size :]))
        forwards.append(session.next_forward(session.start(session.plan())))
    return forwards


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls (after one untimed call)."""
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def run(preset: str, height: int, width: int, repeats: int, rounds: int) -> dict:
    refiner = from_model(build_model(preset))
    forwards = steady_forwards(refiner, 8, height, width)
    model = refiner.model
    per_row, batched = step.time_embedding, _batched_time_embedding
    figures: dict = {"calls": {}, "embedding": {}}
    with torch.no_grad():
        for rows in (1, 4, 8):
            timestep = torch.full((rows,), 909.375)
            times = {"per row": [], "batched": []}
            embed = {"per row": [], "batched": []}
            forms = [("per row", per_row), ("batched", batched)]
            for round_ in range(rounds):
                for name, form in forms if round_ % 2 == 0 else forms[::-1]:  # neither always goes first
                    step.time_embedding = form
                    try:
                        times[name].append(_time(lambda: run_batch(model, forwards[:rows]), repeats))
                    finally:
                        step.time_embedding = per_row
                    embed[name].append(_time(lambda: form(model, timestep, torch.float32), repeats * 5))
            figures["calls"][rows] = {name: min(values) for name, values in times.items()}
            figures["embedding"][rows] = {name: min(values) for name, values in embed.items()}
    # The start-up probes, as the service runs them before /ready (``Services._decide_batching``): the block's class,
    # then the sink's and each short last block's (1 and 2 frames with the default blocks of 3; the sink's is 1's).
    figures["probes"] = {}
    for frames in (SessionConfig().block_size, *range(1, SessionConfig().block_size)):
        started = time.perf_counter()
        probe = probe_batch_invariance(refiner, height, width, 16, block_frames=frames)
        figures["probes"][frames] = {"seconds": time.perf_counter() - started, "result": str(probe)}
    figures["threads"] = torch.get_num_threads()
    return figures


def report(figures: dict, preset: str, height: int, width: int) -> str:
    lines = [f"batch invariance cost: {preset} refiner, {height}x{width} latents, {figures['threads']} threads",
             "| rows | model call, per-row embedding | batched embedding | ratio | embedding per row | batched |",
             "|---|---|---|---|---|---|"]
    for rows, call in figures["calls"].items():
        embed = figures["embedding"][rows]
        lines.append(f"| {rows} | {call['per row'] * 1e3:.2f} ms | {call['batched'] * 1e3:.2f} ms | "
                     f"{call['per row'] / call['batched']:.3f}x | {embed['per row'] * 1e6:.0f} us | "
                     f"{embed['batched'] * 1e6:.0f} us |")
    probes = figures["probes"]
    for frames, probe in probes.items():
        lines.append(f"start-up probe, {frames}-frame forwards: {probe['seconds']:.2f} s ({probe['result']})")
    lines.append(f"start-up probes in all: {sum(p['seconds'] for p in probes.values()):.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench invariance", description=__doc__)
    parser.add_argument("--preset", default="medium", choices=["medium", "tiny"])
    parser.add_argument("--height", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = run(args.preset, args.height, args.width, args.repeats, args.rounds)
    print(report(figures, args.preset, args.height, args.width))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
