"""The streaming session: frames in any split, the sink once, then each refined block, with its own KV cache.

Shape letters: B batch, C channels, T frames, H height, W width, N tokens, D inner dim, L prompt length.

A session is an immutable ``SessionState`` (counters, pending frames, prompt, generator state) plus its KV
cache (``models.kv.SessionKV``, buffers written in place) and the code that moves both forward. Every step is
plan -> run -> commit:

- ``plan`` is plain Python bookkeeping (which frames, which positions);
- ``start`` turns a plan into a ``BlockRun``: the noise is drawn from a copy of the generator, the sink (and,
  rebased, the history) keys are rotated into the window for this block's positions;
- the run's forwards go one at a time: ``next_forward`` says what the next one needs, whoever runs it (this
  session alone in ``step``, or the engine, batched with other sessions' forwards) hands the velocity to
  ``advance``; a forward writes only its block's slot of the window;
- ``commit`` makes the finished run part of the session: the state is replaced, the block's K/V become history.

A run that fails (or is dropped) before ``commit`` therefore changes nothing a later block reads. For work
that must be all or nothing over several blocks (an HTTP chunk, ``push``), ``checkpoint`` / ``rollback`` return
the state and the cache to an earlier moment.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch

from .attention import PreparedPrompt, WindowMode
from .config import SessionConfig
from .errors import InvalidInputError, MissingInputError, NonFiniteOutputError, StreamClosedError
from .forward import Prompt, pack, unpack
from .kv import Checkpoint, SessionKV, WindowLayout
from .loading import Refiner
from .rope import RopeTables, WindowPositions, apply_rope, rope_tables
from .step import RowForward, prepare_prompt, run_batch
from .transfer import HostCopy, to_device

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
    """A session's counters and inputs. Replaced, never mutated; the KV cache lives beside it in the session."""

    frames_received: int = 0
    frames_returned: int = 0
    pending: torch.Tensor | None = None  # (B, C, frames_received - frames_returned, H, W)
    geometry: Geometry | None = None
    prompt: Prompt | None = None
    has_sink: bool = False
    history_frames: int = 0
    rng_state: torch.Tensor | None = None
    flushed: bool = False
    blocks_refined: int = 0

    @property
    def pending_frames(self) -> int:
        return self.frames_received - self.frames_returned

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


@dataclass(eq=False)
class BlockRun:
    """A step in flight: its forwards in order (``modes``), the latents they work on, the generator state after
    its noise draw. Owned by whoever drives it; the session only changes when it is committed."""

    plan: StepPlan
    modes: tuple[WindowMode, ...]
    x: torch.Tensor  # (B, C, frames, H, W): the latents being refined (the raw frames for the sink)
    tables: RopeTables | None
    history_frames: int
    rng_state: torch.Tensor | None
    done: int = 0  # forwards finished
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def finished(self) -> bool:
        return self.done == len(self.modes)


@dataclass(frozen=True)
class FiniteCheck:
    """Whether a run's result is finite, still on the model's device: ``summary`` is a float32 (3,) tensor
    ``[all finite (1.0 or 0.0), largest |x| of its input latents, largest |x| of its prompt_embeds]``, made of
    device reductions queued behind the run, never read on the thread that queued them. Whoever reads the unit's
    bytes on the host reads this with them (``HostCopy(summary)``, then ``error``): on a CPU the session does so at
    commit, where reading costs nothing; on an accelerator (or with ``RefinerSession.defer_finite_check``) the unit
    carries it (``Unit.check``) with its host copy already queued (``host``), so the engine thread can ask whether
    the verdict is in (``ready``) without waiting, and delivery reads the same copy."""

    summary: torch.Tensor
    what: str  # which part of the result was checked
    frame_start: int
    frame_end: int
    dtype: torch.dtype
    host: HostCopy | None = None  # ``summary`` on its way to the host, queued at commit (deferred checks only)

    def ready(self) -> bool:
        """Whether the verdict can be read without waiting for the device (a query, no sync)."""
        return self.host is None or self.host.ready()

    def read(self) -> NonFiniteOutputError | None:
        """The verdict: ``error`` of the host copy (waiting for it if it is not in yet), or of ``summary``."""
        return self.error(None if self.host is None else self.host.wait())

    def error(self, summary: torch.Tensor | None = None) -> NonFiniteOutputError | None:
        """The error to raise if the result is not finite (None if it is), from ``summary`` read on the host (a
        ``HostCopy`` of ``self.summary``; by default ``self.summary`` itself, a device read)."""
        finite, largest, prompt_largest = (summary if summary is not None else self.summary).tolist()
        if finite == 1.0:
            return None
        return NonFiniteOutputError(
            f"frames [{self.frame_start}, {self.frame_end}) refined to NaN or Inf in {self.what}, although the "
            f"inputs are finite: their latents reach |x| = {largest:.3g} and prompt_embeds |x| = "
            f"{prompt_largest:.3g}, too large for the model in {str(self.dtype).removeprefix('torch.')}; nothing of "
            "it was kept (the session is as before these frames): send latents and prompt_embeds at the scale the "
            "stage-1 model produces (|x| of order 1 to 10). The prompt_embeds in effect may have come with an "
            "earlier chunk: it stays until a chunk brings another, so send prompt_embeds again with these frames"
        )


