"""Real-time pacing: each real-time session's block deadlines, late blocks, and admission by measured cost.

A session created with ``realtime: true`` says its client plays the refined stream at the session's ``fps`` as it
arrives. The fps counts pixel frames (the RoPE time scale, 16 for SANA-WM); one latent frame is ``temporal`` pixel
frames (the VAE's temporal compression, the refiner config's ``vae_scale_factors[0]``: 8 for LTX-2), so a block of
``n`` latent frames plays for ``n * temporal / fps`` seconds.

**Deadline of a block** ``[a, b)``: the arrival of its last input frame (``b - 1``: when the request or message that
carried it reached the server, ``Work.submitted_at``) plus that block's playback time. A block committed after its
deadline is *late*, by ``commit - deadline`` seconds: a client that started playing the block before it when it
arrived runs dry. The sink (returned unchanged) has no deadline. The engine calls ``Pacer.arrived`` when it accepts
a chunk and ``Pacer.committed`` when it commits a block, both on its thread; the clock is injectable (tests).

**A block undone after its commit.** On an accelerator a block's NaN/Inf verdict is read after its commit
(``app.engine.worker``, late verdicts), and a NaN/Inf block is then undone. Such a block must not count: the CPU
path never commits it, so its pacing must end up the same. ``Pacer.committed`` therefore returns a ``PacedBlock``
holding the session's pacing from before the block (counters and arrivals, a few entries): ``Pacer.undo`` puts it
back (the block is neither paced nor late, and its frames' arrivals are listed again, so the retry's deadline comes
from its own arrival exactly as after a CPU failure), ``Pacer.confirm`` counts it in the metrics. Decision: the
metrics (``refiner_paced_blocks_total``, ``refiner_late_blocks_total``) are counters, which cannot go down, so a
block whose verdict is pending reaches them only once it is confirmed finite; the session's own counters count it
at commit (its JSON is read between blocks, and an undo takes it back).

**Cost model.** Every model call the engine makes feeds ``CostModel``: its seconds divided by its rows, an
exponentially weighted moving average per tokens-per-row (a call holds forwards of one token count only). The
seconds are the device's (``models.clock.CallClock``): on CUDA the span between two events around the call, read
once the GPU passed them (a figure arrives a call or two late; the engine never waits for it), since wall time
around asynchronous launches measures the launches and would over-admit; on a CPU, wall time. With
batching on, rows that shared a call cost their share of it, so the figure is what a session costs at the load it
ran under.

**Admission** (setting ``admission: realtime``): a real-time session needs, per second of video,
``forwards per block x rows x cost per row / block seconds`` seconds of engine time (its *load*). A new real-time
session is refused (503 ``over_capacity`` + ``Retry-After``) when the loads of the real-time sessions already held
plus its own pass ``admission_max_load`` (0.9: a tenth of the engine kept for sink captures, decodes and
jitter). A session's tokens per frame are only known from its first chunk: until then (the new session included)
it is costed at the server's warm-up geometry (``warmup_height x warmup_width``, the production geometry in
``configs/sana-wm.yaml``). With no measured call yet, nothing is refused: there is no figure to refuse by.
Sessions that are not real time are never refused by this check and never counted in it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from app.core.error_kinds import ApiError

EWMA_WEIGHT = 0.2  # of the newest call: about the last ten calls decide the figure


class CostModel:
    """Seconds of one forward per row, by tokens per row: an EWMA of the engine's own model calls."""

    def __init__(self, weight: float = EWMA_WEIGHT):
        self.weight = weight
        self._per_row: dict[int, float] = {}
        self.calls = 0

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        if rows < 1 or tokens < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        value = seconds / rows
        old = self._per_row.get(tokens)
        self._per_row[tokens] = value if old is None else old + self.weight * (value - old)
        self.calls += 1

    def set(self, tokens: int, per_row_seconds: float) -> None:
        """Install a figure (a test, or an operator's measurement carried over)."""
        self._per_row[tokens] = per_row_seconds

    def per_row(self, tokens: int) -> float | None:
        """The measured seconds per row of a forward of ``tokens`` tokens per row; a token count never measured is
        scaled linearly from the nearest measured one (a forward's GEMMs are linear in its tokens; its attention,
        slightly more). None before any call."""
        if tokens in self._per_row:
            return self._per_row[tokens]
        if not self._per_row:
            return None
        nearest = min(self._per_row, key=lambda known: (abs(known - tokens), known))
        return self._per_row[nearest] * tokens / nearest

    def figures(self) -> dict[str, float]:
        return {str(tokens): seconds for tokens, seconds in sorted(self._per_row.items())}


