"""The streaming session: frames in any split, the sink once, then each refined block, with its own KV cache.

Shape letters: B batch, C channels, T frames, H height, W width, N tokens, D inner dim, L prompt length.

A session is an immutable ``SessionState`` plus the code that moves it forward. Every step is
plan -> execute -> commit: ``plan`` is plain Python bookkeeping (which frames, which positions),
``execute`` runs the forwards and touches no state, ``commit`` swaps in the new state. A block whose forwards
fail therefore changes nothing, and ``push`` restores the state it started from when any step fails, so
retrying the same chunk gives the same bytes. The generator lives in the state as its saved bytes, so it too
only advances on commit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Literal

import torch

from .attention import ForwardWindow, LayerKV
from .config import SessionConfig
from .errors import InvalidInputError, MissingInputError, StreamClosedError
from .forward import Prompt, pack, run_forward, unpack
from .loading import Refiner
from .rope import WindowPositions, rope_tables

LATENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, *LATENT_DTYPES)


@dataclass(frozen=True)
class Geometry:
    """Per-session latent shape, fixed by the first chunk: latents are (batch, channels, T, height, width)."""

    batch: int
    channels: int
    height: int
    width: int

    @property
    def tokens_per_frame(self) -> int:
        return self.height * self.width


@dataclass(frozen=True)
class Chunk:
    """A validated chunk, cast to the model's device and dtype: latents (B, C, t, H, W), t >= 0."""

    latents: torch.Tensor
    prompt: Prompt | None = None

    @property
    def frames(self) -> int:
        return int(self.latents.shape[2])