@dataclass(frozen=True)
class Unit:
    """A finalized piece of the stream: the sink frames (unchanged) or one refined block. What it becomes on the
    way out (a video's pixel frames, ...) is the service's business, not the model's.

    ``check``: on an accelerator, whether the unit is finite, not yet read (``FiniteCheck``); whoever copies the
    unit to the host reads it too and refuses the unit if it is not (``verify``). None where nothing is left to
    check (a CPU session checked it at commit; a sink returned as sent)."""

    kind: Literal["sink", "block"]
    latents: torch.Tensor  # (B, C, frame_end - frame_start, H, W)
    frame_start: int
    frame_end: int
    started_at: float = 0.0  # when its run started (time.perf_counter), for latency figures
    check: FiniteCheck | None = None

    def verify(self) -> None:
        """Raise ``NonFiniteOutputError`` if the unit is not finite (a device read when ``check`` is pending)."""
        if self.check is not None and (error := self.check.read()) is not None:
            raise error


@dataclass(frozen=True)
class SessionCheckpoint:
    """An earlier moment of a session, to ``rollback`` to."""

    state: SessionState
    kv: SessionKV | None
    mark: Checkpoint | None


@dataclass(frozen=True)
class _Schedule:
    """The sigmas as Python floats, rounded through fp32 as the reference scheduler stores them, so no step
    reads a device tensor back (a host sync on CUDA)."""

    sigmas: tuple[float, ...]
    deltas: tuple[float, ...]  # sigmas[i + 1] - sigmas[i], computed in the math dtype

    @classmethod
    def build(cls, sigmas: tuple[float, ...], math: torch.dtype) -> _Schedule:
        values = torch.tensor(sigmas, dtype=torch.float32).to(math)
        return cls(tuple(float(v) for v in values), tuple(float(b - a) for a, b in zip(values, values[1:])))


