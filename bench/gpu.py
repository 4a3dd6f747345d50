"""``python -m bench gpu OUT``: the figures one GPU loan is for, in one process, within minutes.

Builds the released refiner (diffusers' defaults for ``SanaWMLTX2RefinerTransformer3DModel``: 48 layers, 4096 wide)
from its config alone with random weights, in bfloat16 on the GPU, and measures:

- ``startup``: config -> model on the device -> first block refined (ready), seconds;
- ``blocks``: steady block latency (window full) at 480p (832x480 px -> 15x26 latents: LTX-2 compresses 32x in
  space) and 720p (1280x704 -> 22x40) for 1, 2 and 4 sessions, batched (one model call per step for all) and one
  at a time; device time from CUDA events (``models.clock``);
- ``memory``: sessions of each geometry that fit the memory budget (free after the model, minus the service's
  default ``device_memory_reserve``), each counted at what admission reserves for it
  (``models.session_bytes.session_bytes_estimate`` with the prompt and a block-sized chunk);
- ``realtime``: sessions of each geometry held at 16 fps within ``admission_max_load`` (0.9) of the engine, by
  the measured batched latency (the largest measured count that keeps up, and the per-row estimate past it);
- ``parity``: bfloat16 vs float32 on a 4-layer slice at the real width (same weights);
- ``decode``: streaming VAE decode frames/s at the released VAE's config (``AutoencoderKLLTX2Video`` defaults);
- ``park``: park (device -> exact-size pinned host) and page-in (host -> device, side stream) of a 720p session, ms,
  and the time to page-lock its host buffers (``lock_host_ms``: on a worker thread in the service, not the engine's);
- ``attention``: the kernels that ran the attention (from the profiler);
- ``step_modes``: the engine's step eager, compiled (``models.compiled.CompiledStep``, ``compile_mode: default``)
  and graphed (``compile_mode: reduce-overhead``: CUDA graphs) at 480p for 1 and 4 sessions batched, each mode's
  compile time, and the ``recommended_mode`` those figures give (``section_step_modes``). Last, and bounded by its
  own time cap and the run's end (``--end-s``/``--end-at``), so it never costs another section's figures; its
  figures so far are saved after each mode (graphed before compiled), so a run killed in a compile keeps them.

Every section fails soft: its error goes into ``summary.json`` and the next runs, so one broken figure does not
waste a loan. Every figure is named with its unit (``_s``, ``_ms``, ``_bytes``, ``_fps``, ``_sessions`` ...).
``--smoke`` runs the same code on the CPU with the ``tiny`` preset at toy geometry in well under 2 minutes (wall
time instead of events: ``models.clock`` on the CPU), which is what CI runs (``tests/bench/test_gpu_check.py``).
Writes ``OUT/summary.json`` and ``OUT/summary.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from models import RefinerSession, SessionConfig, from_model, refine_clip
from models.checkpoints import PRESETS, VAE_PRESETS
from models.clock import CallClock
from models.compiled import compiler_problem, failure_reason
from models.loading import resolve_device
from models.move import moved_tensors, move_session, stage_host
from models.plan import meta_model, released_config
from models.session_bytes import session_bytes_estimate
from models.session import Geometry
from models.step import run_batch
from models.transfer import use_device

from .park import _cpu_model

FPS = 16.0
ADMISSION_MAX_LOAD = 0.9  # app.core.settings' default
RESERVE_BYTES = 2 * 1024**3  # app.core.settings' default device_memory_reserve
FULL = {
    "config": None,  # released_config()
    "vae": None,  # AutoencoderKLLTX2Video's defaults
    "geometries": {"480p": (15, 26), "720p": (22, 40)},
    "sessions": (1, 2, 4),
    "blocks": 3,
    "prompt_tokens": 300,
    "decode": {"geometry": (22, 40), "blocks": 3},
    "parity_geometry": (8, 8),
    # Eager vs compiled vs graphed: 480p only, few blocks (each compiled mode compiles buckets 1 and 4 first).
    "step_modes": {"geometry": "480p", "sessions": (1, 4), "blocks": 3, "cap_s": 100.0, "mode_min_s": 45.0,
                   "padding_min_s": 15.0},
}
SMOKE = {
    "config": PRESETS["tiny"],
    "vae": VAE_PRESETS["tiny-vae"],
    "geometries": {"tiny": (4, 4)},
    "sessions": (1, 2),
    "blocks": 2,
    "prompt_tokens": 8,
    "decode": {"geometry": (2, 2), "blocks": 1},
    "parity_geometry": (4, 4),
    # One count (one bucket to compile): the compile is most of the smoke's time on a shared 2-core CPU.
    "step_modes": {"geometry": "tiny", "sessions": (2,), "blocks": 3, "cap_s": 90.0, "mode_min_s": 0.0,
                   "padding_min_s": 0.0},
}


# --- random weights from the config alone ----------------------------------------------------------------------------
def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Fill the (uninitialised) parameters: matrices and modulation tables ~ N(0, 0.02), norm weights 1, biases 0;
    enough for timing and for a bf16-vs-fp32 comparison, which only needs finite, mixing weights."""
    device = next(module.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.ndim >= 2 or "scale_shift_table" in name:
                param.normal_(0.0, 0.02, generator=generator)
            elif name.endswith("weight") or name.endswith("scale"):
                param.fill_(1.0)
            else:
                param.zero_()


def random_refiner(config: dict[str, Any] | None, device: torch.device, dtype: torch.dtype, seed: int = 0,
                   **overrides: Any):
    """The refiner of ``config`` (None: the released one) with random weights, built on ``meta`` and materialised
    on ``device`` in ``dtype`` directly: no float32 copy on the host, no CPU init of 14 B parameters."""
    config = {"_class_name": "SanaWMLTX2RefinerTransformer3DModel", **(config or released_config()), **overrides}
    model = meta_model(config).to_empty(device=device).to(dtype)
    for name, buffer in model.named_buffers():  # none today; a new one would be garbage after to_empty
        raise RuntimeError(f"the refiner has a buffer {name}: random_refiner cannot materialise it from meta")
    _randomize(model, seed)
    return from_model(model, device=str(device), dtype=str(dtype).removeprefix("torch."))


# AutoencoderKLLTX2Video's buffers and the values its constructor gives them (per-channel latent statistics).
VAE_BUFFERS = {"latents_mean": 0.0, "latents_std": 1.0}


def random_vae(config: dict[str, Any] | None, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from diffusers import AutoencoderKLLTX2Video

    with torch.device("meta"):
        vae = AutoencoderKLLTX2Video.from_config(dict(config or {}))
    vae = vae.to_empty(device=device).to(dtype).eval()
    _randomize(vae, seed)
    with torch.no_grad():
        for name, buffer in vae.named_buffers():  # garbage after to_empty: the config's identity normalisation
            if name not in VAE_BUFFERS:
                raise RuntimeError(f"the VAE has a buffer {name}: random_vae does not know its default")
            buffer.fill_(VAE_BUFFERS[name])
    return vae


# --- helpers ----------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(refiner, frames: int, height: int, width: int, prompt_tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, refiner.info.in_channels, frames, height, width, generator=generator)
    embeds = torch.randn(1, prompt_tokens, refiner.info.caption_channels, generator=generator)
    return latents, embeds


def _steady_sessions(refiner, count: int, height: int, width: int, prompt_tokens: int) -> list[RefinerSession]:
    """``count`` sessions whose windows are full (the steady state a block meets in a long stream)."""
    config = SessionConfig()
    fill = config.sink_frames + config.kv_max_frames  # frames that fill the window
    sessions = []
    for index in range(count):
        latents, embeds = _inputs(refiner, fill, height, width, prompt_tokens, index)
        session = RefinerSession(refiner, SessionConfig(seed=index))
        session.push(latents, embeds)
        sessions.append(session)
    return sessions


def run_block(refiner, sessions: list[RefinerSession], batched: bool, clock: CallClock, seed: int,
              step: Callable | None = None) -> float:
    """One block of every session (frames appended, every forward run, committed), as the engine runs it: batched,
    one model call per step for all of them; otherwise one call per session per step. Device seconds (clock).
    ``step``: what runs a model call (``run_batch``, or a ``CompiledStep`` as the engine's runner)."""
    step = step or run_batch
    config = sessions[0].config
    runs = []
    for index, session in enumerate(sessions):
        g = session.state.geometry
        latents, _ = _inputs(refiner, config.block_size, g.height, g.width, 1, seed + index)
        session.append(session.check(latents))
        runs.append(session.start(session.plan()))
    mark = clock.start("block")
    while True:
        forwards = [session.next_forward(run) for session, run in zip(sessions, runs)]
        if all(f is None for f in forwards):
            break
        if batched:
            outs = step(refiner.model, forwards)
        else:
            outs = [step(refiner.model, [forward])[0] for forward in forwards]
        for session, run, out in zip(sessions, runs, outs):
            session.advance(run, out)
    for session, run in zip(sessions, runs):
        session.commit(run)
    clock.stop(mark)
    return clock.wait()[-1][1]


# --- sections ---------------------------------------------------------------------------------------------------------
class Context:
    def __init__(self, preset: dict[str, Any], device: torch.device, dtype: torch.dtype):
        self.preset, self.device, self.dtype = preset, device, dtype
        self.refiner = None
        self.started = time.perf_counter()
        self.budget_s = float("inf")  # past it, the blocks section skips what is left (recorded as null)
        self.end_s = float("inf")  # the run ends by then (seconds from its start): step_modes stops short of it
        self.blocks: dict[str, dict[str, float]] = {}
        self.parked_session: RefinerSession | None = None
        # Writes a section's figures so far (``run`` points it at summary.json): a long section saves as it goes,
        # so a run killed in its middle (the loan's end, a compiler crash) keeps what it had measured.
        self.save: Callable[[str, dict[str, Any]], None] = lambda name, figures: None


def section_startup(ctx: Context) -> dict[str, Any]:
    started = time.perf_counter()
    ctx.refiner = random_refiner(ctx.preset["config"], ctx.device, ctx.dtype)
    _sync(ctx.device)
    built = time.perf_counter() - started
    height, width = next(iter(ctx.preset["geometries"].values()))
    latents, embeds = _inputs(ctx.refiner, 1 + SessionConfig().block_size, height, width, ctx.preset["prompt_tokens"], 0)
    RefinerSession(ctx.refiner, SessionConfig()).push(latents, embeds)  # sink + one block: the first forwards
    _sync(ctx.device)
    info = ctx.refiner.info
    return {"build_s": built, "ready_s": time.perf_counter() - started, "parameters_count": info.parameters,
            "num_layers_count": info.num_layers, "inner_dim_count": info.inner_dim,
            "weights_bytes": sum(p.nbytes for p in ctx.refiner.model.parameters())}


def _block_key(batched: bool, count: int) -> str:
    """The name of a block latency figure: ``batched_4_sessions_block_s``, ``solo_1_sessions_block_s``."""
    return f"{'batched' if batched else 'solo'}_{count}_sessions_block_s"


def section_blocks(ctx: Context) -> dict[str, Any]:
    """Per geometry: steady block latency for 1, 2, 4 sessions, batched and one at a time (each the median of
    ``blocks`` blocks after one unmeasured)."""
    out: dict[str, Any] = {}
    clock = CallClock(ctx.device)
    counts = ctx.preset["sessions"]
    for name, (height, width) in ctx.preset["geometries"].items():
        if time.perf_counter() - ctx.started > ctx.budget_s:
            # Over the time budget before this geometry: no sessions filled for nothing (a 720p fill is seconds).
            out[name] = ctx.blocks[name] = {_block_key(b, n): None for n in counts for b in (True, False)} | {
                "tokens_per_frame_count": height * width, "latent_height_width": f"{height}x{width}"}
            continue
        sessions = _steady_sessions(ctx.refiner, max(counts), height, width, ctx.preset["prompt_tokens"])
        figures: dict[str, float] = {}
        for count in counts:
            for batched in (True, False):
                key = _block_key(batched, count)
                if time.perf_counter() - ctx.started > ctx.budget_s:
                    figures[key] = None  # over the time budget: a loan ends on time with what it has
                    continue
                run_block(ctx.refiner, sessions[:count], batched, clock, 100)  # unmeasured: allocator, kernels
                times = sorted(run_block(ctx.refiner, sessions[:count], batched, clock, 200 + i)
                               for i in range(ctx.preset["blocks"]))
                figures[key] = times[len(times) // 2]
        figures["tokens_per_frame_count"] = height * width
        figures["latent_height_width"] = f"{height}x{width}"
        ctx.blocks[name] = figures
        out[name] = figures
        if name == list(ctx.preset["geometries"])[-1]:
            ctx.parked_session = sessions[0]
        del sessions
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def section_memory(ctx: Context) -> dict[str, Any]:
    info = ctx.refiner.info
    out: dict[str, Any] = {}
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # the start-up block's cached activations are not the sessions'
        free, total = torch.cuda.mem_get_info(ctx.device)
        out.update(device_free_bytes=free, device_total_bytes=total, reserve_bytes=RESERVE_BYTES)
        budget = max(0, free - RESERVE_BYTES)
    else:
        budget = None  # no device budget on a CPU (the service's auto budget is CUDA-only)
    out["budget_bytes"] = budget
    config = SessionConfig()
    for name, (height, width) in ctx.preset["geometries"].items():
        # What admission reserves for such a session (``app.sessions.parking.Parking.estimate``): its window, its
        # prompt's embeds and K/V, and a block-sized chunk's pending frames and rollback copies (2 GB at 720p),
        # not the window alone, which would overstate the sessions that fit by a fifth.
        need = sum(session_bytes_estimate(info.num_layers, info.inner_dim, config,
                                          Geometry(1, info.in_channels, height, width), ctx.dtype,
                                          prompt_tokens=ctx.preset["prompt_tokens"],
                                          caption_channels=info.caption_channels,
                                          chunk_frames=config.block_size).values())
        out[f"{name}_session_bytes"] = need
        out[f"{name}_sessions_in_budget_sessions"] = None if budget is None else budget // need
    return out


def section_realtime(ctx: Context) -> dict[str, Any]:
    """Sessions held at 16 fps: a block of ``block_size`` latent frames plays for block_size * 8 / 16 s; a count
    keeps up when its batched block takes at most admission_max_load of that."""
    config = SessionConfig()
    temporal = int((ctx.refiner.model.config.get("vae_scale_factors") or (8, 32, 32))[0])
    block_seconds = config.block_size * temporal / FPS
    out: dict[str, Any] = {"block_playback_s": block_seconds, "fps": FPS, "admission_max_load_ratio": ADMISSION_MAX_LOAD}
    for name, figures in ctx.blocks.items():
        counts = sorted(int(key.split("_")[1]) for key, value in figures.items()
                        if key.startswith("batched_") and value is not None)
        if not counts:
            continue  # every latency of this geometry was skipped (time budget)
        kept = [n for n in counts if figures[f"batched_{n}_sessions_block_s"] <= ADMISSION_MAX_LOAD * block_seconds]
        out[f"{name}_measured_sessions"] = max(kept, default=0)
        largest = counts[-1]
        per_session = figures[f"batched_{largest}_sessions_block_s"] / largest
        out[f"{name}_estimated_sessions"] = int(ADMISSION_MAX_LOAD * block_seconds // per_session)
    return out


def section_parity(ctx: Context) -> dict[str, Any]:
    """bf16 vs fp32 on a 4-layer slice at the real width (``--smoke``: the tiny preset's, on the CPU): the same random
    weights (bf16's, widened) and the same noise (bf16's, widened: ``RefinerSession.noise_dtype``; from one seed a
    CPU draws other bf16 than fp32 values, which on torch 2.11 made this figure 1.27), so only the arithmetic
    differs."""
    low = random_refiner(ctx.preset["config"], ctx.device, torch.bfloat16, seed=1, num_layers=4)
    high = random_refiner(ctx.preset["config"], ctx.device, torch.float32, seed=1, num_layers=4)
    with torch.no_grad():
        for a, b in zip(high.model.parameters(), low.model.parameters()):
            a.copy_(b.float())  # the bf16 weights exactly, widened: only the arithmetic differs
    height, width = ctx.preset["parity_geometry"]
    latents, embeds = _inputs(high, 1 + 2 * SessionConfig().block_size, height, width, ctx.preset["prompt_tokens"], 3)
    want = refine_clip(high, latents, embeds, noise_dtype=torch.bfloat16).float().cpu()  # bf16's noise, widened
    got = refine_clip(low, latents, embeds).float().cpu()
    del low, high
    diff = got - want
    return {"compared": "bfloat16 vs float32", "max_abs": diff.abs().max().item(),
            "relative_rms_ratio": (diff.norm() / want.norm()).item(), "reference_rms": want.pow(2).mean().sqrt().item()}


def section_decode(ctx: Context) -> dict[str, Any]:
    from models.vae import StreamingDecoder

    vae = random_vae(ctx.preset["vae"], ctx.device, ctx.dtype)
    decoder = StreamingDecoder(vae)
    height, width = ctx.preset["decode"]["geometry"]
    block = SessionConfig().block_size
    state = decoder.new_state()
    generator = torch.Generator().manual_seed(5)

    def push(state):
        latents = torch.randn(1, decoder.info.latent_channels, block, height, width, generator=generator)
        return decoder.push(state, latents.to(ctx.device, ctx.dtype))

    for _ in range(-(-decoder.lookahead // block) + 1):  # its look-ahead filled: each later block yields all its frames
        state, _ = push(state)
    _sync(ctx.device)
    frames, started = 0, time.perf_counter()
    for _ in range(ctx.preset["decode"]["blocks"]):
        state, out = push(state)
        frames += 0 if out is None else out.shape[2]
    _sync(ctx.device)
    seconds = time.perf_counter() - started
    return {"latent_height_width": f"{height}x{width}", "pixel_frames_count": frames, "seconds_s": seconds,
            "frames_per_second_fps": frames / seconds, "lookahead_latent_frames_count": decoder.lookahead}


def section_park(ctx: Context) -> dict[str, Any]:
    session = ctx.parked_session
    if session is None:  # the blocks' budget ran out before the last geometry (or that section failed): one here
        height, width = list(ctx.preset["geometries"].values())[-1]
        session = _steady_sessions(ctx.refiner, 1, height, width, ctx.preset["prompt_tokens"])[0]
    # What the park and the page-in copy (``models.move.moved_tensors``): not the prepared prompt K/V that
    # ``session_bytes`` also counts, which ``move_session`` drops (recomputed from the prompt after the page-in).
    moved = sum(tensor.nbytes for tensor in moved_tensors(session))
    stats = getattr(torch.cuda, "host_memory_stats", None) if ctx.device.type == "cuda" else None
    before = stats() if stats else {}
    _sync(ctx.device)
    started = time.perf_counter()  # the service locks the host buffers on a worker thread first (stage_host)
    host = stage_host(session, torch.device("cpu"))
    lock_host_ms = 1000 * (time.perf_counter() - started)
    started = time.perf_counter()
    ready = move_session(session, torch.device("cpu"), host=host)
    if ready is not None:
        ready.synchronize()
    park_ms = 1000 * (time.perf_counter() - started)
    after = stats() if stats else {}
    started = time.perf_counter()
    ready = move_session(session, ctx.device, after=ready)
    if ready is not None:
        ready.synchronize()
    page_in_ms = 1000 * (time.perf_counter() - started)
    out = {"session_bytes": moved, "lock_host_ms": lock_host_ms, "park_ms": park_ms, "page_in_ms": page_in_ms,
           "park_gb_per_second_ratio": moved / park_ms / 1e6, "page_in_gb_per_second_ratio": moved / page_in_ms / 1e6}
    if stats:  # what the caching host allocator grew by: ~0 with exact-size pinned buffers
        key = "allocated_bytes.current"
        out["host_allocator_growth_bytes"] = after.get(key, 0) - before.get(key, 0)
    return out


ATTENTION_WORDS = ("flash", "fmha", "attention", "sdpa", "cudnn_", "efficient", "softmax")


def section_attention(ctx: Context) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    height, width = next(iter(ctx.preset["geometries"].values()))
    session = _steady_sessions(ctx.refiner, 1, height, width, ctx.preset["prompt_tokens"])[0]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_block(ctx.refiner, [session], True, CallClock(ctx.device), 7)
    names = sorted({event.key for event in prof.key_averages()
                    if any(word in event.key.lower() for word in ATTENTION_WORDS)})
    ops = [n for n in names if n.startswith("aten::")]
    kernels = [n for n in names if not n.startswith("aten::")]
    return {"ops": ops, "kernels": kernels, "flash_ran": flash_ran(ops)}


def flash_ran(ops: list[str]) -> bool:
    """Whether SDPA's flash backend ran, from the profiler's aten op names (``_scaled_dot_product_flash_attention``,
    ``_for_cpu`` on a CPU). Not from kernel names: the memory-efficient backend's CUDA kernels are named
    ``fmha_cutlassF_...`` and cuDNN's ``..._sdpa_..._flash_fprop_...``, so "fmha" or "flash" in a kernel's name does
    not say the flash backend ran."""
    return any(op.startswith("aten::_scaled_dot_product_flash_attention") for op in ops)


# --- eager, compiled, graphed ------------------------------------------------------------------------------------
STEP_MODES = {  # the section's name for a mode -> the settings that select it (app.core.settings)
    "eager": {"compile_step": False},
    "compiled": {"compile_step": True, "compile_mode": "default"},
    "graphed": {"compile_step": True, "compile_mode": "reduce-overhead"},
}
# The order the section measures them in: graphed before compiled, since the loan's end or the section's cap cuts
# the last one short and graphed is the figure the section is for (``recommend`` compares whatever was measured).
MEASURE_ORDER = ("eager", "graphed", "compiled")
MODE_MARGIN = 0.05  # a mode must beat the simpler one by 5% at every measured count to be recommended


def recommend(figures: dict[str, dict[str, Any]], counts, margin: float = MODE_MARGIN) -> str:
    """The mode the setting should follow: start from eager and step up (compiled, then graphed) only where the
    next mode's steady block is at least ``margin`` faster than the one recommended so far at every session count
    measured. Each step adds start-up compile time and ways to fail, so a tie goes to the simpler mode; a mode with
    a count missing (skipped, failed) is never recommended."""
    def times(mode):
        values = [figures.get(mode, {}).get(f"batched_{n}_sessions_block_s") for n in counts]
        return None if any(v is None for v in values) else values

    best, best_times = "eager", times("eager")
    if best_times is None:
        return "eager"  # nothing to compare against
    for mode in ("compiled", "graphed"):
        candidate = times(mode)
        if candidate is not None and all(c * (1 + margin) <= b for c, b in zip(candidate, best_times)):
            best, best_times = mode, candidate
    return best


def _measure_mode(ctx: Context, sessions: list[RefinerSession], mode: str, counts, blocks: int) -> dict[str, Any]:
    """One mode's figures: for each count, a first block (wall time: it compiles, for a compiled mode) then the
    median of ``blocks`` steady blocks (device time). ``compile_s``: the first blocks' wall time less their steady
    figures, i.e. what compiling cost over a warm block (eager: allocator and kernel warm-up only)."""
    from torch._dynamo.utils import counters

    from models.compiled import CompiledStep

    step = None
    if mode != "eager":
        torch._dynamo.reset()  # each mode compiles from nothing: its compile time is its own
        step = CompiledStep(ctx.refiner.model, max(counts), mode=STEP_MODES[mode]["compile_mode"])
    graphs_before = counters["stats"]["unique_graphs"]
    clock = CallClock(ctx.device)
    out: dict[str, Any] = {}
    first_s = compile_s = 0.0
    for count in counts:
        _sync(ctx.device)
        started = time.perf_counter()
        run_block(ctx.refiner, sessions[:count], True, clock, 300, step)
        _sync(ctx.device)
        first = time.perf_counter() - started
        times = sorted(run_block(ctx.refiner, sessions[:count], True, clock, 400 + i, step) for i in range(blocks))
        steady = times[len(times) // 2]
        out[f"batched_{count}_sessions_block_s"] = steady
        first_s += first
        compile_s += max(0.0, first - steady)
    out.update(first_blocks_s=first_s, compile_s=compile_s,
               graphs_compiled_count=counters["stats"]["unique_graphs"] - graphs_before)
    return out


def measure_padding(ctx: Context, sessions: list[RefinerSession], blocks: int) -> dict[str, Any]:
    """What padding a call costs (``compile_buckets``: ``every`` never pads, ``powers`` runs 3 rows as 4): the eager
    step at one row fewer than the section's largest count, exact and padded with zero rows to that count, each the
    median of ``blocks`` blocks after one unmeasured. A padded row costs its per-token work (projections, norms,
    modulation, the feed-forward: GEMMs with one more row's tokens), not attention (the attention functions run the
    sessions' rows only). Eager, because eager compiles nothing; the ratio is a lower bound for the compiled modes
    (the same extra GEMM work over a shorter block, launches saved). ``recommended_compile_buckets``: ``every`` when
    padding costs at least ``MODE_MARGIN`` even so (every block pays it, against one more compile per batch size once
    per start), else ``powers``."""
    padded_to = len(sessions)
    rows = padded_to - 1
    out: dict[str, Any] = {"rows_count": rows, "padded_to_count": padded_to}
    if rows < 1:
        return out | {"recommended_compile_buckets": None}
    clock = CallClock(ctx.device)
    for name, step in (("exact", run_batch), ("padded", lambda model, forwards: run_batch(model, forwards,
                                                                                         pad_to=padded_to))):
        run_block(ctx.refiner, sessions[:rows], True, clock, 500, step)
        times = sorted(run_block(ctx.refiner, sessions[:rows], True, clock, 600 + i, step) for i in range(blocks))
        out[f"{name}_block_s"] = times[len(times) // 2]
    out["padded_over_exact_ratio"] = out["padded_block_s"] / out["exact_block_s"]
    out["recommended_compile_buckets"] = "every" if out["padded_over_exact_ratio"] >= 1 + MODE_MARGIN else "powers"
    return out


def section_step_modes(ctx: Context) -> dict[str, Any]:
    """Eager vs compiled vs graphed (issue 22 item 4: CUDA graphs pay only where a step is launch-bound, so the
    default follows a measurement): steady block latency at 480p for 1 and 4 sessions batched with the engine's
    step in each mode, each mode's compile time, and ``recommended_mode`` (``recommend``) with the settings it maps
    to; then, if the run's end leaves time, what padding 3 rows to 4 costs (``padding``: ``measure_padding``, the
    ``compile_buckets`` choice).
    Decision for the CPU (``--smoke``): graphed is skipped with its reason recorded, not run as a plain compile
    under another name: CUDA graphs need a CUDA device, and on a CPU ``reduce-overhead`` compiles exactly what
    ``compiled`` does, so a figure for it would only measure noise. A mode that fails is recorded in ``errors`` and
    the others run; a mode not started by the section's time cap or the run's end is skipped (null), and so are the
    compiled modes where the compiler cannot run (``compiler_problem``: on CUDA, a triton that does not import)."""
    spec = ctx.preset["step_modes"]
    counts = tuple(spec["sessions"])
    height, width = ctx.preset["geometries"][spec["geometry"]]
    deadline = min(time.perf_counter() + spec["cap_s"], ctx.started + ctx.end_s)
    sessions = _steady_sessions(ctx.refiner, max(counts), height, width, ctx.preset["prompt_tokens"])
    out: dict[str, Any] = {"geometry": spec["geometry"], "latent_height_width": f"{height}x{width}",
                           "margin_ratio": MODE_MARGIN}
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    unavailable = compiler_problem(ctx.device)
    try:
        for mode in MEASURE_ORDER:
            ctx.save("step_modes", _conclude(dict(out), counts, skipped, errors, partial=True))
            left = deadline - time.perf_counter()
            if mode == "graphed" and ctx.device.type != "cuda":
                skipped[mode] = "CUDA graphs need a CUDA device (on a CPU reduce-overhead compiles as compiled does)"
            elif mode != "eager" and unavailable:
                skipped[mode] = unavailable
            elif mode != "eager" and left < spec["mode_min_s"]:
                skipped[mode] = (f"time: {left:.0f} s left of the section's cap, under the "
                                 f"{spec['mode_min_s']:.0f} s a mode needs")
            if mode in skipped:
                out[mode] = {f"batched_{n}_sessions_block_s": None for n in counts} | {"compile_s": None}
                continue
            try:
                out[mode] = _measure_mode(ctx, sessions, mode, counts, spec["blocks"])
            except Exception as exc:  # fail soft per mode: one broken mode keeps the others' figures
                # A failed compile in the one line the service logs and /v1/info shows (the compiler's own words);
                # a traceback only for anything else (a bug here, out of memory), where the stack says more.
                errors[mode] = failure_reason(exc)
                if not isinstance(exc, torch._dynamo.exc.TorchDynamoException):
                    traceback.print_exc()
                out[mode] = {f"batched_{n}_sessions_block_s": None for n in counts} | {"compile_s": None}
        # After the modes (graphed is the figure this section is for), within the run's end: eager, a few blocks.
        ctx.save("step_modes", _conclude(dict(out), counts, skipped, errors, partial=True))
        out["padding"] = None
        left = ctx.started + ctx.end_s - time.perf_counter()
        if left < spec["padding_min_s"]:
            skipped["padding"] = f"time: {left:.0f} s left of the run, under the {spec['padding_min_s']:.0f} s it needs"
        else:
            try:
                out["padding"] = measure_padding(ctx, sessions, spec["blocks"])
            except Exception as exc:  # fail soft: the modes' figures stand
                errors["padding"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
    finally:
        torch._dynamo.reset()  # later work in this process runs eagerly, as before the section
        del sessions
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return _conclude(out, counts, skipped, errors)


def _conclude(out: dict[str, Any], counts, skipped: dict[str, str], errors: dict[str, str],
              partial: bool = False) -> dict[str, Any]:
    """``section_step_modes``' figures with the speed-ups over eager and the recommendation, from the modes
    measured so far (``partial``: saved while the section still runs; the modes not reached are absent)."""
    eager = out.get("eager", {})
    for mode in ("compiled", "graphed"):
        if mode not in out:
            continue
        out[mode] = dict(out[mode])
        for n in counts:
            value, base = out[mode][f"batched_{n}_sessions_block_s"], eager.get(f"batched_{n}_sessions_block_s")
            out[mode][f"speedup_{n}_sessions_ratio"] = None if value is None or base is None else base / value
    out["recommended_mode"] = recommend(out, counts)
    out["recommended_settings"] = dict(STEP_MODES[out["recommended_mode"]])
    if out["recommended_settings"]["compile_step"] and (out.get("padding") or {}).get("recommended_compile_buckets"):
        out["recommended_settings"]["compile_buckets"] = out["padding"]["recommended_compile_buckets"]
    out["skipped"] = [f"{mode}: {why}" for mode, why in skipped.items()]
    out["mode_errors"] = [f"{mode}: {why}" for mode, why in errors.items()]
    if partial:
        out["partial"] = "the section was still running when this was written: the modes missing were not reached"
    return out


SECTIONS: list[tuple[str, Callable[[Context], dict[str, Any]]]] = [
    ("startup", section_startup),
    ("memory", section_memory),  # before the blocks' sessions: free memory with the weights alone
    ("blocks", section_blocks),
    ("realtime", section_realtime),
    ("parity", section_parity),
    ("decode", section_decode),
    ("park", section_park),
    ("attention", section_attention),
    ("step_modes", section_step_modes),  # last: it compiles, and stops short of the run's end (--end-at)
]


def machine(device: torch.device) -> dict[str, Any]:
    import diffusers

    out = {"torch": torch.__version__, "diffusers": diffusers.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "cpu": _cpu_model(), "device": str(device), "triton": _triton()}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return out


def _triton() -> str:
    """triton's version, or why it does not import (what compiled modes on CUDA need: ``compiler_problem``)."""
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 -- reported, not raised: only the compiled modes need it
        return f"does not import ({type(exc).__name__}: {exc})"
    return str(getattr(triton, "__version__", "unknown version"))


def section_names(only: str | None = None, skip: str | None = None) -> list[str]:
    """The sections a run measures, in ``SECTIONS``' order: ``only`` (comma-separated names; default every one)
    less ``skip``. ``startup`` is always first: every other section measures the model it builds."""
    names = [name for name, _ in SECTIONS]

    def listed(text: str | None) -> set[str]:
        return {n.strip() for n in (text or "").split(",") if n.strip()}

    unknown = sorted((listed(only) | listed(skip)) - set(names))
    if unknown:
        raise SystemExit(f"unknown section {', '.join(unknown)}: the sections are {', '.join(names)}")
    return ["startup"] + [n for n in names if n != "startup" and (only is None or n in listed(only))
                          and n not in listed(skip)]


def run(out_dir: Path, smoke: bool, device: str | None = None, budget_s: float = 360.0,
        end_s: float = float("inf"), end_at: float | None = None,
        sections: list[str] | None = None) -> dict[str, Any]:
    """``end_s``: seconds from here by which the run ends; ``end_at``: the same as a Unix time (what a caller that
    started its clock before this process, and its imports, passes: ``gpu_check.sh``), the earlier of the two.
    ``sections``: the names to measure (``section_names``; default all). A run of some sections adds them to the
    ``summary.json`` already in ``out_dir`` (``gpu_check.sh`` runs the compiling section in a process of its own:
    a compiler crash or overrun there costs no other figure); its own start-up figures go in only where the file
    has none."""
    preset = SMOKE if smoke else FULL
    device = torch.device(device or ("cpu" if smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU check")
    device = resolve_device(device)  # cuda -> cuda:N, as the service resolves it
    use_device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    ctx = Context(preset, device, dtype)
    if end_at is not None:
        end_s = min(end_s, end_at - time.time())
    ctx.budget_s, ctx.end_s = budget_s, end_s
    names = section_names() if sections is None else sections
    summary: dict[str, Any] = {"mode": "smoke" if smoke else "full", "dtype": str(dtype).removeprefix("torch."),
                               "machine": machine(device), "sections": {}, "errors": {}, "seconds": {}}
    earlier = out_dir / "summary.json"
    if sections is not None and earlier.is_file():
        summary = json.loads(earlier.read_text())  # an earlier process's sections: this run adds its own
    again = "startup" in summary["sections"] or "startup" in summary["errors"]  # a later process of one check
    total_key = "total_again_s" if again else "total_s"

    def save(name: str, figures: dict[str, Any]) -> None:
        summary["sections"][name] = figures
        _write(out_dir, summary)

    ctx.save = save
    summary["ran"] = []  # the section keys this run measured (``failed``), the file's earlier ones aside
    total = time.perf_counter()
    with torch.no_grad():
        for name, section in SECTIONS:
            if name not in names:
                continue
            # Start-up again in a later process: recorded apart (its seconds, any error), the first one's figures
            # stand. Any other section asked for again replaces what the file had of it.
            key = "startup_again" if name == "startup" and again else name
            summary["ran"].append(key)
            started = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                figures = section(ctx)
                if key == name:
                    summary["sections"][name] = figures
                summary["errors"].pop(key, None)  # an earlier run's error of it, if any, is over
            except Exception as exc:  # fail soft: record and go on (a loan is too short to rerun for one figure)
                summary["errors"][key] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            summary["seconds"][f"{key}_s"] = time.perf_counter() - started
            print(json.dumps({name: summary["sections"].get(name, summary["errors"].get(key))}, default=str),
                  flush=True)
            summary["seconds"][total_key] = time.perf_counter() - total
            _write(out_dir, summary)  # after every section: a run stopped by the loan's end keeps what it measured
    return summary


def _write(out_dir: Path, summary: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out_dir / "summary.md").write_text(render(summary))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table: section, figure (named with its unit), value."""
    m = summary["machine"]
    lines = [f"# GPU check ({summary['mode']}, {summary['dtype']})", "",
             f"{m.get('gpu', m['device'])}, torch {m['torch']} (CUDA {m['cuda']}), triton {m.get('triton')}, "
             f"diffusers {m['diffusers']}, CPU {m['cpu']}", "", "| section | figure | value |", "|---|---|---|"]
    for section, figures in summary["sections"].items():
        for key, value in _flatten(figures):
            lines.append(f"| {section} | {key} | {_cell(value)} |")
    for section, error in summary["errors"].items():
        lines.append(f"| {section} | error | {error.replace('|', '/')[:300]} |")
    for key, value in summary["seconds"].items():
        lines.append(f"| time | {key} | {_cell(value)} |")
    return "\n".join(lines) + "\n"


def _flatten(figures: dict[str, Any], prefix: str = ""):
    for key, value in figures.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for summary.json and summary.md")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU (CI; under 2 minutes)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="seconds after which the block latencies left are skipped (null), so the check ends in time")
    parser.add_argument("--end-s", type=float, default=float("inf"),
                        help="seconds from the start by which the run must end: step_modes starts no mode it cannot "
                             "finish by then (skipped, with the reason)")
    parser.add_argument("--end-at", type=float, default=None,
                        help="the same as a Unix time (a caller's clock, started before this process's imports)")
    parser.add_argument("--only", default=None, metavar="NAMES",
                        help="comma-separated sections to measure (startup always runs first), added to OUT's "
                             "summary.json when it has one: " + ", ".join(name for name, _ in SECTIONS))
    parser.add_argument("--skip", default=None, metavar="NAMES", help="comma-separated sections not to measure")
    args = parser.parse_args(argv)
    summary = run(args.out, args.smoke, args.device, args.budget_s, args.end_s, args.end_at,
                  None if args.only is None and args.skip is None else section_names(args.only, args.skip))
    print((args.out / "summary.md").read_text())
    return 1 if failed(summary) else 0


def failed(summary: dict[str, Any]) -> list[str]:
    """What failed in the run that wrote ``summary`` last: the sections it measured that raised, and the step modes
    that failed (``step_modes.mode_errors``: the section fails soft per mode, so a mode that crashed is no section
    error). Not an earlier process's errors that the summary carries (``gpu_check.sh``'s second process adds to the
    first's file): that process has reported them with its own exit status."""
    ran = summary.get("ran", list(summary["errors"]))
    out = [f"{key}: {summary['errors'][key]}" for key in ran if key in summary["errors"]]
    if "step_modes" in ran:
        out += [f"step_modes.{error}" for error in summary["sections"].get("step_modes", {}).get("mode_errors", [])]
    return out
