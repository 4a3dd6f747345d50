"""``python -m app plan``: the capacity plan of ``models.plan`` for a refiner folder or a settings file, on GPUs
this machine does not need to have. Nothing is loaded but ``config.json``; the model is built on ``meta``.

The command line's side lives here: reading sizes (``app.core.values.parse_bytes``, the one the settings use) and dtype
names (``models.loading.DTYPES``, with the short names a person types), and printing the plan (``render``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the model code load only when a plan is made: building the parser stays cheap
    import torch

    from models.plan import Gpu, Plan

# Memory sizes the plan is most often asked about; --gpu-memory takes any list.
KNOWN_GPUS = {"H100": "80GB", "H200": "141GB", "B200": "180GB"}


def add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="capacity plan: bytes per session, FLOPs per block, sessions per GPU (no weights loaded)")
    plan.add_argument("--model", help="refiner folder (or its config.json); only config.json is read (with "
                                      "--config: instead of the settings' model, as serve's --model)")
    plan.add_argument("--config", help="settings YAML (configs/sana-wm.yaml): its model folder's config.json, else "
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
    plan.add_argument("--max-load", type=float, default=None,
                      help="share of each GPU's TFLOP/s that real-time sessions may use (default: the settings' "
                           "admission_max_load with admission: realtime, else 1.0)")
    plan.add_argument("--reserve", default="2GiB", help="memory kept free besides weights and workspace (2GiB)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_command(args: argparse.Namespace) -> int:
    from app.core.settings import Settings, load_settings
    from models.plan import Stream, make_plan, read_config, released_config

    from app.core.values import parse_bytes

    if not (args.model or args.config):
        print("error: plan needs --model DIR (a refiner folder), --config FILE (a settings YAML such as "
              "configs/sana-wm.yaml), or both", file=sys.stderr)
        return 2
    settings = load_settings(args.config) if args.config else Settings()
    if args.model:
        config, source = read_config(args.model), str(args.model) + (f" (settings from {args.config})"
                                                                       if args.config else "")
    elif settings.model and Path(settings.model).exists():  # here: read (a release's top folder is named as such)
        config, source = read_config(settings.model), f"{settings.model} (the settings' model)"
    else:  # planning away from the weights: the released architecture
        config = released_config()
        where = (f"the settings' model folder {settings.model!r} is not on this machine" if settings.model
                 else "the settings name no model folder")
        source = f"the released refiner's architecture (diffusers' defaults; {where})"
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
    vae = args.vae or (settings.vae if settings.vae and Path(settings.vae).exists() else None)
    vae_config = None
    if vae:
        file = Path(vae) / "config.json" if Path(vae).is_dir() else Path(vae)
        if not file.is_file():
            from models.errors import ModelLoadError
            from models.loading import VAE_CLASS, pipeline_hint

            named = "--vae" if args.vae else "the settings' vae"
            raise ModelLoadError(f"{named} {vae!r}: no config.json there; pass an {VAE_CLASS} folder"
                                 f"{pipeline_hint(Path(vae), [VAE_CLASS])}")
        vae_config = json.loads(file.read_text())
    dtype_name = args.dtype or (settings.dtype if settings.dtype != "auto" else "bf16")
    gpus = _gpus(args.gpu_memory, args.tflops)
    plan = make_plan(config, stream, parse_dtype(dtype_name), gpus, source=source,
                     batch_rows=args.batch_rows or settings.max_batch_rows, reserve_bytes=parse_bytes(args.reserve),
                     vae_config=vae_config,
                     max_load=_max_load(settings) if args.max_load is None else args.max_load)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan))
    return 0


def _max_load(settings) -> float:
    """What the server admits real-time sessions up to: ``admission_max_load`` when admission is by real-time load;
    otherwise nothing keeps a share of the rate back, and the compute column spends all of it."""
    return settings.admission_max_load if settings.admission == "realtime" else 1.0


def parse_dtype(name: str) -> torch.dtype:
    """A dtype by its name (``bfloat16``) or short name (``bf16``); ValueError naming the ones there are."""
    from models.loading import DTYPE_ALIASES, DTYPES

    dtype = DTYPES.get(DTYPE_ALIASES.get(name, name))
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted([*DTYPES, *DTYPE_ALIASES])}")
    return dtype


def gpu_memory(text: str) -> int:
    """A GPU's memory size (``141GiB``, ``80GB``, a byte count); ValueError unless it is a positive size."""
    from app.core.values import parse_bytes

    size = parse_bytes(text)
    if size <= 0:
        raise ValueError(f"{text!r}: a GPU's memory size must be positive")
    return size