@dataclass(frozen=True)
class SessionState:
    """Everything a session holds. Replaced, never mutated, so any earlier state is a valid rollback point."""

    frames_received: int = 0
    frames_returned: int = 0
    pending: torch.Tensor | None = None  # (B, C, frames_received - frames_returned, H, W)
    geometry: Geometry | None = None
    prompt: Prompt | None = None
    sink: tuple[LayerKV, ...] | None = None  # pre-RoPE, per layer, (B, S*H*W, D)
    history: tuple[LayerKV, ...] = ()  # per layer, (B, history_frames*H*W, D)
    history_frames: int = 0
    rng_state: torch.Tensor | None = None
    flushed: bool = False
    blocks_refined: int = 0

    @property
    def pending_frames(self) -> int:
        return self.frames_received - self.frames_returned

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the KV cache (sink + history K/V over every layer)."""
        layers = [*(self.sink or ()), *self.history]
        return sum(kv.key.nbytes + kv.value.nbytes for kv in layers)

    @property
    def pending_bytes(self) -> int:
        return 0 if self.pending is None else self.pending.nbytes


@dataclass(frozen=True)
class StepPlan:
    """What the next step computes. ``kind`` "sink" captures the sink (or, on a flush with fewer than S frames,
    returns them as they are); "block" refines frames ``[start, end)``."""

    kind: Literal["sink", "block"]
    start: int
    end: int
    positions: WindowPositions | None = None

    @property
    def frames(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class StepResult:
    """What ``execute`` produced, waiting to be committed."""

    plan: StepPlan
    latents: torch.Tensor  # (B, C, end - start, H, W): the refined block, or the raw sink frames
    sink: tuple[LayerKV, ...] | None = None
    new_history: tuple[LayerKV, ...] | None = None
    rng_state: torch.Tensor | None = None


@dataclass(frozen=True)
class Unit:
    """A finalized piece of the stream: the sink frames (unchanged) or one refined block."""

    kind: Literal["sink", "block"]
    latents: torch.Tensor  # (B, C, frame_end - frame_start, H, W)
    frame_start: int
    frame_end: int


class RefinerSession:
    """One stream through the refiner. Not thread-safe: one caller (the engine thread) drives it."""

    def __init__(self, refiner: Refiner, config: SessionConfig | None = None, prompt: Prompt | None = None):
        self.refiner = refiner
        self.config = config or SessionConfig()
        generator = torch.Generator(device=refiner.device).manual_seed(self.config.seed)
        # The reference does its mixing and Euler arithmetic in fp32; a float64 model is the high-precision twin
        # of a float32 run, so it does the same arithmetic in float64 instead.
        self._math_dtype = torch.float64 if refiner.dtype == torch.float64 else torch.float32
        # The schedule rounded to fp32, as the reference scheduler stores it; every sigma below is read from it.
        sigmas = torch.tensor(self.config.sigmas, dtype=torch.float32, device=refiner.device)
        self._sigmas = sigmas.to(self._math_dtype)
        self._state = SessionState(prompt=prompt, rng_state=generator.get_state())

    # --- state -------------------------------------------------------------------------------------------
    @property
    def state(self) -> SessionState:
        return self._state

    def restore(self, state: SessionState) -> None:
        """Go back to an earlier state of this session (e.g. the one before a failed request)."""
        self._state = state

    @property
    def cache_bytes(self) -> int:
        return self._state.cache_bytes

    # --- input -------------------------------------------------------------------------------------------
    def check(
        self,
        latents: torch.Tensor | None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None,
    ) -> Chunk:
        """Validate a chunk against this session and cast it to the model; raises, never changes the session."""
        state = self._state
        if state.flushed:
            raise StreamClosedError(
                f"the stream was flushed after {state.frames_received} frames; create a new session to send more"
            )
        if latents is None:
            raise MissingInputError("the chunk has no 'latents' tensor; send latents shaped (B, C, t, H, W)")
        info = self.refiner.info
        _check_tensor("latents", latents, LATENT_DTYPES)
        if latents.ndim != 5:
            raise InvalidInputError(
                f"latents must have rank 5 (B, C, t, H, W), got shape {tuple(latents.shape)}; "
                "add the batch/time axes as needed"
            )
        batch, channels, _, height, width = (int(n) for n in latents.shape)
        if channels != info.in_channels:
            raise InvalidInputError(
                f"latents have {channels} channels but the model takes {info.in_channels}; send (B, "
                f"{info.in_channels}, t, H, W)"
            )
        if batch < 1 or height < 1 or width < 1:
            raise InvalidInputError(f"latents shape {tuple(latents.shape)} has an empty batch, height or width")
        geometry = Geometry(batch, channels, height, width)
        if state.geometry is not None and geometry != state.geometry:
            expected = state.geometry
            raise InvalidInputError(
                f"latents shaped {tuple(latents.shape)} do not match this session's (B, C, H, W) = "
                f"({expected.batch}, {expected.channels}, {expected.height}, {expected.width}); every chunk "
                "of a session must share batch, channels, height and width"
            )
        _check_finite("latents", latents)

        prompt = None
        if prompt_embeds is not None:
            prompt = check_prompt(self.refiner, prompt_embeds, prompt_attention_mask, batch)
        elif prompt_attention_mask is not None:
            raise MissingInputError("prompt_attention_mask was sent without prompt_embeds; send both or neither")
        elif state.prompt is not None and state.prompt.embeds.shape[0] != batch:
            prompt = _broadcast_prompt(state.prompt, batch)
        if prompt is None and state.prompt is None and latents.shape[2] > 0:
            raise MissingInputError(
                "the first chunk with frames must carry prompt_embeds (B, L, "
                f"{info.caption_channels}) and optionally prompt_attention_mask (B, L)"
            )
        device, dtype = self.refiner.device, self.refiner.dtype
        return Chunk(latents=latents.to(device=device, dtype=dtype), prompt=prompt)

    def append(self, chunk: Chunk, flush: bool = False) -> None:
        """Add a checked chunk's frames (and prompt) to the pending frames. Bookkeeping only."""
        state = self._state
        if state.flushed:
            raise StreamClosedError("the stream was already flushed; create a new session to send more")
        latents = chunk.latents
        b, c, _, h, w = latents.shape
        geometry = state.geometry or Geometry(int(b), int(c), int(h), int(w))
        pending = latents if state.pending is None else torch.cat([state.pending, latents], dim=2)  # (B, C, T, H, W)
        self._state = dataclasses.replace(
            state,
            frames_received=state.frames_received + chunk.frames,
            pending=pending,
            geometry=geometry,
            prompt=chunk.prompt or state.prompt,
            flushed=flush,
        )

    # --- plan -> execute -> commit ----------------------------------------------------------------------
    def plan(self) -> StepPlan | None:
        """The next step that the frames received so far allow, or None."""
        state, config = self._state, self.config
        sink_frames = config.sink_frames
        if state.sink is None and state.frames_returned == 0:
            if state.frames_received >= sink_frames:
                return StepPlan("sink", 0, sink_frames)
            if state.flushed and state.frames_received > 0:
                return StepPlan("sink", 0, state.frames_received)  # too short to refine: returned as sent
            return None
        start = state.frames_returned
        if state.frames_received >= start + config.block_size:
            end = start + config.block_size
        elif state.flushed and state.frames_received > start:
            end = state.frames_received  # the final short block
        else:
            return None
        positions = WindowPositions.plan(
            start, end, state.history_frames, sink_frames, rebased=config.positions == "rebased"
        )
        return StepPlan("block", start, end, positions)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the forwards of ``plan``. Reads the state, writes nothing."""
        state = self._state
        offset = plan.start - state.frames_returned
        frames = state.pending[:, :, offset : offset + plan.frames]  # (B, C, t, H, W)
        if plan.kind == "sink":
            if plan.frames < self.config.sink_frames:
                return StepResult(plan, frames)
            return StepResult(plan, frames, sink=self._capture_sink(frames, state.prompt))
        return self._refine_block(plan, frames, state)

    def commit(self, result: StepResult) -> Unit:
        """Make a step's result part of the session and return the finalized frames."""
        state, plan = self._state, result.plan
        if plan.start != state.frames_returned:
            raise RuntimeError(f"stale step: planned at frame {plan.start}, session is at {state.frames_returned}")
        remaining = state.pending[:, :, plan.frames :]
        changes: dict = dict(
            frames_returned=plan.end,
            pending=remaining if remaining.shape[2] > 0 else None,
        )
        if plan.kind == "sink":
            changes["sink"] = result.sink
        else:
            changes.update(
                history=result.new_history,
                history_frames=min(state.history_frames + plan.frames, self.config.max_history_frames),
                rng_state=result.rng_state,
                blocks_refined=state.blocks_refined + 1,
            )
        self._state = dataclasses.replace(state, **changes)
        return Unit(plan.kind, result.latents, plan.start, plan.end)

    def step(self) -> Unit | None:
        plan = self.plan()
        if plan is None:
            return None
        return self.commit(self.execute(plan))

    # --- convenience -------------------------------------------------------------------------------------
    def stream(
        self,
        latents: torch.Tensor | None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None,
        flush: bool = False,
    ) -> Iterator[Unit]:
        """Append a chunk and yield each unit as soon as it is final. A failing step leaves the session as it was
        before that step (earlier units of the chunk stay committed, its frames stay pending)."""
        if latents is None and flush:
            latents = self.empty_latents()
        chunk = self.check(latents, prompt_embeds, prompt_attention_mask)
        self.append(chunk, flush=flush)
        while (unit := self.step()) is not None:
            yield unit

    def push(
        self,
        latents: torch.Tensor | None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None,
        flush: bool = False,
    ) -> list[Unit]:
        """All-or-nothing: append a chunk and refine what it completes; on any failure the session is exactly
        as before the call."""
        before = self._state
        try:
            return list(self.stream(latents, prompt_embeds, prompt_attention_mask, flush=flush))
        except BaseException:
            self._state = before
            raise

    def flush(self) -> list[Unit]:
        """End the stream: refine the pending frames as a final short block."""
        return self.push(None, flush=True)

    def empty_latents(self) -> torch.Tensor:
        """A zero-frame chunk (B, C, 0, H, W) in this session's geometry, for a flush that carries no frames."""
        g = self._state.geometry
        if g is None:
            return torch.zeros(1, self.refiner.info.in_channels, 0, 1, 1)
        return torch.zeros(g.batch, g.channels, 0, g.height, g.width)

    # --- the compute -------------------------------------------------------------------------------------
    def _tables(self, positions: list[int], geometry: Geometry):
        refiner = self.refiner
        return rope_tables(
            refiner.model,
            positions,
            geometry.batch,
            geometry.height,
            geometry.width,
            self.config.fps,
            refiner.device,
            refiner.dtype,
        )

    def _capture_sink(self, frames: torch.Tensor, prompt: Prompt) -> tuple[LayerKV, ...]:
        """One sigma-0 forward over the sink frames at positions 0..S-1, no prefix; keep its pre-RoPE K/V."""
        geometry = self._state.geometry
        model = self.refiner.model
        window = ForwardWindow("sink", self.refiner.num_layers)
        rope = self._tables(list(range(frames.shape[2])), geometry)
        _, captured = run_forward(model, pack(frames), 0.0, rope, prompt, window)
        return tuple(captured)

    def _refine_block(self, plan: StepPlan, clean: torch.Tensor, state: SessionState) -> StepResult:
        """Noise the block to sigmas[0], Euler-integrate to 0 with the window, then capture its K/V."""
        refiner, config, geometry = self.refiner, self.config, state.geometry
        model, device, dtype = refiner.model, refiner.device, refiner.dtype
        positions = plan.positions
        rebased = config.positions == "rebased"
        sink_tables = self._tables(positions.sink, geometry)
        block_tables = self._tables(positions.block, geometry)
        history_tables = self._tables(positions.history, geometry) if rebased and state.history_frames else None
        history = list(state.history) or None
        num_layers = refiner.num_layers

        def window(mode: str) -> ForwardWindow:
            return ForwardWindow(
                mode,
                num_layers,
                sink=list(state.sink),
                sink_tables=sink_tables,
                history=history,
                history_tables=history_tables,
                capture_rotated=not rebased,
            )

        generator = torch.Generator(device=device)
        generator.set_state(state.rng_state)
        # float64 is the verification twin of a float32 run: it draws the same float32 noise and widens it.
        noise_dtype = torch.float32 if dtype == torch.float64 else dtype
        noise = torch.randn(clean.shape, generator=generator, device=device, dtype=noise_dtype)  # (B, C, t, H, W)
        sigmas = self._sigmas
        sigma_max = float(sigmas[0])
        math = self._math_dtype
        x = ((1.0 - sigma_max) * clean.to(math) + sigma_max * noise.to(math)).to(dtype)

        frames, height, width = plan.frames, geometry.height, geometry.width
        for i in range(config.steps):
            sigma = float(sigmas[i])
            tokens = pack(x)  # (B, N, C)
            velocity, _ = run_forward(model, tokens, sigma, block_tables, state.prompt, window("denoise"))
            raw_sigma = torch.full((*tokens.shape[:2], 1), sigma, dtype=math, device=device)
            denoised = tokens.to(math) - velocity.to(math) * raw_sigma  # (B, N, C)
            x0 = unpack(denoised.to(dtype), frames, height, width)  # (B, C, t, H, W)
            if sigma <= 1.0e-6:
                x = x0.to(dtype)
            else:
                # Flow-matching Euler step from sigmas[i] to sigmas[i+1], in fp32 like the reference scheduler.
                flow = (x.to(math) - x0.to(math)) / sigma
                x = (x.to(math) + (sigmas[i + 1] - sigmas[i]) * flow).to(dtype)

        _, captured = run_forward(model, pack(x), 0.0, block_tables, state.prompt, window("commit"))
        keep_tokens = (config.max_history_frames - frames) * geometry.tokens_per_frame
        new_history = tuple(
            LayerKV(
                key=torch.cat([_newest(old.key, keep_tokens), new.key], dim=1),  # (B, N_history, D)
                value=torch.cat([_newest(old.value, keep_tokens), new.value], dim=1),
                rotated=new.rotated,
            )
            if old is not None
            else new
            for old, new in zip(history or [None] * num_layers, captured)
        )
        return StepResult(plan, x, new_history=new_history, rng_state=generator.get_state())


