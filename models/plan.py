"""A capacity plan for a refiner on hardware this process does not have: bytes and FLOPs, nothing run.

The refiner is built from its ``config.json`` on the ``meta`` device (shapes, no storage), so the plan for the released
48-layer refiner costs a second and no memory. From it and a stream's geometry the plan derives:

- **weights**: every parameter ``load_refiner`` loads (the video path: the audio branch, which diffusers keeps so
  checkpoints round-trip, is never read; ``checkpoint_parameters`` says what the files hold) at the serving dtype;
- **per session**: the KV window as ``models.kv.SessionKV`` allocates it, plus the prepared prompt (each layer's
  cross-attention K/V, once per prompt), from the estimate admission reserves by
  (``models.session_bytes.session_bytes_estimate``; tests/models/test_plan.py checks it against a real session);
- **FLOPs** of one forward and of one steady-state block, counted from the modules' shapes (2 per multiply-add;
  elementwise work -- norms, RoPE, softmax, GELU, modulation -- left out as GEMM counts do), split into
  projections, attention and feed-forward;
- **sessions per GPU** by memory (what is left after the weights and a workspace) and by compute at the stream's
  real-time rate (``block FLOPs / block playback seconds`` against a sustained TFLOP/s the caller states).

Latent geometry comes from the transformer config's ``vae_scale_factors`` (temporal, height, width: (8, 32, 32)
for LTX-2): a latent frame is ``temporal`` pixel frames, ``pixels / spatial`` latents per side, one token per latent
(patch size 1, which ``models.loading.check_config`` requires). A steady block of ``block_size`` latent frames plays
for ``block_size * temporal / fps`` seconds (``fps`` counts pixel frames, as the session's ``fps`` does).

What the service does per forward (``models.step``) is what is counted: the timestep embedding once per row (not
per token), the prompt's caption projection and every layer's cross-attention K/V once per prompt (reported
apart).

Plain arithmetic and torch's ``meta`` device: no web code, no weights, no device memory. Reading the command line
and printing the plan are the app's (``app/cli/plan_command.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import SessionConfig
from .errors import InvalidConfigError, ModelLoadError
from .loading import SUPPORTED_CLASSES, pipeline_hint, read_config_file
from .session import Geometry
from .session_bytes import session_bytes_estimate

GiB = 1024**3
GB = 1000**3
# diffusers' default for the class (LTX-2's latent channels), for a config.json that does not state it.
DEFAULT_IN_CHANNELS = 128


# --- the model, without weights -----------------------------------------------------------------------------------
def read_config(path: str | Path) -> dict[str, Any]:
    """A refiner's ``config.json`` (a model folder or the file itself), checked as ``load_refiner`` checks it."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{str(file)!r} does not exist; pass a refiner folder (with config.json) or its "
                             f"config.json{pipeline_hint(file.parent, SUPPORTED_CLASSES)}")
    return read_config_file(file)


def released_config() -> dict[str, Any]:
    """The released SANA-WM refiner's architecture: diffusers' defaults for the class, which are LTX-2's video
    transformer (48 layers, 32 x 128 heads, caption 3840, cross-attention 4096). Used when no config.json is at hand."""
    return {"_class_name": "SanaWMLTX2RefinerTransformer3DModel"}


def meta_model(config: dict[str, Any], video_only: bool = True):
    """The refiner with every tensor on the ``meta`` device: its modules and shapes, no storage. ``video_only``: as
    ``load_refiner`` holds it (``models.loading.keep_video_path``); otherwise every module the checkpoint has."""
    from diffusers import SanaWMLTX2RefinerTransformer3DModel

    from .loading import build_video_model

    if video_only:
        return build_video_model(config, "config")
    arguments = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        return SanaWMLTX2RefinerTransformer3DModel.from_config(arguments)


