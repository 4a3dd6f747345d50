"""``python -m bench cache``: what the per-session KV cache buys, and how close the refine step runs to the hardware.

Four figures, all measured in one process on one model (a random refiner from ``models.checkpoints``):

1. Steady-state time per block with the cache: a ``RefinerSession`` is fed until its history is full and
   trimmed, then each further block (3 denoising forwards + 1 commit forward over the block's own frames,
   attending to ``[sink | history | block]``) is timed.
2. The naive cost of the same block without a cache: every denoising forward recomputes the whole window
   (sink + history + block frames) with plain full self-attention. Cached and naive blocks are timed in
   alternating rounds, so slow phases of a shared machine hit both.
3. Achieved FLOP/s of the cached step (FLOPs counted analytically from the model's Linear layers and attention
   matmuls, cross-checked with ``torch.utils.flop_counter``) against a large square GEMM timed in the same
   rounds.
4. The session's KV cache bytes against the closed-form size.

The benchmark reports; it never asserts a timing. ``--service`` adds the WebSocket path (``bench.service``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

# Targets the report compares against (the numbers the project set, not anything measured here).
SPEEDUP_TARGET = 3.0
PEAK_FRACTION_TARGET = 0.60
PROMPT_TOKENS = 16
# Wall-clock budget of the timed rounds (override: WM_BENCH_BUDGET_S), and how many rounds run even past it.
ROUND_BUDGET_S = 150.0
MIN_ROUNDS = 3
LATENT_SEED = 1234


# --------------------------------------------------------------------------------------------------------------
# entry points


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("tiny", "medium"), default="medium")
    parser.add_argument("--blocks", type=int, default=12, help="steady-state blocks to time")
    parser.add_argument("--height", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--service", action="store_true", help="also time the WebSocket path of a local server")
    parser.add_argument("--output", help="also write the report (markdown) to this file")
    return parser


def bench_command(args: argparse.Namespace) -> int:
    """The ``bench`` subcommand: run, print the report, optionally write it as markdown."""
    report = run_bench(args)
    if getattr(args, "service", False):
        report["service"] = service_benchmark(args)
    text = format_report(report)
    print(text)
    output = getattr(args, "output", None)
    if output:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def service_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Time the WebSocket path of a local server against the same block in-process (``bench.service``)."""
    from bench.service import service_benchmark as run_service

    previous_threads = torch.get_num_threads()
    threads = _set_threads(getattr(args, "threads", None))
    try:
        return run_service(
            args,
            preset=_arg(args, "preset", "medium"),
            height=int(_arg(args, "height", 8)),
            width=int(_arg(args, "width", 8)),
            blocks=int(_arg(args, "blocks", 12)),
            threads=threads,
        )
    finally:
        torch.set_num_threads(previous_threads)


