"""``python -m app plan``: the capacity plan of ``models.plan`` for a refiner folder or a settings file, on GPUs
this machine does not need to have. Nothing is loaded but ``config.json``; the model is built on ``meta``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Memory sizes the plan is most often asked about; --gpu-memory takes any list.
KNOWN_GPUS = {"H100": "80GB", "H200": "141GB", "B200": "180GB"}


def add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="capacity plan: bytes per session, FLOPs per block, sessions per GPU (no weights loaded)")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="refiner folder (or its config.json); only config.json is read")
    source.add_argument("--config", help="settings YAML (configs/sana-wm.yaml): its model folder's config.json, else "
                                         "the released refiner's architecture; its dtype, geometry and defaults")
    plan.add_argument("--vae", help="an LTX-2 VAE folder (or its config.json) for sessions with video outputs: "
                                    "adds its decoder state per session (default: the settings' vae, if any)")
    plan.add_argument("--height", type=int, help="pixels (default: the settings' warm-up geometry, else 704)")
    plan.add_argument("--width", type=int, help="pixels (default: the settings' warm-up geometry, else 1280)")
    plan.add_argument("--fps", type=float, help="pixel frames per second (default: the settings' default_fps)")
    plan.add_argument("--sink-frames", type=int)
    plan.add_argument("--block-size", type=int)
    plan.add_argument("--kv-max-frames", type=int)
    plan.add_argument("--steps", type=int, help="denoising forwards per block (default: len(default_sigmas) - 1)")
    plan.add_argument("--positions", choices=("absolute", "rebased"))
    plan.add_argument("--batch", type=int, default=1, help="rows per session (B)")
    plan.add_argument("--prompt-tokens", type=int, default=300, help="prompt length L (default 300)")
    plan.add_argument("--dtype", help="bf16, fp16, fp32 (default: the settings' dtype, else bf16)")
    plan.add_argument("--gpu-memory", default=",".join(f"{k}={v}" for k, v in KNOWN_GPUS.items()),
                      help="comma-separated sizes, optionally named: 141GiB or H200=141GB,... (default: "
                           "H100=80GB,H200=141GB,B200=180GB)")
    plan.add_argument("--tflops", default=None,
                      help="sustained TFLOP/s of the refiner's forwards: one value for every GPU, or one per "
                           "--gpu-memory entry (unset: no compute column)")
    plan.add_argument("--batch-rows", type=int, default=None,
                      help="rows of one model call, for the workspace estimate (default: max_batch_rows)")
    plan.add_argument("--reserve", default="2GiB", help="memory kept free besides weights and workspace (2GiB)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_command(args: argparse.Namespace) -> int:
    from app.settings import Settings, load_settings
    from models.plan import Stream, make_plan, parse_bytes, parse_dtype, read_config, released_config, render

    settings = load_settings(args.config) if args.config else Settings()
    if args.model:
        config, source = read_config(args.model), str(args.model)
    elif settings.model and (Path(settings.model) / "config.json").is_file():
        config, source = read_config(settings.model), f"{settings.model} (from {args.config})"
    else:
        config = released_config()
        source = (f"the released refiner's architecture (diffusers' defaults; {args.config}'s model folder "
                  f"{settings.model!r} has no config.json here)")
    scale = [int(v) for v in config.get("vae_scale_factors", (8, 32, 32))]
    from_settings = bool(args.config)
    height = args.height or (settings.warmup_height * scale[1] if from_settings else 704)
    width = args.width or (settings.warmup_width * scale[2] if from_settings else 1280)
    stream = Stream(
        height=height, width=width,
        fps=args.fps or settings.default_fps,
        sink_frames=args.sink_frames or settings.default_sink_frames,
        block_size=args.block_size or settings.default_block_size,
        kv_max_frames=args.kv_max_frames or settings.default_kv_max_frames,
        steps=args.steps or len(settings.default_sigmas) - 1,
        batch=args.batch, prompt_tokens=args.prompt_tokens,
        positions=args.positions or settings.default_positions,
    )
    vae = args.vae or (settings.vae if settings.vae and (Path(settings.vae) / "config.json").is_file() else None)
    vae_config = None
    if vae:
        file = Path(vae) / "config.json" if Path(vae).is_dir() else Path(vae)
        if not file.is_file():
            raise FileNotFoundError(f"--vae {vae!r}: no config.json there; pass an AutoencoderKLLTX2Video folder")
        vae_config = json.loads(file.read_text())
    dtype_name = args.dtype or (settings.dtype if settings.dtype != "auto" else "bf16")
    gpus = _gpus(args.gpu_memory, args.tflops, parse_bytes)
    plan = make_plan(config, stream, parse_dtype(dtype_name), gpus, source=source,
                     batch_rows=args.batch_rows or settings.max_batch_rows, reserve_bytes=parse_bytes(args.reserve),
                     vae_config=vae_config)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan))
    return 0


def _gpus(memory: str, tflops: str | None, parse_bytes) -> list:
    from models.plan import Gpu

    entries = [part.strip() for part in memory.split(",") if part.strip()]
    if not entries:
        raise ValueError("--gpu-memory is empty; give sizes such as 141GiB or H200=141GB,B200=180GB")
    rates: list[float | None]
    if tflops is None:
        rates = [None] * len(entries)
    else:
        try:
            rates = [float(v) for v in tflops.split(",")]
        except ValueError:
            raise ValueError(f"--tflops {tflops!r}: give numbers (TFLOP/s), one or one per GPU") from None
        if any(r <= 0 for r in rates):
            raise ValueError(f"--tflops {tflops!r}: rates must be positive")
        if len(rates) == 1:
            rates = rates * len(entries)
        elif len(rates) != len(entries):
            raise ValueError(f"--tflops has {len(rates)} values for {len(entries)} GPUs; give one, or one per GPU")
    gpus = []
    for entry, rate in zip(entries, rates):
        name, _, size = entry.rpartition("=")
        gpus.append(Gpu(parse_bytes(size), rate, name))
    return gpus