# --- the stream --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stream:
    """What one session asks for. ``height``/``width`` are pixels; ``fps`` pixel frames per second."""

    height: int = 704
    width: int = 1280
    fps: float = 16.0
    sink_frames: int = 1
    block_size: int = 3
    kv_max_frames: int = 11
    steps: int = 3  # denoising forwards per block (len(sigmas) - 1); one commit forward follows
    batch: int = 1
    prompt_tokens: int = 300
    positions: str = "absolute"

    def __post_init__(self) -> None:
        problems = []
        if self.height < 1 or self.width < 1:
            problems.append(f"height and width must be positive pixels, got {self.height}x{self.width}")
        if self.fps <= 0:
            problems.append(f"fps must be positive, got {self.fps}")
        if self.sink_frames < 1 or self.block_size < 1 or self.steps < 1 or self.batch < 1 or self.prompt_tokens < 1:
            problems.append("sink_frames, block_size, steps, batch and prompt_tokens must be at least 1")
        if self.kv_max_frames < self.sink_frames + self.block_size:
            problems.append(f"kv_max_frames ({self.kv_max_frames}) must be at least sink_frames + block_size "
                            f"({self.sink_frames + self.block_size})")
        if self.positions not in ("absolute", "rebased"):
            problems.append(f"positions must be 'absolute' or 'rebased', got {self.positions!r}")
        if problems:
            raise InvalidConfigError("; ".join(problems))

    def session_config(self) -> SessionConfig:
        """The session config this stream's sessions have (what the bytes estimate reads)."""
        return SessionConfig(sink_frames=self.sink_frames, block_size=self.block_size,
                             kv_max_frames=self.kv_max_frames, positions=self.positions)


def vae_scale_factors(config: dict[str, Any]) -> tuple[int, int, int]:
    """(temporal, height, width): pixel frames per latent frame and pixels per latent along each side."""
    temporal, down_h, down_w = (int(v) for v in config.get("vae_scale_factors", (8, 32, 32)))
    return temporal, down_h, down_w