# --------------------------------------------------------------------------------------------------------------
# the benchmark


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement and return the report as a plain dict (what ``format_report`` renders)."""
    from models.loading import resolve_device, resolve_dtype

    started = time.perf_counter()
    preset = _arg(args, "preset", "medium")
    blocks = int(_arg(args, "blocks", 12))
    height = int(_arg(args, "height", 8))
    width = int(_arg(args, "width", 8))
    if blocks < 1 or height < 1 or width < 1:
        raise ValueError(f"--blocks, --height and --width must be >= 1 (got {blocks}, {height}, {width})")

    device = resolve_device(_arg(args, "device", "auto"))
    dtype = resolve_dtype(_arg(args, "dtype", "auto"), device)
    previous_threads = torch.get_num_threads()
    load_start = _load_average()
    threads = _set_threads(getattr(args, "threads", None))
    try:
        report = _run(args, preset, blocks, height, width, device, dtype, threads)
    finally:
        # A library caller (the tests, the service) keeps its own thread setting; only this run is pinned.
        torch.set_num_threads(previous_threads)
    report["machine"]["load_average_start"] = load_start
    report["elapsed_s"] = time.perf_counter() - started
    return report


def _run(args, preset: str, blocks: int, height: int, width: int, device, dtype, threads: int) -> dict[str, Any]:
    from models import Prompt, RefinerSession, SessionConfig, build_model, from_model

    refiner = from_model(build_model(preset), device, dtype)
    model = refiner.model
    config = SessionConfig()
    batch = 1
    tokens_per_frame = height * width
    window_frames = config.kv_max_frames + config.block_size  # sink + full history + the block itself

    latent_gen = torch.Generator(device="cpu").manual_seed(LATENT_SEED)

    def frames(count: int) -> torch.Tensor:  # (B, C, count, H, W), fp32 on CPU like a client would send
        return torch.randn(batch, refiner.info.in_channels, count, height, width, generator=latent_gen)

    prompt_embeds = torch.randn(batch, PROMPT_TOKENS, refiner.info.caption_channels, generator=latent_gen)
    # The same conditioning the session derives from a mask-less prompt: embeds cast to the model, all-ones mask.
    prompt = Prompt(
        embeds=prompt_embeds.to(device=device, dtype=dtype),
        mask=torch.ones(batch, PROMPT_TOKENS, device=device, dtype=dtype),
    )

    # --- fill the window: the sink, then blocks until the history is at its cap (the trim has happened) --------
    session = RefinerSession(refiner, config)
    session.push(frames(config.sink_frames), prompt_embeds)
    fill_blocks = 0
    while session.state.history_frames < config.max_history_frames:
        session.push(frames(config.block_size))
        fill_blocks += 1

    def cached_block() -> float:
        # Appending is bookkeeping; the timed part is the block's refine step (plan -> forwards -> commit).
        session.append(session.check(frames(config.block_size)))
        before = session.state.blocks_refined
        seconds = _timed(device, session.step)
        _check_steady(session, before)
        return seconds

    naive = NaiveWindow(refiner, config, prompt, batch, height, width)

    def naive_block() -> float:
        window = frames(window_frames).to(device=device, dtype=dtype)
        end = session.state.frames_returned  # the window the latest cached block used, in absolute frames
        positions = list(range(end - window_frames, end))
        return _timed(device, lambda: naive.refine(window, positions))

    gemm = GemmProbe(device, dtype, getattr(args, "gemm_size", None))
    ffn_dim = int(model.transformer_blocks[0].ff.net[0].proj.out_features)
    block_rows = config.block_size * tokens_per_frame * batch
    shapes = ShapeGemmProbe(device, dtype, block_rows, refiner.info.inner_dim, ffn_dim)

    # --- warm-up: allocator, kernels, thread pools; also the FLOP counter runs, which are slow and untimed --------
    for _ in range(2):
        cached_block()
        naive_block()
    gemm.sample(reps=2)
    shapes.sample(reps=3)
    session.append(session.check(frames(config.block_size)))
    before = session.state.blocks_refined
    counted_cached = count_flops(session.step)
    _check_steady(session, before)
    counted_naive = count_flops(
        lambda: naive.refine(
            frames(window_frames).to(device=device, dtype=dtype),
            list(range(session.state.frames_returned - window_frames, session.state.frames_returned)),
        )
    )
    gemm.sample(reps=3)

    # --- the measured rounds: cached, naive and a GEMM sample, in an order that rotates every round ---------------
    cached_times: list[float] = []
    naive_times: list[float] = []
    steps: list[Callable[[], Any]] = [
        lambda: cached_times.append(cached_block()),
        lambda: naive_times.append(naive_block()),
        lambda: (gemm.sample(reps=1), shapes.sample(reps=3)),
    ]
    budget = _round_budget(args)
    rounds_started = time.perf_counter()
    rounds = 0
    for round_index in range(blocks):
        shift = round_index % len(steps)
        for run in steps[shift:] + steps[:shift]:
            run()
        rounds += 1
        # On a contended machine a round can take many times its quiet duration; past the budget, stop with what
        # was measured (never fewer than MIN_ROUNDS) and say so in the report rather than run for many minutes.
        if rounds >= min(MIN_ROUNDS, blocks) and time.perf_counter() - rounds_started > budget:
            break
    gemm.sample(reps=2)

    # --- figures ------------------------------------------------------------------------------------------------
    analytic_cached = cached_block_flops(model, config, batch, tokens_per_frame, PROMPT_TOKENS)
    analytic_naive = naive_block_flops(model, config, batch, tokens_per_frame, PROMPT_TOKENS)
    cached_stats = _stats(cached_times)
    naive_stats = _stats(naive_times)
    paired = [n / c for c, n in zip(cached_times, naive_times)]
    peak = gemm.best
    achieved_median = analytic_cached["total"] / cached_stats["median_s"]
    achieved_best = analytic_cached["total"] / cached_stats["min_s"]

    element = torch.empty((), dtype=dtype).element_size()
    layers = refiner.num_layers
    inner = refiner.info.inner_dim
    cache_frames = config.sink_frames + config.max_history_frames
    formula_bytes = 2 * layers * cache_frames * tokens_per_frame * inner * element * batch
    # What the session allocates: the window with its block slot, plus the pre-RoPE sink keys.
    allocated_formula = (
        layers * (2 * (cache_frames + config.block_size) + config.sink_frames) * tokens_per_frame * inner * element
        * batch
    )

    report: dict[str, Any] = {
        "command": _command_line(preset, blocks, height, width, args),
        "machine": _machine(device, dtype, threads),
        "model": {
            "preset": preset,
            "layers": layers,
            "inner_dim": inner,
            "heads": refiner.info.num_attention_heads,
            "head_dim": refiner.info.attention_head_dim,
            "ffn_dim": ffn_dim,
            "caption_channels": refiner.info.caption_channels,
            "parameters": refiner.info.parameters,
            "dtype": str(dtype).removeprefix("torch."),
            "device": str(device),
        },
        "geometry": {
            "batch": batch,
            "height": height,
            "width": width,
            "tokens_per_frame": tokens_per_frame,
            "prompt_tokens": PROMPT_TOKENS,
            "sink_frames": config.sink_frames,
            "block_size": config.block_size,
            "kv_max_frames": config.kv_max_frames,
            "window_frames": window_frames,
            "cached_forwards_per_block": f"{config.steps} denoise + 1 commit over {config.block_size} frames",
            "naive_forwards_per_block": f"{config.steps} over {window_frames} frames",
            "fill_blocks": fill_blocks,
            "timed_rounds": rounds,
            "requested_rounds": blocks,
            "round_budget_s": budget,
        },
        "cached": cached_stats,
        "naive": naive_stats,
        "speedup": {
            "median_ratio": naive_stats["median_s"] / cached_stats["median_s"],
            "mean_ratio": naive_stats["mean_s"] / cached_stats["mean_s"],
            "paired_median_ratio": statistics.median(paired),
            # Best against best: the least disturbed run of each path, when other work shares the cores.
            "min_ratio": naive_stats["min_s"] / cached_stats["min_s"],
            "analytic_flop_ratio": analytic_naive["total"] / analytic_cached["total"],
            "target": SPEEDUP_TARGET,
            "met": naive_stats["median_s"] / cached_stats["median_s"] >= SPEEDUP_TARGET,
        },
        "flops": {
            "cached_block": analytic_cached,
            "naive_block": analytic_naive,
            "counter_cached_block": counted_cached,
            "counter_naive_block": counted_naive,
        },
        "gemm": gemm.summary(),
        "model_shape_gemms": {"samples": shapes.samples, "best_flops": dict(shapes.best)},
        "efficiency": {
            "achieved_median_flops": achieved_median,
            "achieved_best_flops": achieved_best,
            "peak_flops": peak,
            "fraction_median_vs_peak": achieved_median / peak,
            "fraction_best_vs_peak": achieved_best / peak,
            "fraction_median_vs_median_gemm": achieved_median / gemm.median,
            "target": PEAK_FRACTION_TARGET,
            "met": achieved_median / peak >= PEAK_FRACTION_TARGET,
        },
        "cache": {
            "live_bytes": session.kv.live_bytes,
            "formula_bytes": formula_bytes,
            "formula": (
                f"2 x {layers} layers x ({config.sink_frames} + {config.max_history_frames}) frames x "
                f"{tokens_per_frame} tokens x {inner} dim x {element} B x batch {batch}"
            ),
            "cache_bytes": session.cache_bytes,
            "allocated_formula_bytes": allocated_formula,
            "allocated_formula": (
                f"{layers} layers x (2 x ({cache_frames} + {config.block_size}) + {config.sink_frames}) frames x "
                f"{tokens_per_frame} tokens x {inner} dim x {element} B x batch {batch}"
            ),
            "storage_bytes": _storage_bytes(session),
            "history_frames": session.state.history_frames,
            "match": session.kv.live_bytes == formula_bytes and session.cache_bytes == allocated_formula,
        },
        "service": None,
    }
    return report


class NaiveWindow:
    """A block refined with no cache: every denoising forward runs over the whole window's tokens.

    The context frames (sink + history) go in clean at timestep 0 and the block at the current sigma, with plain
    full self-attention (no window object: ``WindowAttnProcessor`` then attends over the forward's own tokens).
    This is the cost baseline, not a numerical replica: full attention also lets context attend to the block.
    No commit forward: with nothing cached there is nothing to capture.
    """

    def __init__(self, refiner, config, prompt, batch: int, height: int, width: int):
        self.refiner = refiner
        self.config = config
        self.prompt = prompt
        self.batch = batch
        self.height = height
        self.width = width
        self.sigmas = torch.tensor(config.sigmas, dtype=torch.float32, device=refiner.device)
        self.generator = torch.Generator(device=refiner.device).manual_seed(config.seed)

    def refine(self, window: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Refine the last ``block_size`` frames of ``window`` (B, C, T, H, W) in the model dtype."""
        from models.forward import pack, unpack
        from models.rope import rope_tables

        refiner, config = self.refiner, self.config
        model, device, dtype = refiner.model, refiner.device, refiner.dtype
        block = config.block_size
        rope = rope_tables(model, positions, self.batch, self.height, self.width, config.fps, device, dtype)
        context = pack(window[:, :, :-block])  # (B, N_ctx, C)
        clean = window[:, :, -block:]
        noise = torch.randn(clean.shape, generator=self.generator, device=device, dtype=dtype)
        sigma_max = float(self.sigmas[0])
        x = ((1.0 - sigma_max) * clean.float() + sigma_max * noise.float()).to(dtype)
        multiplier = float(model.config.timestep_scale_multiplier)
        context_t = torch.zeros(self.batch, context.shape[1], dtype=torch.float32, device=device)
        with torch.no_grad():
            for i in range(config.steps):
                sigma = float(self.sigmas[i])
                block_tokens = pack(x)  # (B, N_blk, C)
                tokens = torch.cat([context, block_tokens], dim=1)  # (B, N_ctx + N_blk, C)
                timestep = torch.cat(
                    [context_t, torch.full(block_tokens.shape[:2], sigma * multiplier, device=device)], dim=1
                )
                out = model(
                    hidden_states=tokens,
                    encoder_hidden_states=self.prompt.embeds,
                    timestep=timestep,
                    video_rotary_emb=rope,
                    encoder_attention_mask=self.prompt.mask,
                    kv_cache=None,
                    kv_cache_mode=None,
                    return_dict=False,
                )[0]
                velocity = out[:, -block_tokens.shape[1] :]  # (B, N_blk, C)
                x0 = unpack((block_tokens.float() - velocity.float() * sigma).to(dtype), block, self.height, self.width)
                if sigma <= 1.0e-6:
                    x = x0
                else:
                    x = (x.float() + (self.sigmas[i + 1] - self.sigmas[i]) * (x.float() - x0.float()) / sigma).to(dtype)
        return x


# --------------------------------------------------------------------------------------------------------------
# FLOPs


def _linear(module: torch.nn.Linear, rows: int) -> int:
    return 2 * rows * module.in_features * module.out_features


def forward_flops(model, batch: int, queries: int, keys: int, prompt_tokens: int, cached: bool) -> dict[str, int]:
    """Multiply-add FLOPs (2 per MAC) of one video-path forward over ``queries`` tokens whose self-attention sees
    ``keys`` tokens. Dimensions are read from the modules themselves, so any preset or checkpoint is counted as
    built. Elementwise work (norms, RoPE, softmax, GELU, modulation) is left out, as GEMM-FLOP counts do.

    ``cached``: the service's step (``models.step``), which embeds the timestep once per row and projects the
    prompt, and each layer's cross-attention K/V of it, once per prompt (not per forward); otherwise diffusers' forward, which does both per forward, the
    timestep per token."""
    n, m, p = batch * queries, keys, prompt_tokens
    emb = model.time_embed.emb.timestep_embedder
    caption = model.caption_projection
    time_rows = batch if cached else n
    parts = {
        "proj_in": _linear(model.proj_in, n),
        "time_embed": sum(_linear(lin, time_rows) for lin in (emb.linear_1, emb.linear_2, model.time_embed.linear)),
        "caption_projection": 0 if cached else _linear(caption.linear_1, batch * p) + _linear(caption.linear_2, batch * p),
        "attn1_qkv_out": 0,
        "attn1_scores_av": 0,
        "attn2_q_out": 0,
        "attn2_kv": 0,
        "attn2_scores_av": 0,
        "ff": 0,
        "proj_out": _linear(model.proj_out, n),
    }
    for block in model.transformer_blocks:
        a1, a2 = block.attn1, block.attn2
        parts["attn1_qkv_out"] += sum(_linear(lin, n) for lin in (a1.to_q, a1.to_k, a1.to_v, a1.to_out[0]))
        if a1.to_gate_logits is not None:
            parts["attn1_qkv_out"] += _linear(a1.to_gate_logits, n)
        parts["attn1_scores_av"] += 2 * (2 * n * m * a1.inner_dim)  # QK^T and AV over every head
        parts["attn2_q_out"] += _linear(a2.to_q, n) + _linear(a2.to_out[0], n)
        if a2.to_gate_logits is not None:
            parts["attn2_q_out"] += _linear(a2.to_gate_logits, n)
        if not cached:  # the service projects each layer's prompt K/V once per prompt (models.step.prepare_prompt)
            parts["attn2_kv"] += _linear(a2.to_k, batch * p) + _linear(a2.to_v, batch * p)
        parts["attn2_scores_av"] += 2 * (2 * n * p * a2.inner_dim)
        parts["ff"] += _linear(block.ff.net[0].proj, n) + _linear(block.ff.net[2], n)
    parts["total"] = sum(parts.values())
    return parts


def _add(into: dict[str, int], part: dict[str, int], times: int = 1) -> dict[str, int]:
    for key, value in part.items():
        into[key] = into.get(key, 0) + times * value
    return into


def cached_block_flops(model, config, batch: int, tokens_per_frame: int, prompt_tokens: int) -> dict[str, int]:
    """A steady-state cached block: ``steps`` denoise + 1 commit forward over the block, keys = the full window."""
    queries = config.block_size * tokens_per_frame
    keys = (config.kv_max_frames + config.block_size) * tokens_per_frame
    return _add({}, forward_flops(model, batch, queries, keys, prompt_tokens, cached=True), config.steps + 1)


def naive_block_flops(model, config, batch: int, tokens_per_frame: int, prompt_tokens: int) -> dict[str, int]:
    """The same block with no cache: ``steps`` forwards over every window token, full self-attention."""
    tokens = (config.kv_max_frames + config.block_size) * tokens_per_frame
    return _add({}, forward_flops(model, batch, tokens, tokens, prompt_tokens, cached=False), config.steps)


def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def count_flops(fn: Callable[[], Any]) -> dict[str, Any]:
    """FLOPs seen by ``torch.utils.flop_counter.FlopCounterMode`` while ``fn`` runs.

    PyTorch's table has no formula for the CPU fused attention kernel, so on CPU the attention matmuls would
    silently count as zero; the same formula it uses for the CUDA kernels is mapped onto that op here, and what
    the stock table alone saw is reported next to it.
    """
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        return {"available": False, "reason": str(exc)}
    extra: dict[Any, Any] = {}
    cpu_op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_op is not None:
        extra[cpu_op] = _cpu_flash_attention_flops
    try:
        counter = FlopCounterMode(display=False, custom_mapping=extra)
        with counter:
            fn()
    except Exception as exc:  # the counter is a cross-check; a failure there must not sink the benchmark
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    by_op = {str(op): int(flops) for op, flops in counter.get_flop_counts().get("Global", {}).items()}
    added = sum(v for k, v in by_op.items() if "_for_cpu" in k)
    total = int(counter.get_total_flops())
    return {"available": True, "total": total, "stock_table_total": total - added, "by_op": by_op}


# --------------------------------------------------------------------------------------------------------------
# GEMM reference


class GemmProbe:
    """Best and typical rate of a large square matmul in the model dtype: the machine's practical GEMM peak."""

    def __init__(self, device: torch.device, dtype: torch.dtype, size: int | None = None):
        self.device = device
        self.size = int(size) if size else (8192 if device.type == "cuda" else 2048)
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.a = torch.randn(self.size, self.size, generator=gen).to(device=device, dtype=dtype)
        self.b = torch.randn(self.size, self.size, generator=gen).to(device=device, dtype=dtype)
        self.dtype = dtype
        self.samples: list[float] = []

    @property
    def flops(self) -> int:
        return 2 * self.size**3

    def sample(self, reps: int) -> None:
        for _ in range(reps):
            seconds = _timed(self.device, lambda: torch.mm(self.a, self.b))
            self.samples.append(self.flops / seconds)

    @property
    def best(self) -> float:
        return max(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def summary(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "samples": len(self.samples),
            "best_flops": self.best,
            "median_flops": self.median,
            "worst_flops": min(self.samples),
        }


class ShapeGemmProbe:
    """Best rate of the cached step's dominant Linear shapes (block tokens x in -> out): what the step's GEMMs can
    reach at their own size, as opposed to the big square GEMM. Sampled in every round like the big one, because
    a single burst of samples can land entirely inside another process's busy spell."""

    def __init__(self, device: torch.device, dtype: torch.dtype, rows: int, dim: int, ffn: int):
        self.device = device
        gen = torch.Generator(device="cpu").manual_seed(1)
        self.cases: dict[str, tuple[int, Callable[[], Any]]] = {}
        for name, (k, n) in {"DxD": (dim, dim), "Dx4D": (dim, ffn), "4DxD": (ffn, dim)}.items():
            x = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
            w = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype)
            bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
            self.cases[f"{rows}x{k}->{n} ({name})"] = (
                2 * rows * k * n,
                lambda x=x, w=w, bias=bias: torch.nn.functional.linear(x, w, bias),
            )
        self.best: dict[str, float] = {key: 0.0 for key in self.cases}
        self.samples = 0

    def sample(self, reps: int) -> None:
        for key, (flops, run) in self.cases.items():
            for _ in range(reps):
                self.best[key] = max(self.best[key], flops / _timed(self.device, run))
        self.samples += reps


# --------------------------------------------------------------------------------------------------------------
# helpers


def _round_budget(args) -> float:
    value = getattr(args, "budget_s", None)
    if value is None:
        env = os.environ.get("WM_BENCH_BUDGET_S")
        value = float(env) if env else ROUND_BUDGET_S
    return float(value)


def _arg(args, name: str, default):
    """``args.name`` unless absent or None (library callers may pass a partial namespace); 0 stays 0."""
    value = getattr(args, name, None)
    return default if value is None else value


def _check_steady(session, blocks_before: int) -> None:
    """A timed step must have refined exactly one block against a full window; timing anything else (a step with
    nothing to do, a window still filling) would report a wrong figure without any error."""
    state = session.state
    if state.blocks_refined != blocks_before + 1 or state.pending_frames:
        raise RuntimeError(
            f"benchmark step refined {state.blocks_refined - blocks_before} blocks and left {state.pending_frames} "
            "frames pending; expected exactly one block and nothing pending"
        )
    if state.history_frames != session.config.max_history_frames:
        raise RuntimeError(f"benchmark step ran with {state.history_frames} history frames, not a full window")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Wall seconds of ``fn`` with the device drained on both sides (kernels are asynchronous on CUDA)."""
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        fn()
    _sync(device)
    return time.perf_counter() - start


def _stats(times: list[float]) -> dict[str, Any]:
    return {
        "blocks": len(times),
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "min_s": min(times),
        "max_s": max(times),
        "stdev_s": statistics.stdev(times) if len(times) > 1 else 0.0,
        "times_s": list(times),
    }


def _set_threads(requested: int | None) -> int:
    """Pin the intra-op thread count (default: every CPU this process may run on) so runs are comparable."""
    if requested is None:
        env = os.environ.get("WM_BENCH_THREADS")
        requested = int(env) if env else None
    if requested is None:
        try:
            requested = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            requested = os.cpu_count() or 1
    torch.set_num_threads(max(1, int(requested)))
    return torch.get_num_threads()


def _storage_bytes(session) -> int:
    """Bytes of the distinct storages behind the session's cache: catches buffers larger than the tensors that
    view them, which ``cache_bytes`` (tensor sizes) would not show."""
    kv = session.kv
    seen: dict[tuple[str, int], int] = {}
    for tensor in (kv.window, kv.sink_key, kv.history_key):
        if tensor is not None:
            storage = tensor.untyped_storage()
            seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def _load_average() -> float | None:
    """1-minute load average: on a shared machine it says how much else was competing for the cores."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # pragma: no cover - not available on this platform
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine(device: torch.device, dtype: torch.dtype, threads: int) -> dict[str, Any]:
    import diffusers

    info: dict[str, Any] = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "torch_interop_threads": torch.get_num_interop_threads(),
    }
    load = _load_average()
    if load is not None:
        info["load_average_end"] = load
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _command_line(preset: str, blocks: int, height: int, width: int, args) -> str:
    parts = ["python -m bench cache", f"--preset {preset}", f"--blocks {blocks}"]
    parts += [f"--height {height}", f"--width {width}"]
    for name in ("device", "dtype"):
        value = getattr(args, name, None)
        if value and value != "auto":
            parts.append(f"--{name} {value}")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------------------------