def _gpus(memory: str, tflops: str | None) -> list[Gpu]:
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
        gpus.append(Gpu(gpu_memory(size), rate, name))
    return gpus


# Printed sizes: GiB for memory held, GB (as vendors state it) for a GPU's memory.
GiB = 1024**3
GB = 1000**3


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 1024**2:.1f} MiB"


def _tf(n: float) -> str:
    return f"{n / 1e12:.2f} TFLOP"


def render(plan: Plan) -> str:
    """The plan as text for a terminal."""
    from models.plan import summarize

    s, g = plan.stream, plan.geometry
    forward, block = summarize(plan.flops_forward), summarize(plan.flops_block)
    lines = [
        f"capacity plan (arithmetic, not a measurement): {plan.source}",
        f"stream: {s['width']}x{s['height']} px at {s['fps']:g} fps -> {g['latent_width']}x{g['latent_height']} latents "
        f"({g['tokens_per_frame']} tokens/frame, {g['pixel_frames_per_latent_frame']} pixel frames per latent frame); "
        f"sink {s['sink_frames']}, block {s['block_size']}, kv_max_frames {s['kv_max_frames']}, {s['steps']} steps + "
        f"1 commit per block, batch {s['batch']}, prompt {s['prompt_tokens']} tokens, {s['positions']} positions, "
        f"{plan.dtype}",
        f"weights: {plan.weights['parameters'] / 1e9:.2f} B parameters loaded (the video path; the checkpoint holds "
        f"{plan.weights['checkpoint_parameters'] / 1e9:.2f} B){' + the VAE' if 'vae_bytes' in plan.weights else ''} = "
        f"{_gib(plan.weights['bytes'])}",
        f"per session: {_gib(plan.session['total'])} = KV window {_gib(plan.session['kv_window'])} + sink keys "
        f"{_gib(plan.session['kv_sink_keys'])} + rebased history keys {_gib(plan.session['kv_rebased_history_keys'])} "
        f"+ prompt {_gib(plan.session['prompt'])}"
        + (f" + video decoder state {_gib(plan.session['video_decoder_state'])}" if "video_decoder_state" in
           plan.session else " (latents only: --vae DIR adds a video session's decoder state)"),
        f"workspace (one call's activations, estimate): {_gib(plan.workspace_bytes)}",
        f"FLOPs per forward ({g['block_tokens']} queries over {g['window_tokens']} keys): {_tf(forward['total'])} = "
        f"projections {_tf(forward['projections'])} + attention {_tf(forward['attention'])} + feed-forward "
        f"{_tf(forward['feed_forward'])}",
        f"FLOPs per block ({s['steps'] + 1} forwards): {_tf(block['total'])}; plays for {plan.block_seconds:g} s -> "
        f"{plan.flops_per_second_per_session / 1e12:.1f} TFLOP/s per real-time session; sink capture "
        f"{_tf(plan.flops_sink)} once, caption projection and prompt K/V {_tf(plan.flops_prompt)} per prompt",
        "",
        f"sessions by compute: real-time sessions using at most {plan.max_load:g} of each GPU's TFLOP/s (--max-load; "
        "a server with admission: realtime admits up to its admission_max_load, 0.9 by default)",
        f"{'GPU':<10} {'memory':>11} {'sessions by memory':>19} {'TFLOP/s':>8} {'block compute':>14} "
        f"{'sessions by compute':>20} {'sessions':>9}",
    ]
    for row in plan.gpus:
        name = row["name"] or "-"
        if row["tflops"] is None:
            compute = f"{'-':>8} {'-':>14} {'-':>20} {row['sessions_by_memory']:>9}"
        else:
            compute = (f"{row['tflops']:>8g} {row['block_compute_seconds']:>13.2f}s "
                       f"{row['sessions_by_compute']:>20} {row['sessions']:>9}")
        lines.append(f"{name:<10} {row['memory_bytes'] / GB:>8.0f} GB {row['sessions_by_memory']:>19} {compute}")
    return "\n".join(lines)