@dataclass
class Pacing:
    """One real-time session's deadlines and lateness (engine thread)."""

    fps: float
    temporal: int  # pixel frames per latent frame
    # (frame_end, arrived_at): frames below frame_end (and above the previous entry's) arrived at arrived_at.
    arrivals: deque = field(default_factory=deque)
    blocks: int = 0
    late_blocks: int = 0
    last_lateness_s: float | None = None
    worst_lateness_s: float | None = None

    def playback_seconds(self, frames: int) -> float:
        return frames * self.temporal / self.fps

    def arrived(self, frame_end: int, at: float) -> None:
        # Frames at or past frame_end that are still listed were rolled back (a failed atomic chunk) and are being
        # sent again: their arrival is this one.
        while self.arrivals and self.arrivals[-1][0] >= frame_end:
            self.arrivals.pop()
        self.arrivals.append((frame_end, at))

    def arrival_of(self, frame: int) -> float | None:
        for frame_end, at in self.arrivals:
            if frame < frame_end:
                return at
        return None

    def committed(self, frame_start: int, frame_end: int, at: float) -> float | None:
        """Account a block ``[frame_start, frame_end)`` committed at ``at``; its lateness (negative: early)."""
        arrived = self.arrival_of(frame_end - 1)
        if arrived is None:  # its frames came in before pacing started (an adopted session): no deadline known
            return None
        lateness = at - (arrived + self.playback_seconds(frame_end - frame_start))
        while self.arrivals and self.arrivals[0][0] <= frame_end:
            self.arrivals.popleft()  # every frame it covers is refined
        self.blocks += 1
        self.last_lateness_s = lateness
        self.worst_lateness_s = lateness if self.worst_lateness_s is None else max(self.worst_lateness_s, lateness)
        if lateness > 0:
            self.late_blocks += 1
        return lateness

    def checkpoint(self) -> tuple:
        """Everything ``committed`` changes, to put back with ``restore`` (an undone block)."""
        return (tuple(self.arrivals), self.blocks, self.late_blocks, self.last_lateness_s, self.worst_lateness_s)

    def restore(self, checkpoint: tuple) -> None:
        arrivals, self.blocks, self.late_blocks, self.last_lateness_s, self.worst_lateness_s = checkpoint
        self.arrivals = deque(arrivals)

    def status(self) -> dict[str, Any]:
        return {
            "late_blocks": self.late_blocks,
            "paced_blocks": self.blocks,
            "last_lateness_s": self.last_lateness_s,
            "worst_lateness_s": self.worst_lateness_s,
        }


@dataclass(frozen=True)
class PacedBlock:
    """A paced block as ``Pacer.committed`` accounted it: its lateness, and its session's pacing from before it
    (what ``Pacer.undo`` restores)."""

    pacing: Pacing
    before: tuple  # Pacing.checkpoint()
    lateness: float


class Pacer:
    """The engine's side: the cost model and the lateness counters. Engine thread, except ``load`` readers (plain
    float reads, safe from the loop)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 on_late: Callable[[float], None] | None = None,
                 on_paced: Callable[[float], None] | None = None):
        self.clock = clock
        self.cost = CostModel()
        self._on_late = on_late
        self._on_paced = on_paced

    def observed_call(self, tokens: int, rows: int, seconds: float) -> None:
        self.cost.observe(tokens, rows, seconds)

    def arrived(self, pacing: Pacing | None, frame_end: int, at: float) -> None:
        if pacing is not None:
            pacing.arrived(frame_end, at)

    def committed(self, pacing: Pacing | None, kind: str, frame_start: int, frame_end: int,
                  verdict_pending: bool = False) -> PacedBlock | None:
        """Account a committed unit; a block of a real-time session with a known deadline gives a ``PacedBlock``.
        ``verdict_pending``: its NaN/Inf verdict is not read yet, so the metrics wait for ``confirm`` (or ``undo``)."""
        if pacing is None or kind != "block":
            return None
        before = pacing.checkpoint()
        lateness = pacing.committed(frame_start, frame_end, self.clock())
        if lateness is None:
            return None
        block = PacedBlock(pacing, before, lateness)
        if not verdict_pending:
            self.confirm(block)
        return block

    def confirm(self, block: PacedBlock | None) -> None:
        """The block stays (its verdict was finite, or there was none to wait for): count it in the metrics."""
        if block is None:
            return
        if self._on_paced is not None:
            self._on_paced(block.lateness)
        if block.lateness > 0 and self._on_late is not None:
            self._on_late(block.lateness)

    def undo(self, block: PacedBlock | None) -> None:
        """The block was undone (a late NaN/Inf verdict): its session's pacing as if it had never been committed.
        It is the session's last paced block (the verdict gate holds every later forward), so nothing after it is
        lost."""
        if block is not None:
            block.pacing.restore(block.before)


# --- admission -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Demand:
    """What a real-time session asks of the engine per block."""

    forwards: int  # per block: the denoising steps + the commit
    rows: int  # its batch B
    tokens: int  # tokens per row of a block forward
    block_seconds: float  # the block's playback time
    known: bool = True  # False: its geometry is the warm-up's guess

    def load(self, cost: CostModel) -> float | None:
        per_row = cost.per_row(self.tokens)
        return None if per_row is None else self.forwards * self.rows * per_row / self.block_seconds


def demand(config, temporal: int, geometry=None, guess: tuple[int, int] = (1, 1)) -> Demand:
    """A session's demand from its config (``models.SessionConfig``) and geometry (``models.session.Geometry``; None
    before its first chunk: ``guess`` is (height, width) in latents, batch 1)."""
    rows, tokens_per_frame, known = (1, guess[0] * guess[1], False) if geometry is None else (
        geometry.batch, geometry.tokens_per_frame, True)
    return Demand(config.steps + 1, rows, config.block_size * tokens_per_frame,
                  config.block_size * temporal / config.fps, known)


def check_admission(cost: CostModel, held: Iterable[Demand], new: Demand, max_load: float,
                    retry_after_s: int | None = None) -> None:
    """ApiError 503 ``over_capacity`` when the held real-time sessions plus ``new`` would need more than
    ``max_load`` of the engine's time by the measured cost; the message names the figures."""
    new_load = new.load(cost)
    if new_load is None:
        return  # nothing measured yet
    held = list(held)
    loads = [d.load(cost) or 0.0 for d in held]
    total = sum(loads) + new_load
    if total <= max_load:
        return
    per_row = cost.per_row(new.tokens)
    raise ApiError(
        "over_capacity",
        f"a new real-time session would not keep up: the {len(held)} real-time session(s) held need "
        f"{sum(loads):.2f} s of model time per second of video and this one {new_load:.2f} s ({new.forwards} forwards "
        f"per {new.block_seconds:.3g} s block x {new.rows} row(s) x {per_row * 1000:.1f} ms measured per row at "
        f"{new.tokens} tokens{'' if new.known else ', costed at the warm-up geometry'}), {total:.2f} in all, over "
        f"this server's admission_max_load of {max_load:g}; retry after the Retry-After seconds (a real-time session "
        "may have ended), use another replica, or create the session with realtime false (no deadline, admitted by "
        "count)",
        retry_after_s=retry_after_s,
        fields={"load_held": round(sum(loads), 4), "load_needed": round(new_load, 4), "max_load": max_load},
    )