def check_prompt(refiner: Refiner, embeds: torch.Tensor, mask: torch.Tensor | None, batch: int) -> Prompt:
    """Validate prompt conditioning for ``batch`` streams and cast it to the model: embeds (B, L, caption_channels),
    mask (B, L) of any dtype (nonzero = attend; absent = all ones)."""
    info = refiner.info
    _check_tensor("prompt_embeds", embeds, LATENT_DTYPES)
    if embeds.ndim != 3 or embeds.shape[0] != batch or embeds.shape[2] != info.caption_channels:
        raise InvalidInputError(
            f"prompt_embeds must be shaped (B={batch}, L, {info.caption_channels}), got {tuple(embeds.shape)}"
        )
    length = int(embeds.shape[1])
    if length < 1:
        raise InvalidInputError("prompt_embeds has no tokens (L = 0); send at least one")
    _check_finite("prompt_embeds", embeds)
    device, dtype = refiner.device, refiner.dtype
    if mask is None:
        # A missing mask means "attend to every token": the reference passes an all-ones mask then.
        mask_values = torch.ones(batch, length, device=device, dtype=dtype)
    else:
        _check_tensor("prompt_attention_mask", mask, MASK_DTYPES)
        if tuple(mask.shape) != (batch, length):
            raise InvalidInputError(
                f"prompt_attention_mask must be shaped (B, L) = ({batch}, {length}), got {tuple(mask.shape)}"
            )
        if mask.is_floating_point():
            _check_finite("prompt_attention_mask", mask)
        mask_values = (mask != 0).to(device=device, dtype=dtype)
    return Prompt(embeds=embeds.to(device=device, dtype=dtype), mask=mask_values)


def _broadcast_prompt(prompt: Prompt, batch: int) -> Prompt:
    """A one-stream prompt (a server's default) reused for every stream of a batch."""
    if prompt.embeds.shape[0] != 1:
        raise InvalidInputError(
            f"this session's prompt has batch {prompt.embeds.shape[0]} but the latents have batch {batch}; send "
            "prompt_embeds (B, L, D) matching the latents"
        )
    mask = None if prompt.mask is None else prompt.mask.expand(batch, -1).contiguous()  # (B, L)
    return Prompt(embeds=prompt.embeds.expand(batch, -1, -1).contiguous(), mask=mask)  # (B, L, D)


def _newest(tokens: torch.Tensor, keep: int) -> torch.Tensor:
    """The last ``keep`` tokens of (B, N, D) (all of them if there are fewer)."""
    return tokens[:, max(tokens.shape[1] - keep, 0) :]


def _check_tensor(name: str, tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInputError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise InvalidInputError(f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}; send one of {allowed}")


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise InvalidInputError(f"{name} holds {bad} NaN or Inf values; send finite numbers only")
