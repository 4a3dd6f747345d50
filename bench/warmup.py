"""``python -m bench warmup``: what ``compile_step``'s warm-up costs, by ``compile_buckets`` and by the state of
inductor's on-disk cache, and what a padded call costs once compiled.

Each case runs in a process of its own (dynamo's and inductor's in-memory caches start empty), with
``TORCHINDUCTOR_CACHE_DIR`` pointing at a folder of this run: ``cold`` is a new folder (a first start), ``warm``
the same folder again (a restart on a machine, or a volume, that kept it). Per case: the warm-up's seconds, the
graphs dynamo compiled, the (batch size, tokens per row) shapes; then the median seconds of a compiled call of
``rows - 1`` rows (3 of 4 by default: ``every`` runs it at its size, ``powers`` pads it to the next power of two).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .park import _cpu_model


def child(preset: str, rows: int, choice: str, geometries: list[tuple[int, int]], calls: int,
          backend: str = "inductor") -> dict[str, Any]:
    """One case, in this process: warm up the compiled step, then time a call of ``rows - 1`` rows."""
    import torch
    from torch._dynamo.utils import counters

    from models import SessionConfig, from_model
    from models.checkpoints import build_model
    from models.compiled import CompiledStep, warmup_forwards

    torch.manual_seed(0)
    refiner = from_model(build_model(preset))
    step = CompiledStep(refiner.model, max_rows=rows, sizes=choice, backend=backend)
    config = SessionConfig()
    started = time.perf_counter()
    step.warm_up(itertools.chain.from_iterable(warmup_forwards(refiner, config, height, width, 8)
                                               for height, width in geometries))
    warm_up_s = time.perf_counter() - started
    forward = next(forward for forward in warmup_forwards(refiner, config, *geometries[0], 8)
                   if forward.mode != "sink")  # a full block's denoising forward
    batch = [forward] * (rows - 1)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        step(refiner.model, batch)
        times.append(time.perf_counter() - started)
    return {"buckets": step.buckets, "warm_up_s": warm_up_s, "graphs_count": counters["stats"]["unique_graphs"],
            "shapes_count": len(step.compiled), "uncompiled_calls_count": step.uncompiled_calls,
            "call_rows_count": rows - 1, "call_runs_at_count": step.bucket(rows - 1),
            "call_s": sorted(times)[len(times) // 2]}


def run(preset: str, rows: int, geometries: list[tuple[int, int]], calls: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="wm-warmup-") as tmp:
        for choice in ("every", "powers"):
            cache = Path(tmp) / choice  # a cache of its own: the other choice's graphs must not warm this one
            for state in ("cold", "warm"):
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
                command = [sys.executable, "-m", "bench.warmup", "--child", choice, "--preset", preset,
                           "--rows", str(rows), "--calls", str(calls),
                           "--geometries", ",".join(f"{h}x{w}" for h, w in geometries)]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"{choice}/{state} failed:\n{done.stderr[-3000:]}")
                results[f"{choice}_{state}"] = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"{choice:6s} {state}: {json.dumps(results[f'{choice}_{state}'])}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench warmup", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rows", type=int, default=4, help="max_batch_rows (the call timed has one row fewer)")
    parser.add_argument("--geometries", default="4x4", help="latent sizes warmed up, e.g. 4x4,2x6")
    parser.add_argument("--calls", type=int, default=20, help="timed calls after the warm-up (the median is kept)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from app.core.settings import parse_geometries

    geometries = list(parse_geometries(args.geometries))
    if args.child:
        print(json.dumps(child(args.preset, args.rows, args.child, geometries, args.calls)))
        return 0
    import torch

    print(f"# python -m bench warmup --preset {args.preset} --rows {args.rows} --geometries {args.geometries} "
          f"--calls {args.calls}; torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {_cpu_model()}")
    results = run(args.preset, args.rows, geometries, args.calls)
    for choice in ("every", "powers"):
        cold, warm = results[f"{choice}_cold"], results[f"{choice}_warm"]
        print(f"{choice}: buckets {cold['buckets']}, {cold['shapes_count']} shapes, {cold['graphs_count']} graphs; "
              f"warm-up {cold['warm_up_s']:.1f} s cold, {warm['warm_up_s']:.1f} s with the cache "
              f"({cold['warm_up_s'] / warm['warm_up_s']:.2f}x); a {cold['call_rows_count']}-row call runs at "
              f"{cold['call_runs_at_count']} rows: {warm['call_s'] * 1e3:.2f} ms")
    every, powers = results["every_warm"], results["powers_warm"]
    print(f"padding's cost per call (powers / every): {powers['call_s'] / every['call_s']:.2f}x; "
          f"warm-up (every / powers, cold): {results['every_cold']['warm_up_s'] / results['powers_cold']['warm_up_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