# report


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def format_report(report: dict[str, Any]) -> str:
    """The report as markdown (also what is printed: it reads fine as plain text)."""
    m, g, mach = report["model"], report["geometry"], report["machine"]
    cached, naive, speed = report["cached"], report["naive"], report["speedup"]
    flops, eff, cache, gemm = report["flops"], report["efficiency"], report["cache"], report["gemm"]
    lines = [
        "# wm-refiner benchmark: KV-cached refine step",
        "",
        f"`{report['command']}`",
        "",
        f"- machine: {mach['cpu']}, {mach['cpu_count']} CPUs, torch {mach['torch']}, diffusers {mach['diffusers']}, "
        f"python {mach['python']}" + (f", GPU {mach['gpu']}" if "gpu" in mach else ""),
        f"- run on: {mach['device']} / {mach['dtype']}, torch threads {mach['torch_threads']} "
        f"(interop {mach['torch_interop_threads']})"
        + (
            f", 1-min load average {mach['load_average_start']:.2f} at start, {mach['load_average_end']:.2f} at end"
            if mach.get("load_average_start") is not None and mach.get("load_average_end") is not None
            else ""
        ),
        f"- model: preset `{m['preset']}`, {m['layers']} layers, dim {m['inner_dim']} ({m['heads']} heads x "
        f"{m['head_dim']}), FFN {m['ffn_dim']}, {m['parameters']:,} parameters",
        f"- geometry: batch {g['batch']}, latent {g['height']}x{g['width']} = {g['tokens_per_frame']} tokens/frame, "
        f"prompt {g['prompt_tokens']} tokens; sink {g['sink_frames']}, block {g['block_size']}, kv_max "
        f"{g['kv_max_frames']} -> window {g['window_frames']} frames",
        f"- cached block: {g['cached_forwards_per_block']}; naive block: {g['naive_forwards_per_block']}",
        f"- {g['fill_blocks']} blocks to fill the window, 2 warm-up rounds, {g['timed_rounds']} timed rounds "
        "(cached, naive and GEMM interleaved, order rotating)"
        + (
            f"; **stopped early**: {g['requested_rounds']} requested, round budget {g['round_budget_s']:.0f} s spent"
            if g["timed_rounds"] < g["requested_rounds"]
            else ""
        ),
        "",
        "## Time per block",
        "",
        "| path | median | mean | min | max | stdev |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in (("cached (session.step)", cached), ("naive (recompute window)", naive)):
        lines.append(
            f"| {name} | {_ms(s['median_s'])} | {_ms(s['mean_s'])} | {_ms(s['min_s'])} | {_ms(s['max_s'])} "
            f"| {_ms(s['stdev_s'])} |"
        )
    lines += [
        "",
        f"- speedup naive/cached: median {speed['median_ratio']:.2f}x, mean {speed['mean_ratio']:.2f}x, "
        f"median of per-round ratios {speed['paired_median_ratio']:.2f}x, min/min {speed['min_ratio']:.2f}x",
        f"- analytic FLOP ratio naive/cached: {speed['analytic_flop_ratio']:.2f}x",
        f"- target >= {speed['target']:.1f}x (median): **{_verdict(speed['met'])}**",
        "",
        "## FLOPs per block and efficiency",
        "",
        "| component | cached block | naive block |",
        "|---|---|---|",
    ]
    for key in flops["cached_block"]:
        cached_part, naive_part = flops["cached_block"][key], flops["naive_block"][key]
        lines.append(f"| {key} | {_si(cached_part, 'FLOP')} | {_si(naive_part, 'FLOP')} |")
    lines.append("")
    for label, counted, analytic in (
        ("cached", flops["counter_cached_block"], flops["cached_block"]["total"]),
        ("naive", flops["counter_naive_block"], flops["naive_block"]["total"]),
    ):
        if counted.get("available"):
            lines.append(
                f"- FlopCounterMode, {label} block: {_si(counted['total'], 'FLOP')} "
                f"({counted['total'] / analytic:.4f} of analytic; stock table alone "
                f"{_si(counted['stock_table_total'], 'FLOP')})"
            )
        else:
            lines.append(f"- FlopCounterMode, {label} block: unavailable ({counted.get('reason')})")
    lines += [
        f"- GEMM reference: {gemm['size']}^3 {gemm['dtype']} matmul, {gemm['samples']} samples: best "
        f"{_si(gemm['best_flops'], 'FLOP/s')}, median {_si(gemm['median_flops'], 'FLOP/s')}, worst "
        f"{_si(gemm['worst_flops'], 'FLOP/s')}",
        f"- GEMMs at the cached step's own shapes (best of {report['model_shape_gemms']['samples']}): "
        + ", ".join(f"{k} {_si(v, 'FLOP/s')}" for k, v in report["model_shape_gemms"]["best_flops"].items()),
        f"- cached step achieved: {_si(eff['achieved_median_flops'], 'FLOP/s')} at the median block time, "
        f"{_si(eff['achieved_best_flops'], 'FLOP/s')} at the best",
        f"- fraction of GEMM peak: median block / best GEMM {eff['fraction_median_vs_peak']:.1%}; best block / best "
        f"GEMM {eff['fraction_best_vs_peak']:.1%}; median block / median GEMM "
        f"{eff['fraction_median_vs_median_gemm']:.1%}",
        f"- target >= {eff['target']:.0%} (median block / best GEMM): **{_verdict(eff['met'])}**",
        "",
        "## KV cache per session",
        "",
        f"- live cache (sink + history K/V, what a snapshot stores): {cache['live_bytes']:,} B "
        f"({cache['live_bytes'] / 2**20:.2f} MiB), history {cache['history_frames']} frames; formula "
        f"{cache['formula']} = {cache['formula_bytes']:,} B",
        f"- allocated (session.cache_bytes: the window buffers with their block slot and the pre-RoPE sink keys, "
        f"allocated once): {cache['cache_bytes']:,} B ({cache['cache_bytes'] / 2**20:.2f} MiB); formula "
        f"{cache['allocated_formula']} = {cache['allocated_formula_bytes']:,} B",
        f"- both formulas: **{'match' if cache['match'] else 'MISMATCH'}**; distinct storage behind the buffers: "
        f"{cache['storage_bytes']:,} B",
    ]
    service = report.get("service")
    if service is not None and "steady_ratio" in service:
        from bench.service import format_service

        lines += ["", *format_service(service)]
    elif service is not None:
        lines += ["", "## Service path", ""]
        lines += [f"- {key}: {value}" for key, value in service.items()]
    lines += ["", f"(benchmark wall time {report['elapsed_s']:.1f} s)", ""]
    return "\n".join(lines)