# --- the session's flag ----------------------------------------------------------------------------------------------
def take_flags(fields: dict[str, Any]) -> dict[str, Any]:
    """Pop the session's service flags (``spec.FLAGS``: ``realtime``) from a client's checked fields, defaults
    filled in; what is left is the model's config and the outputs."""
    return {"realtime": bool(fields.pop("realtime", False))}


def flags_of(handle) -> dict[str, Any]:
    """A held session's flags, as ``take_flags`` gives them (a handle of ``app.sessions.registry``)."""
    return {"realtime": handle.engine_session.pacing is not None}


def status(engine_session) -> dict[str, Any]:
    """What a session's JSON says about its pacing: ``late_blocks`` and the lateness figures (null when it is not
    real time)."""
    pacing = engine_session.pacing
    if pacing is None:
        return {"late_blocks": None, "paced_blocks": None, "last_lateness_s": None, "worst_lateness_s": None}
    return pacing.status()


def temporal_of(model) -> int:
    """Pixel frames per latent frame: the refiner config's ``vae_scale_factors[0]`` (8 for LTX-2)."""
    factors = getattr(model.config, "vae_scale_factors", None) or (8, 32, 32)
    return int(factors[0])


class Admission:
    """The store's real-time check (setting ``admission``), one call from ``SessionStore.admit``."""

    def __init__(self, settings, pacer: Pacer, handles: Callable[[], list], refiner: Callable[[], Any]):
        self.settings = settings
        self.pacer = pacer
        self._handles = handles
        self._refiner = refiner

    @property
    def enabled(self) -> bool:
        return self.settings.admission == "realtime"

    def demand_of(self, config, geometry=None) -> Demand:
        refiner = self._refiner()
        temporal = 8 if refiner is None else temporal_of(refiner.model)
        guess = (self.settings.warmup_height, self.settings.warmup_width)
        return demand(config, temporal, geometry, guess)

    def held(self) -> list[Demand]:
        return [self.demand_of(h.config, h.session.state.geometry) for h in self._handles()
                if h.engine_session.pacing is not None]

    def check(self, realtime_config=None) -> None:
        """Refuse a new real-time session (``realtime_config``: its config; None: not real time, always let
        through) that would make the held real-time sessions miss their deadlines."""
        if not self.enabled or realtime_config is None:
            return
        check_admission(self.pacer.cost, self.held(), self.demand_of(realtime_config),
                        self.settings.admission_max_load, self.settings.retry_after_s)

    def pacing(self, config) -> Pacing:
        refiner = self._refiner()
        return Pacing(config.fps, 8 if refiner is None else temporal_of(refiner.model))

    def figures(self) -> dict[str, Any]:
        """``/v1/info``'s view: the setting, the measured cost per row, the load of the held real-time sessions."""
        held = self.held()
        loads = [d.load(self.pacer.cost) for d in held]
        return {
            "admission": self.settings.admission,
            "admission_max_load": self.settings.admission_max_load,
            "realtime_sessions": len(held),
            "realtime_load": None if any(x is None for x in loads) else sum(loads),
            "seconds_per_row_by_tokens": self.pacer.cost.figures(),
        }