class RefinerSession:
    """One stream through the refiner. Not thread-safe: one caller (the engine thread) drives it.

    ``defer_finite_check``: whether ``commit`` leaves a block's finite verdict unread (``Unit.check``) instead of
    reading it and refusing the block there. None (the default) defers on an accelerator, where reading would wait
    for the device, and reads at once on a CPU, where it costs nothing. True on a CPU runs the accelerator's path
    exactly (the block is committed, its verdict read later, and whoever reads it undoes the block: the engine,
    ``app.engine.worker``; ``stream``/``push`` here), so that path is tested without a GPU."""

    defer_finite_check: bool | None = None
    # The dtype a block's noise is drawn in. None: the model's, as the reference pipeline draws it (float64, the
    # verification twin of a float32 run, draws float32). A float32 twin of a bfloat16 run sets bfloat16 so that the
    # two see the same noise and differ in arithmetic only: from one seed a CPU draws other values in bfloat16 than
    # in float32, by tensor size and torch release (the same first 15 values, then not, on torch 2.11).
    noise_dtype: torch.dtype | None = None

    def __init__(self, refiner: Refiner, config: SessionConfig | None = None, prompt: Prompt | None = None):
        self.refiner = refiner
        self.config = config or SessionConfig()
        generator = torch.Generator(device=_generator_device(refiner.device)).manual_seed(self.config.seed)
        # The reference does its mixing and Euler arithmetic in fp32; a float64 model is the high-precision twin
        # of a float32 run, so it does the same arithmetic in float64 instead.
        self._math_dtype = torch.float64 if refiner.dtype == torch.float64 else torch.float32
        self._schedule = _Schedule.build(self.config.sigmas, self._math_dtype)
        self._state = SessionState(prompt=prompt, rng_state=generator.get_state())
        self._kv: SessionKV | None = None
        self._prepared: tuple[Prompt, PreparedPrompt] | None = None

    # --- state -------------------------------------------------------------------------------------------
    @property
    def defers_finite_check(self) -> bool:
        """Whether ``commit`` leaves the finite verdict to whoever reads the unit (see ``defer_finite_check``)."""
        if self.defer_finite_check is not None:
            return self.defer_finite_check
        return self.refiner.device.type != "cpu"

    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def kv(self) -> SessionKV | None:
        return self._kv

    @property
    def cache_bytes(self) -> int:
        """Bytes the KV cache holds (its preallocated window buffers), 0 before the sink is captured."""
        return 0 if self._kv is None else self._kv.nbytes

    def checkpoint(self) -> SessionCheckpoint:
        """Remember this moment (end with ``rollback`` or ``release``)."""
        kv = self._kv
        return SessionCheckpoint(self._state, kv, kv.checkpoint() if kv is not None else None)

    def rollback(self, checkpoint: SessionCheckpoint) -> None:
        """Go back to ``checkpoint``: the state and the cache are exactly as they were then. A prompt the rolled-back
        work brought is forgotten with what was prepared from it (its cross-attention K/V: held and counted
        otherwise until the next accepted block); the restored prompt's is prepared again by the next forward."""
        self._state = checkpoint.state
        if self._prepared is not None and self._prepared[0] is not self._state.prompt:
            self._prepared = None
        if checkpoint.kv is None or not checkpoint.mark.had_sink:
            self._kv = None
        else:
            checkpoint.kv.rollback(checkpoint.mark)
            self._kv = checkpoint.kv

    def release(self, checkpoint: SessionCheckpoint) -> None:
        """Forget ``checkpoint`` (the work it guarded succeeded)."""
        if checkpoint.kv is not None:
            checkpoint.kv.release(checkpoint.mark)

    def load(self, state: SessionState, kv: SessionKV | None) -> None:
        """Install a state and cache built elsewhere (a snapshot being restored)."""
        self._state, self._kv = state, kv

    # --- input -------------------------------------------------------------------------------------------
    def check(
        self,
        latents: torch.Tensor | None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None,
        finite_checked: bool = False,
    ) -> Chunk:
        """Validate a chunk against this session and cast it to the model; raises, never changes the session.
        ``finite_checked``: the caller already ran ``check_finite`` on the tensors (a server does so before it
        queues the chunk, so that scan never holds up the thread running the model)."""
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
        if not finite_checked:
            _check_finite("latents", latents)

        prompt = None
        if prompt_embeds is not None:
            prompt = check_prompt(self.refiner, prompt_embeds, prompt_attention_mask, batch, finite_checked)
        elif prompt_attention_mask is not None:
            raise MissingInputError("prompt_attention_mask was sent without prompt_embeds; send both or neither")
        elif state.prompt is not None and state.prompt.embeds.shape[0] != batch:
            prompt = _broadcast_prompt(state.prompt, batch)
        if prompt is None and state.prompt is None and latents.shape[2] > 0:
            raise MissingInputError(
                "the first chunk with frames must carry prompt_embeds (B, L, "
                f"{info.caption_channels}) and optionally prompt_attention_mask (B, L)"
            )
        return Chunk(latents=to_device(latents, self.refiner.device, self.refiner.dtype), prompt=prompt)

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

    # --- plan -> run -> commit ----------------------------------------------------------------------------
    def plan(self) -> StepPlan | None:
        """The next step that the frames received so far allow, or None."""
        state, config = self._state, self.config
        sink_frames = config.sink_frames
        if not state.has_sink and state.frames_returned == 0:
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

    def start(self, plan: StepPlan) -> BlockRun:
        """Begin ``plan``: draw its noise, rotate the window's prefix to its positions. The state is untouched."""
        state, config = self._state, self.config
        offset = plan.start - state.frames_returned
        frames = state.pending[:, :, offset : offset + plan.frames]  # (B, C, t, H, W)
        if plan.kind == "sink":
            if plan.frames < config.sink_frames:
                return BlockRun(plan, (), frames, None, 0, None)  # nothing to refine: returned as sent
            self._ensure_kv()
            tables = self._tables(list(range(plan.frames)))
            return BlockRun(plan, ("sink",), frames, tables, 0, None)

        positions = plan.positions
        # With absolute positions the history keys sit in the window already rotated: no table for them.
        history = self._rotator(positions.history) if self._kv.rebased else None
        self._kv.prepare_block(self._rotator(positions.sink), history)
        refiner, dtype = self.refiner, self.refiner.dtype
        generator = torch.Generator(device=_generator_device(refiner.device))
        generator.set_state(state.rng_state)
        # float64 is the verification twin of a float32 run: it draws the same float32 noise and widens it.
        noise_dtype = self.noise_dtype or (torch.float32 if dtype == torch.float64 else dtype)
        if refiner.device.type == "meta":  # shapes only (models.loading, device="meta"): meta has no generator
            noise = torch.randn(frames.shape, device=refiner.device, dtype=noise_dtype)
        else:
            noise = torch.randn(frames.shape, generator=generator, device=refiner.device, dtype=noise_dtype)
        sigma_max, math = self._schedule.sigmas[0], self._math_dtype
        x = ((1.0 - sigma_max) * frames.to(math) + sigma_max * noise.to(math)).to(dtype)  # (B, C, t, H, W)
        modes = ("denoise",) * config.steps + ("commit",)
        return BlockRun(plan, modes, x, self._tables(positions.block), state.history_frames, generator.get_state())

    def next_forward(self, run: BlockRun) -> RowForward | None:
        """What the run's next forward needs, or None when the run is ready to commit."""
        if run.finished:
            return None
        mode = run.modes[run.done]
        sigma = self._schedule.sigmas[run.done] if mode == "denoise" else 0.0
        return RowForward(
            kv=self._kv,
            tokens=pack(run.x),  # (B, N, C)
            sigma=sigma,
            mode=mode,
            tables=run.tables,
            history_frames=run.history_frames,
            frames=run.plan.frames,
            prompt=self._prepared_prompt(),
            owner=self,
        )

    def advance(self, run: BlockRun, velocity: torch.Tensor) -> None:
        """Take the velocity (B, N, C) of the run's current forward: an Euler step for a denoising forward."""
        mode = run.modes[run.done]
        if mode == "denoise":
            run.x = self._euler(run.x, velocity, run.done)
        run.done += 1

    def commit(self, run: BlockRun) -> Unit:
        """Make a finished run part of the session and return the frames it finalized."""
        state, plan = self._state, run.plan
        if not run.finished:
            raise RuntimeError(f"run of {plan} committed after {run.done} of {len(run.modes)} forwards")
        if plan.start != state.frames_returned:
            raise RuntimeError(f"stale step: planned at frame {plan.start}, session is at {state.frames_returned}")
        check = self._finite_check(run) if run.modes else None
        if check is not None:
            if not self.defers_finite_check:
                if (error := check.error()) is not None:  # a host tensor: reading it stalls nothing
                    raise error
                check = None
            else:  # queued behind the run; read by whoever reads the unit (Unit.check)
                check = dataclasses.replace(check, host=HostCopy(check.summary))
        remaining = state.pending[:, :, plan.frames :]
        changes: dict = dict(frames_returned=plan.end, pending=remaining if remaining.shape[2] > 0 else None)
        if plan.kind == "sink":
            if run.modes:
                self._kv.commit_sink()
                changes.update(has_sink=True, history_frames=0)
        else:
            self._kv.commit_block(plan.frames)
            changes.update(
                history_frames=self._kv.history_frames,
                rng_state=run.rng_state,
                blocks_refined=state.blocks_refined + 1,
            )
        self._state = dataclasses.replace(state, **changes)
        return Unit(plan.kind, run.x, plan.start, plan.end, run.started_at, check)

    def _finite_check(self, run: BlockRun) -> FiniteCheck:
        """Whether the run's result is finite, reduced on the device and not read (``FiniteCheck``). A run whose
        result is not finite must not be committed: once NaN or Inf is in the cache every later block attends to
        it, so one bad chunk would poison the session for good. What is checked is what the session keeps: for a
        block its refined frames (its K/V follow from them and the prompt, which shaped them too), for the sink
        its K/V (its frames are returned as sent). The input maxima only feed the error message; they are
        reduced here because the frames leave the session at commit."""
        plan, state = run.plan, self._state
        if plan.kind == "sink":
            kv, sink = self._kv, self._kv.layout.sink_tokens
            finite = torch.isfinite(kv.sink_key).all() & torch.isfinite(kv.window[:, 1, :, :sink]).all()
            what = "the sink's keys and values"
        else:
            finite = torch.isfinite(run.x).all()
            what = "the refined block"
        offset = plan.start - state.frames_returned
        frames = state.pending[:, :, offset : offset + plan.frames]
        prompt = state.prompt
        parts = [finite.to(torch.float32), _largest(frames),
                 _largest(prompt.embeds if prompt is not None else frames.new_empty(0))]
        return FiniteCheck(torch.stack(parts), what, plan.start, plan.end, self.refiner.dtype)  # (3,)

    def step(self) -> Unit | None:
        """Plan, run and commit the next step alone (no batching); None when nothing is ready. On an accelerator
        the unit's ``check`` is left unread (``Unit.verify``), as the engine leaves it."""
        plan = self.plan()
        if plan is None:
            return None
        run = self.start(plan)
        while (forward := self.next_forward(run)) is not None:
            (velocity,) = run_batch(self.refiner.model, [forward])
            self.advance(run, velocity)
        return self.commit(run)

    def _step_verified(self) -> Unit | None:
        """``step``, and where the commit deferred it the unit's finite check read before it is returned (a device
        read: the caller reads the unit's bytes anyway), undoing the step if it fails, so that ``stream`` and
        ``push`` keep their promise on every device. A commit that did not defer has checked it already; on
        ``meta`` (shapes only) there is nothing to read."""
        if not self.defers_finite_check or self.refiner.device.type == "meta":
            return self.step()
        before = self.checkpoint()
        try:
            unit = self.step()
            if unit is not None:
                unit.verify()
        except BaseException:
            self.rollback(before)
            raise
        self.release(before)
        return unit

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
        while (unit := self._step_verified()) is not None:
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
        checkpoint = self.checkpoint()
        try:
            units = list(self.stream(latents, prompt_embeds, prompt_attention_mask, flush=flush))
        except BaseException:
            self.rollback(checkpoint)
            raise
        self.release(checkpoint)
        return units

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
    def _ensure_kv(self) -> SessionKV:
        geometry, config, refiner = self._state.geometry, self.config, self.refiner
        layout = WindowLayout(config.sink_frames, config.max_history_frames, config.block_size,
                              geometry.tokens_per_frame)
        kv = self._kv
        if kv is None or kv.layout != layout or kv.batch != geometry.batch:
            kv = SessionKV(refiner.num_layers, geometry.batch, layout, refiner.info.inner_dim, refiner.dtype,
                           refiner.device, rebased=config.positions == "rebased")
            self._kv = kv
        return kv

    def _tables(self, positions: list[int]) -> RopeTables:
        geometry, refiner = self._state.geometry, self.refiner
        return rope_tables(refiner.model, positions, geometry.batch, geometry.height, geometry.width,
                           self.config.fps, refiner.device, refiner.dtype)

    def _rotator(self, positions: list[int]):
        """``(layer, pre-RoPE keys) -> keys rotated to positions``, with the tables built once for every layer."""
        if not positions:
            return None
        tables = self._tables(positions)
        rope_type = self.refiner.info.rope_type

        def rotate(layer: int, keys: torch.Tensor) -> torch.Tensor:
            return apply_rope(keys, tables, rope_type)

        return rotate

    def _prepared_prompt(self) -> PreparedPrompt:
        prompt = self._state.prompt
        if self._prepared is None or self._prepared[0] is not prompt:
            self._prepared = (prompt, prepare_prompt(self.refiner.model, prompt.embeds, prompt.mask))
        return self._prepared[1]

    def _euler(self, x: torch.Tensor, velocity: torch.Tensor, step: int) -> torch.Tensor:
        """One flow-matching Euler step from sigmas[step] to sigmas[step + 1], in fp32 like the reference."""
        math, dtype = self._math_dtype, self.refiner.dtype
        sigma = self._schedule.sigmas[step]
        _, _, frames, height, width = x.shape
        tokens = pack(x)  # (B, N, C)
        denoised = tokens.to(math) - velocity.to(math) * sigma  # (B, N, C)
        x0 = unpack(denoised.to(dtype), frames, height, width)  # (B, C, t, H, W)
        if sigma <= 1.0e-6:
            return x0.to(dtype)
        flow = (x.to(math) - x0.to(math)) / sigma
        return (x.to(math) + self._schedule.deltas[step] * flow).to(dtype)


