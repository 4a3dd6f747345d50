"""The engine: one worker thread owns the refiner and runs every forward.

Routes build a job, ``submit`` it and await the returned asyncio future; the engine resolves it from its thread
with ``loop.call_soon_threadsafe``. Nothing else calls into ``models``' compute, so no two forwards ever touch
the model at once and the event loop never blocks on torch.

Work is organised in lanes. A lane is one ordered stream of jobs over one ``RefinerSession``: a client
session, a one-shot clip, or the warm-up. Jobs of a lane run strictly in order; lanes with work take turns,
one step (the sink capture or one block) per turn, so a long clip or a busy stream cannot starve the others.

Each engine iteration is plan -> execute -> commit, with typed records between the steps:

    schedule() -> list[ScheduledStep]   which lanes step now, and the StepPlan of each (bookkeeping only)
    execute(steps) -> list[StepOutput]  the forwards; touches no session state
    commit(outputs)                     session states advance, units are delivered, jobs finish

Today a schedule holds one step; batching blocks of several sessions into one forward plugs in at ``execute``
without changing the routes or the sessions.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from models.clip import check_clip_length
from models.session import RefinerSession, SessionState, StepPlan, StepResult, Unit

from .errors import ApiError
from .metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Lane:
    """An ordered stream of jobs over one session. The seq fields are written only by the engine thread."""

    session: RefinerSession
    name: str = ""
    record_metrics: bool = True
    next_seq: int = 0
    last_seq: int | None = None
    last_response: Any = None
    # Set (from the event loop) when the session is deleted or evicted: queued jobs then fail with it.
    closed: ApiError | None = None
    first_block_done: bool = False
    # Engine-thread only: the jobs waiting or running, oldest first.
    jobs: deque = field(default_factory=deque)
    # Guarded by the engine's lock: jobs submitted and not yet settled.
    queued: int = 0


@dataclass(eq=False)
class ChunkJob:
    """Append one chunk to a lane's session and refine every step it makes possible.

    ``atomic`` (HTTP): all or nothing; on any failure the session goes back to its state before the job and
    the seq is not used up. Otherwise (WebSocket) each unit is final once committed and handed to ``on_unit``
    at once; a failing step leaves the session as it was before that step.
    ``finalize(units, state)`` runs in the engine thread when the job is done and builds its result (e.g. the
    response bytes, stored for a repeated seq). ``on_unit`` also runs in the engine thread: it must not block.
    """

    lane: Lane
    latents: torch.Tensor | None
    prompt_embeds: torch.Tensor | None = None
    prompt_attention_mask: torch.Tensor | None = None
    flush: bool = False
    seq: int | None = None
    atomic: bool = True
    one_shot: bool = False  # a whole clip (/v1/refine): must have more frames than the sink
    on_unit: Callable[[Unit], None] | None = None
    finalize: Callable[[list[Unit], SessionState], Any] | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    # Engine-side progress.
    started: bool = False
    before: SessionState | None = None
    units: list[Unit] = field(default_factory=list)
    frames_in: int = 0
    future: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None


@dataclass(frozen=True)
class JobResult:
    value: Any
    replayed: bool = False


@dataclass(frozen=True)
class ScheduledStep:
    job: ChunkJob
    plan: StepPlan


@dataclass(frozen=True)
class StepOutput:
    step: ScheduledStep
    result: StepResult | None
    error: BaseException | None
    seconds: float


@dataclass(eq=False)
class _CallJob:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class Engine:
    def __init__(self, metrics: Metrics, queue_depth: int, lane_depth: int):
        self.metrics = metrics
        self.queue_depth = queue_depth
        self.lane_depth = lane_depth
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._outstanding = 0
        self._accepting = True
        self._stopping = False
        self._ring: deque[Lane] = deque()  # engine thread only: lanes with jobs, in turn order
        self._thread: threading.Thread | None = None

    # --- event-loop side ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="refiner-engine", daemon=True)
        self._thread.start()

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def submit(self, job: ChunkJob) -> asyncio.Future:
        """Queue a job; raises ApiError (503) at once when the engine or the lane is full or draining."""
        loop = asyncio.get_running_loop()
        job.loop, job.future = loop, loop.create_future()
        with self._cond:
            if not self._accepting:
                raise ApiError("draining", "the server is shutting down and takes no new work; retry after restart")
            if self._outstanding >= self.queue_depth:
                raise ApiError(
                    "engine_busy",
                    f"the engine already has {self._outstanding} jobs queued (engine_queue_depth); retry shortly",
                )
            if job.lane.queued >= self.lane_depth:
                raise ApiError(
                    "engine_busy",
                    f"this session already has {job.lane.queued} chunks queued (session_queue_depth); wait for "
                    "their responses before sending more",
                )
            self._outstanding += 1
            job.lane.queued += 1
            self._inbox.append(job)
            self._cond.notify()
        return job.future

    async def run(self, job: ChunkJob) -> JobResult:
        return await self.submit(job)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread (loading the model, a test's hook); not counted against the queue."""
        loop = asyncio.get_running_loop()
        job = _CallJob(fn, loop.create_future(), loop)
        with self._cond:
            if self._stopping:
                raise ApiError("draining", "the engine has stopped")
            self._inbox.append(job)
            self._cond.notify()
        return await job.future

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every submitted job has settled; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while self._outstanding and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self._outstanding == 0

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # --- engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        # The model has requires_grad off, but no_grad also keeps new session tensors (K/V, noise) graph-free.
        with torch.no_grad():
            while True:
                with self._cond:
                    while not self._inbox and not self._ring and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        self._fail_everything()
                        return
                    inbox = list(self._inbox)
                    self._inbox.clear()
                for job in inbox:
                    self._admit(job)
                steps = self.schedule()
                if steps:
                    self.commit(self.execute(steps))

    def _admit(self, job) -> None:
        if isinstance(job, _CallJob):
            try:
                value = job.fn()
            except BaseException as exc:  # handed to the awaiting coroutine, which decides
                _resolve(job.loop, job.future, None, exc)
            else:
                _resolve(job.loop, job.future, value, None)
            return
        lane = job.lane
        lane.jobs.append(job)
        if len(lane.jobs) == 1:
            self._ring.append(lane)

    def schedule(self) -> list[ScheduledStep]:
        """The next step in round-robin order over lanes with work; jobs that need no forward finish here."""
        for _ in range(len(self._ring)):
            lane = self._ring.popleft()
            step = self._next_step(lane)
            if lane.jobs:
                self._ring.append(lane)
            if step is not None:
                return [step]
        return []

    def execute(self, steps: list[ScheduledStep]) -> list[StepOutput]:
        outputs = []
        for step in steps:
            started = time.perf_counter()
            try:
                result, error = step.job.lane.session.execute(step.plan), None
            except Exception as exc:  # reported to that job only; other lanes never notice
                result, error = None, exc
            outputs.append(StepOutput(step, result, error, time.perf_counter() - started))
        return outputs

    def commit(self, outputs: list[StepOutput]) -> None:
        for output in outputs:
            job = output.step.job
            lane = job.lane
            if output.error is not None:
                log.warning("step %s of %s failed: %r", output.step.plan, lane.name, output.error)
                self._fail(job, output.error)
                continue
            try:
                unit = lane.session.commit(output.result)
            except Exception as exc:
                self._fail(job, exc)
                continue
            job.units.append(unit)
            if unit.kind == "block" and lane.record_metrics:
                self.metrics.block_latency.observe(output.seconds)
                if not lane.first_block_done:
                    lane.first_block_done = True
                    self.metrics.time_to_first_block.observe(time.perf_counter() - job.submitted_at)
            if not job.atomic:
                self._count_out([unit], lane)
                if job.on_unit is not None:
                    try:
                        job.on_unit(unit)
                    except Exception:  # a delivery bug must not take the engine down
                        log.exception("delivering a unit of %s failed", lane.name)

    # --- job lifecycle (engine thread) ---------------------------------------------------------------------
    def _next_step(self, lane: Lane) -> ScheduledStep | None:
        while lane.jobs:
            job: ChunkJob = lane.jobs[0]
            if not job.started and not self._start(job):
                continue
            if lane.closed is not None:
                self._fail(job, lane.closed)
                continue
            try:
                plan = lane.session.plan()
            except Exception as exc:
                self._fail(job, exc)
                continue
            if plan is None:
                self._finish(job)
                continue
            return ScheduledStep(job, plan)
        return None

    def _start(self, job: ChunkJob) -> bool:
        """Check and append the job's chunk; False when the job already settled (rejected or replayed)."""
        lane = job.lane
        if lane.closed is not None:
            self._settle(job, error=lane.closed)
            return False
        if job.seq is not None:
            if job.seq == lane.last_seq and lane.last_response is not None:
                self._settle(job, JobResult(lane.last_response, replayed=True))
                return False
            if job.seq != lane.next_seq:
                again = f", or seq={lane.last_seq} to get the last response again" if lane.last_seq is not None else ""
                self._settle(
                    job,
                    error=ApiError(
                        "seq_conflict",
                        f"seq={job.seq} is out of order: this session expects seq={lane.next_seq} next{again}",
                    ),
                )
                return False
        session = lane.session
        job.before = session.state
        try:
            latents = job.latents
            if latents is None and job.flush:
                latents = session.empty_latents()
            if job.one_shot:
                check_clip_length(latents, session.config)
            chunk = session.check(latents, job.prompt_embeds, job.prompt_attention_mask)
            session.append(chunk, flush=job.flush)
        except Exception as exc:
            session.restore(job.before)
            self._settle(job, error=exc)
            return False
        job.started = True
        job.frames_in = chunk.frames
        # Release the request's tensors: the session holds its own (cast) copy now.
        job.latents = job.prompt_embeds = job.prompt_attention_mask = None
        if not job.atomic:
            lane.next_seq += 1
            if lane.record_metrics:
                self.metrics.frames_in.inc(job.frames_in)
        return True

    def _finish(self, job: ChunkJob) -> None:
        lane = job.lane
        try:
            value = job.finalize(job.units, lane.session.state) if job.finalize else job.units
        except Exception as exc:
            self._fail(job, exc)
            return
        if job.atomic:
            lane.next_seq += 1
            lane.last_seq = job.seq
            lane.last_response = value if job.seq is not None else None
            if lane.record_metrics:
                self.metrics.frames_in.inc(job.frames_in)
                self._count_out(job.units, lane)
        self._settle(job, JobResult(value))

    def _fail(self, job: ChunkJob, error: BaseException) -> None:
        if job.atomic and job.before is not None:
            job.lane.session.restore(job.before)
        self._settle(job, error=error)

    def _count_out(self, units: list[Unit], lane: Lane) -> None:
        if not lane.record_metrics:
            return
        for unit in units:
            self.metrics.frames_out.inc(unit.frame_end - unit.frame_start)
            if unit.kind == "block":
                self.metrics.blocks_refined.inc()

    def _settle(self, job: ChunkJob, value: Any = None, error: BaseException | None = None) -> None:
        lane = job.lane
        if lane.jobs and lane.jobs[0] is job:
            lane.jobs.popleft()
        with self._cond:
            self._outstanding -= 1
            lane.queued -= 1
        _resolve(job.loop, job.future, value, error)

    def _fail_everything(self) -> None:
        stopped = ApiError("draining", "the server stopped before this work ran; retry after restart")
        for job in list(self._inbox):
            if isinstance(job, _CallJob):
                _resolve(job.loop, job.future, None, stopped)
            else:
                self._outstanding -= 1
                job.lane.queued -= 1
                _resolve(job.loop, job.future, None, stopped)
        self._inbox.clear()
        for lane in self._ring:
            while lane.jobs:
                job = lane.jobs.popleft()
                if job.atomic and job.before is not None:
                    lane.session.restore(job.before)
                self._outstanding -= 1
                lane.queued -= 1
                _resolve(job.loop, job.future, None, stopped)
        self._ring.clear()


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any, error: BaseException | None):
    def settle() -> None:
        if future.done():  # the awaiting request was cancelled (client went away); the work still counts
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop already closed at shutdown: nobody is waiting any more
        pass
