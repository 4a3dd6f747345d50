"""``python -m bench loadmodel``: loading a real-width refiner checkpoint, ``load_refiner`` against safetensors.

A checkpoint at the released widths (diffusers' default ``SanaWMLTX2RefinerTransformer3DModel`` config: 4096 wide,
caption 3840, the audio branch too) with ``--layers`` blocks (4 by default: 1.89 B parameters, 3.5 GiB in bf16) is
written once to a temporary folder with random weights. Then, in alternating rounds on the same file (in the page
cache after the first read, for every variant alike):

- ``load_file``: ``safetensors.torch.load_file``, the floor: tensors as views into the file's memory map, nothing
  read until used;
- ``load_file + copy``: the same, then each video-path tensor copied into memory of its own (what a process must do
  to hold the weights in aligned memory, as the CPU kernels need; touching the bytes is most of loading);
- ``load_refiner``: ``models.loading.load_refiner`` on the CPU in the file's dtype (meta build, video path only,
  each tensor read into its final storage);
- with ``--old``: the loader before issue 22 (``from_pretrained(low_cpu_mem_usage=False)``, then a clone of every
  tensor), slow and memory-hungry: several times the checkpoint's size.

It prints seconds (median over rounds) and ratios against the baselines; it never asserts.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def write_released_width(folder: Path, layers: int, dtype: torch.dtype, preset: str = "released") -> int:
    """config.json + one safetensors file of random weights (std 0.02) for the released widths (or a test preset's,
    ``models.checkpoints.PRESETS``) at ``layers``; returns the file's size in bytes."""
    from diffusers import SanaWMLTX2RefinerTransformer3DModel
    from safetensors.torch import save_file

    from models.checkpoints import PRESETS

    widths = {} if preset == "released" else dict(PRESETS[preset])
    with torch.device("meta"):
        shapes = SanaWMLTX2RefinerTransformer3DModel(**{**widths, "num_layers": layers})
    config = {"_class_name": "SanaWMLTX2RefinerTransformer3DModel", **{k: v for k, v in shapes.config.items()
                                                                        if not k.startswith("_")}}
    generator = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(p.shape, generator=generator) * 0.02).to(dtype)
               for name, p in shapes.named_parameters()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    path = folder / "diffusion_pytorch_model.safetensors"
    save_file(tensors, str(path))
    return path.stat().st_size


def _timed(fn) -> float:
    gc.collect()
    started = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - started
    del result
    gc.collect()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench loadmodel", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks at the released widths (4)")
    parser.add_argument("--preset", default="released", help="widths: released (default) or a test preset (tiny)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="file and serving dtype")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old", action="store_true", help="also time the loader before issue 22 (slow, ~5x RAM)")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]

    from diffusers import SanaWMLTX2RefinerTransformer3DModel
    from safetensors.torch import load_file

    from models.loading import load_refiner

    with tempfile.TemporaryDirectory(prefix="bench-loadmodel-") as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        size = write_released_width(folder, args.layers, dtype, args.preset)
        print(f"wrote {size / 2**30:.2f} GiB ({args.layers} layers at the {args.preset} widths, {args.dtype}) in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        path = str(folder / "diffusion_pytorch_model.safetensors")
        refiner = load_refiner(folder, device="cpu", dtype=dtype)
        video = {name for name, _ in refiner.model.named_parameters()}
        loaded_bytes = sum(p.nbytes for p in refiner.model.parameters())
        del refiner

        def copied():
            weights = load_file(path)
            return {name: t.clone() for name, t in weights.items() if name in video}

        def old():
            model = SanaWMLTX2RefinerTransformer3DModel.from_pretrained(
                str(folder), local_files_only=True, use_safetensors=True, torch_dtype=dtype, low_cpu_mem_usage=False)
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
            return model

        variants = {"load_file": lambda: load_file(path), "load_file + copy": copied,
                    "load_refiner": lambda: load_refiner(folder, device="cpu", dtype=dtype)}
        if args.old:
            variants["old loader"] = old
        times: dict[str, list[float]] = {name: [] for name in variants}
        for round_index in range(args.rounds):
            names = list(variants)
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(_timed(variants[name]))
            print(f"round {round_index + 1}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()),
                  flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nloaded by load_refiner: {loaded_bytes / 2**30:.2f} GiB (the video path) of the file's "
          f"{size / 2**30:.2f} GiB")
    for name, seconds in median.items():
        print(f"{name:<18} {seconds:8.3f} s   x{seconds / median['load_file + copy']:.2f} of load_file + copy   "
              f"x{seconds / median['load_file']:.1f} of load_file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