def latent_geometry(config: dict[str, Any], stream: Stream) -> Geometry:
    """The session's latent frames (``models.session.Geometry``: batch, channels, height, width) for ``stream``'s
    pixels; InvalidConfigError naming a size the VAE cannot compress."""
    _, down_h, down_w = vae_scale_factors(config)
    if stream.height % down_h or stream.width % down_w:
        raise InvalidConfigError(
            f"{stream.width}x{stream.height} pixels is not a multiple of the VAE's {down_w}x{down_h} compression; "
            f"use e.g. {stream.width // down_w * down_w}x{stream.height // down_h * down_h}"
        )
    channels = int(config.get("in_channels", DEFAULT_IN_CHANNELS))
    return Geometry(stream.batch, channels, stream.height // down_h, stream.width // down_w)


# --- bytes ---------------------------------------------------------------------------------------------------------
def session_bytes(model, stream: Stream, geometry: Geometry, dtype: torch.dtype) -> dict[str, int]:
    """What one session holds on the device once its window is allocated, from the one estimator admission uses
    (``models.session_bytes.session_bytes_estimate``): the KV window as ``SessionKV`` allocates it (window with its
    block slot, the sink's pre-RoPE keys, with rebased positions the history's too), and the prepared prompt
    cross-attention reads: every layer's K and V of the prompt (Y, 2, B, L, D), computed once per prompt
    (``models.step.prepare_prompt``). The plan leaves out what admission adds for safety (pending frames, a chunk's
    rollback copies) and the prompt's (B, L, caption) embeds: it reports the steady state."""
    inner = int(model.config.num_attention_heads * model.config.attention_head_dim)
    config = stream.session_config()
    estimate = session_bytes_estimate(len(model.transformer_blocks), inner, config, geometry, dtype,
                                      prompt_tokens=stream.prompt_tokens)  # caption_channels 0: the K/V alone
    parts = {
        "kv_window": estimate["kv_window"],
        "kv_sink_keys": estimate["kv_sink"],
        "kv_rebased_history_keys": estimate["kv_history_keys"],
        "prompt": estimate["prompt"],
    }
    parts["kv_total"] = parts["kv_window"] + parts["kv_sink_keys"] + parts["kv_rebased_history_keys"]
    parts["total"] = parts["kv_total"] + parts["prompt"]
    return parts


def decoder_state_bytes(vae_config: dict[str, Any], stream: Stream, latent_hw: tuple[int, int],
                        dtype: torch.dtype) -> dict[str, int]:
    """A video session's streaming-decoder state (``models.vae``), measured by streaming blocks through the VAE's
    decoder built on ``meta`` (shapes only): the largest state over the look-ahead plus four blocks, and the VAE's
    own weights."""
    from diffusers import AutoencoderKLLTX2Video

    from .vae import StreamingDecoder

    arguments = {k: v for k, v in vae_config.items() if not k.startswith("_")}
    with torch.device("meta"):
        vae = AutoencoderKLLTX2Video.from_config(arguments).to(dtype)
    decoder = StreamingDecoder(vae)
    channels = int(vae.config.latent_channels)
    state, largest, pushed = decoder.new_state(), 0, 0
    while pushed < decoder.lookahead + 4 * stream.block_size + stream.sink_frames:
        frames = stream.sink_frames if pushed == 0 else stream.block_size
        latents = torch.empty(stream.batch, channels, frames, *latent_hw, device="meta")
        state, _ = decoder.push(state, latents)
        largest = max(largest, state.nbytes)
        pushed += frames
    element = torch.empty((), dtype=dtype).element_size()
    return {"decoder_state": largest, "vae_weights": sum(p.numel() for p in vae.parameters()) * element,
            "lookahead_latent_frames": decoder.lookahead}


def weight_bytes(model, dtype: torch.dtype, checkpoint_parameters: int | None = None) -> dict[str, int]:
    """The weights ``model`` (as loaded: the video path) holds in ``dtype``; ``checkpoint_parameters``: what the
    checkpoint's files hold (the audio branch too), for the report."""
    element = torch.empty((), dtype=dtype).element_size()
    total = sum(p.numel() for p in model.parameters())
    checkpoint = total if checkpoint_parameters is None else checkpoint_parameters
    return {"parameters": total, "checkpoint_parameters": checkpoint, "bytes": total * element}


# --- FLOPs ---------------------------------------------------------------------------------------------------------
def _linear(module, rows: int) -> int:
    return 2 * rows * module.in_features * module.out_features


def forward_flops(model, batch: int, queries: int, keys: int, prompt_tokens: int) -> dict[str, int]:
    """FLOPs of one service forward (``models.step``) of ``batch`` rows over ``queries`` tokens each, whose
    self-attention sees ``keys`` tokens (the window up to and including the block)."""
    n = batch * queries
    emb = model.time_embed.emb.timestep_embedder
    parts = {
        "proj_in_out": _linear(model.proj_in, n) + _linear(model.proj_out, n),
        "time_embedding": sum(_linear(lin, batch) for lin in (emb.linear_1, emb.linear_2, model.time_embed.linear)),
        "self_attn_projections": 0,  # q, k, v, out (and gate logits) of attn1
        "self_attn_scores": 0,  # Q K^T and A V over the window
        "cross_attn_projections": 0,  # q, out of attn2 over the block (its k, v: once per prompt)
        "cross_attn_scores": 0,
        "feed_forward": 0,
    }
    for block in model.transformer_blocks:
        a1, a2 = block.attn1, block.attn2
        parts["self_attn_projections"] += sum(_linear(x, n) for x in (a1.to_q, a1.to_k, a1.to_v, a1.to_out[0]))
        parts["cross_attn_projections"] += _linear(a2.to_q, n) + _linear(a2.to_out[0], n)
        for attn in (a1, a2):
            if attn.to_gate_logits is not None:
                key = "self_attn_projections" if attn is a1 else "cross_attn_projections"
                parts[key] += _linear(attn.to_gate_logits, n)
        parts["self_attn_scores"] += 2 * 2 * n * keys * a1.inner_dim
        parts["cross_attn_scores"] += 2 * 2 * n * prompt_tokens * a2.inner_dim
        parts["feed_forward"] += _linear(block.ff.net[0].proj, n) + _linear(block.ff.net[2], n)
    parts["total"] = sum(parts.values())
    return parts


def prompt_flops(model, batch: int, prompt_tokens: int) -> int:
    """The caption projection and every layer's cross-attention K/V of it, once per prompt (a session's first
    chunk, or a new prompt: ``models.step.prepare_prompt``)."""
    caption, rows = model.caption_projection, batch * prompt_tokens
    kv = sum(_linear(block.attn2.to_k, rows) + _linear(block.attn2.to_v, rows) for block in model.transformer_blocks)
    return _linear(caption.linear_1, rows) + _linear(caption.linear_2, rows) + kv


def summarize(parts: dict[str, int]) -> dict[str, int]:
    """The split the plan prints: projections (every GEMM on tokens but the FF), attention (scores and AV), FF."""
    return {
        "projections": parts["proj_in_out"] + parts["time_embedding"] + parts["self_attn_projections"]
        + parts["cross_attn_projections"],
        "attention": parts["self_attn_scores"] + parts["cross_attn_scores"],
        "feed_forward": parts["feed_forward"],
        "total": parts["total"],
    }


# --- the plan ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gpu:
    memory_bytes: int
    tflops: float | None  # sustained TFLOP/s the caller expects of the refiner's forwards on it
    name: str = ""


@dataclass
class Plan:
    source: str
    dtype: str
    stream: dict[str, Any]
    geometry: dict[str, Any]
    weights: dict[str, int]
    session: dict[str, int]
    workspace_bytes: int
    flops_forward: dict[str, int]
    flops_block: dict[str, int]
    flops_sink: int
    flops_prompt: int
    block_seconds: float
    flops_per_second_per_session: float
    max_load: float = 1.0  # the share of each GPU's rate its sessions by compute may use
    gpus: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def workspace_bytes(model, stream: Stream, tokens_per_frame: int, dtype: torch.dtype, batch_rows: int) -> int:
    """A rough bound on one model call's activations: the FF's hidden tensor and its GELU output (2 x 4D wide) and
    about eight D-wide tensors (input, norms, q, k, v, attention output, residuals) for ``batch_rows`` rows of a
    block. Attention scores are not materialized (fused SDPA). An estimate, stated as such."""
    element = torch.empty((), dtype=dtype).element_size()
    inner = int(model.config.num_attention_heads * model.config.attention_head_dim)
    ffn = model.transformer_blocks[0].ff.net[0].proj.out_features
    tokens = batch_rows * stream.block_size * tokens_per_frame
    return tokens * (2 * ffn + 8 * inner) * element


def make_plan(config: dict[str, Any], stream: Stream, dtype: torch.dtype, gpus: list[Gpu], *, source: str = "",
              batch_rows: int = 8, reserve_bytes: int = 2 * GiB, model=None,
              vae_config: dict[str, Any] | None = None, max_load: float = 1.0) -> Plan:
    """The plan for ``stream`` on each of ``gpus``. ``reserve_bytes``: kept free besides the weights and the
    workspace (CUDA context, allocator slack). ``model``: an already built (meta) model for ``config``.
    ``vae_config``: a VAE's config.json, for sessions with video outputs (its decoder state per session, its
    weights). ``max_load``: the share of a GPU's rate real-time sessions may use (the server's
    ``admission_max_load`` under ``admission: realtime``; 1.0 spends all of it)."""
    if not 0 < max_load <= 1:
        raise ValueError(f"max_load (--max-load) {max_load!r}: the share of the GPU's rate for real-time sessions, "
                         "in (0, 1]")
    model = meta_model(config) if model is None else model
    geometry = latent_geometry(config, stream)
    temporal = vae_scale_factors(config)[0]
    tokens = geometry.tokens_per_frame
    checkpoint = sum(p.numel() for p in meta_model(config, video_only=False).parameters())
    weights = weight_bytes(model, dtype, checkpoint)
    session = session_bytes(model, stream, geometry, dtype)
    if vae_config is not None:
        video = decoder_state_bytes(vae_config, stream, (geometry.height, geometry.width), dtype)
        session["video_decoder_state"] = video["decoder_state"]
        session["total"] += video["decoder_state"]
        weights["vae_bytes"] = video["vae_weights"]
        weights["bytes"] += video["vae_weights"]
    workspace = workspace_bytes(model, stream, tokens, dtype, batch_rows)
    queries = stream.block_size * tokens
    keys = (stream.kv_max_frames + stream.block_size) * tokens  # a steady block: sink + full history + itself
    forward = forward_flops(model, stream.batch, queries, keys, stream.prompt_tokens)
    block = {name: value * (stream.steps + 1) for name, value in forward.items()}
    sink_tokens = stream.sink_frames * tokens
    sink = forward_flops(model, stream.batch, sink_tokens, sink_tokens, stream.prompt_tokens)["total"]
    block_seconds = stream.block_size * temporal / stream.fps
    per_session = block["total"] / block_seconds
    rows = []
    for gpu in gpus:
        free = gpu.memory_bytes - weights["bytes"] - workspace - reserve_bytes
        by_memory = max(free // session["total"], 0)
        row: dict[str, Any] = {"name": gpu.name, "memory_bytes": gpu.memory_bytes, "free_for_sessions_bytes": free,
                               "sessions_by_memory": int(by_memory), "tflops": gpu.tflops}
        if gpu.tflops is not None:
            sustained = gpu.tflops * 1e12
            row["block_compute_seconds"] = block["total"] / sustained
            row["sessions_by_compute"] = int(max_load * sustained // per_session)
            row["sessions"] = min(row["sessions_by_compute"], row["sessions_by_memory"])
        rows.append(row)
    return Plan(
        source=source,
        dtype=str(dtype).removeprefix("torch."),
        stream=asdict(stream),
        geometry={"latent_height": geometry.height, "latent_width": geometry.width,
                  "tokens_per_frame": tokens, "pixel_frames_per_latent_frame": temporal,
                  "block_tokens": queries, "window_tokens": keys},
        weights=weights,
        session=session,
        workspace_bytes=workspace,
        flops_forward=forward,
        flops_block=block,
        flops_sink=sink,
        flops_prompt=prompt_flops(model, stream.batch, stream.prompt_tokens),
        block_seconds=block_seconds,
        flops_per_second_per_session=per_session,
        max_load=max_load,
        gpus=rows,
    )