def _generator_device(device: torch.device) -> torch.device:
    """Where a session's generator lives: the model's device, except ``meta`` (shapes only, no generator there)."""
    return torch.device("cpu") if device.type == "meta" else device


def _largest(tensor: torch.Tensor) -> torch.Tensor:
    """max |x| of ``tensor`` as a 0-dim float32 tensor on its device (0 for an empty one), not read."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    return tensor.detach().abs().amax().to(torch.float32)


def check_prompt(refiner: Refiner, embeds: torch.Tensor, mask: torch.Tensor | None, batch: int,
                 finite_checked: bool = False) -> Prompt:
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
    if not finite_checked:
        _check_finite("prompt_embeds", embeds)
    device, dtype = refiner.device, refiner.dtype
    mask_values = None  # attend to every token: no mask at all, so attention may take its fused kernels
    if mask is not None:
        _check_tensor("prompt_attention_mask", mask, MASK_DTYPES)
        if tuple(mask.shape) != (batch, length):
            raise InvalidInputError(
                f"prompt_attention_mask must be shaped (B, L) = ({batch}, {length}), got {tuple(mask.shape)}"
            )
        if mask.is_floating_point() and not finite_checked:
            _check_finite("prompt_attention_mask", mask)
        keep = mask != 0  # (B, L)
        # Checked once, when the prompt arrives (a host read if it arrived on a device, never per forward): an
        # all-ones mask attends to every token, which is what no mask does (the reference adds a bias of 0).
        if not bool(keep.all()):
            kept = _kept_tokens(keep)
            if kept is None:
                mask_values = to_device(keep, device, dtype)
            else:
                embeds = embeds[:, kept.to(embeds.device)]  # (B, L_kept, caption_channels)
    return Prompt(embeds=to_device(embeds, device, dtype), mask=mask_values)


def _kept_tokens(keep: torch.Tensor) -> torch.Tensor | None:
    """The positions (L_kept,) a padding mask ``keep`` (B, L) attends to, when the prompt may be cut down to them:
    the same positions in every stream, at least one. Cross-attention is the prompt's only reader, and a masked
    token's bias is -10,000 (the reference's ``(1 - mask) * -10000``): its softmax weight is exp(-10,000 + the score
    difference), exactly 0 in float32 and bfloat16 for any scores within ~9,900 of each other, so attending to the
    kept tokens alone is the same sum without its zero terms (another reduction length: within the parity
    tolerance, not bit for bit; tests/models/test_parity.py). What it buys: no mask reaches attention, so it may
    take a fused (flash) kernel on a GPU, and every layer's prompt K/V shrink to the kept tokens (a tokenizer's
    padding is often most of the prompt). A mask that differs between streams stays a mask (one length per
    prompt), and so does one that keeps nothing: the reference then attends to every token evenly."""
    if not bool((keep == keep[:1]).all()) or not bool(keep[0].any()):
        return None
    return keep[0].nonzero().squeeze(1)  # (L_kept,)


def _broadcast_prompt(prompt: Prompt, batch: int) -> Prompt:
    """A one-stream prompt (a server's default) reused for every stream of a batch."""
    if prompt.embeds.shape[0] != 1:
        raise InvalidInputError(
            f"this session's prompt has batch {prompt.embeds.shape[0]} but the latents have batch {batch}; send "
            "prompt_embeds (B, L, D) matching the latents"
        )
    mask = None if prompt.mask is None else prompt.mask.expand(batch, -1).contiguous()  # (B, L)
    return Prompt(embeds=prompt.embeds.expand(batch, -1, -1).contiguous(), mask=mask)  # (B, L, D)


def _check_tensor(name: str, tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInputError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        hint = " (numpy's default float64: .astype(np.float32))" if tensor.dtype == torch.float64 \
            and torch.float32 in dtypes else ""
        raise InvalidInputError(
            f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}; send one of {allowed}{hint}")


def check_finite(tensors: dict[str, torch.Tensor | None]) -> None:
    """The NaN/Inf scan of a chunk's floating-point tensors (by name), as ``RefinerSession.check`` runs it."""
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            _check_finite(name, tensor)


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise InvalidInputError(f"{name} holds {bad} NaN or Inf values; send finite numbers only")
