"""The engine: one worker thread owns the refiner, schedules forwards (not blocks) and batches them.

Routes build ``Work`` (frames to append to a session and refine as far as they allow), ``submit`` it and await
the returned asyncio future; the engine resolves it from its thread with ``loop.call_soon_threadsafe``. Nothing
else calls into ``models``' compute, so no two forwards ever touch the model at once and the event loop never
blocks on torch. The engine knows sessions and forwards only: sequence numbers, replays, streams and encoding
belong to the service layer (``app.sessions.chunk_log``, ``app.outputs.delivery``).

A session with work is in the *ring*. Each iteration is plan -> execute -> commit, with typed records between:

    schedule() -> Batch | None      every session in the ring advanced to its next forward (or settled); the
                                    scheduler (``app.engine.scheduler``, pure policy) picks which of them form the
                                    call: the first one and the following ones of the same group (tokens per
                                    row) up to max_batch_rows rows (bookkeeping only, no compute)
    execute(batch) -> BatchResult   one model call; if it fails, each forward alone, so that only a session
                                    whose own forward fails gets an error
    commit(result)                  each run takes its velocity; finished runs are committed, their units handed
                                    on, work that is done is resolved

Sessions served in an iteration move to the back of the ring, so a session of another group goes first next
time (no starvation), and a session's next forward joins the very next iteration after its previous one
committed: nobody waits for a batch to fill. With batching off every model call holds one session.

Failure: a forward that fails drops its session's block in flight (nothing committed changes). *Atomic* work
(an HTTP chunk, a clip) is all or nothing: the session returns to its checkpoint from before the work. Other
work (a WebSocket message) keeps the blocks it committed and its frames stay pending, so the next message
retries the block; unless the block refined to NaN/Inf, which retrying would only repeat: then the frames not yet
refined are dropped (``_drop_unrefined``).

Late verdicts: on an accelerator a block's finite verdict is not read at commit (that read would wait for the
device; ``models.session.FiniteCheck``), so the block is committed, its unit handed on, and the verdict's host copy
queued behind it. Its session then waits at a *gate* (``PendingVerdict``): none of its forwards is scheduled until
the verdict is in (an event query, never a wait while other sessions have forwards to run), and none of its work
settles before. A finite block releases its rollback point; a NaN/Inf block is undone (``_withdraw``: the session
back to its checkpoint from just before the commit, the block's output step dropped or its stages restored, its
unit taken out of the work's result and listed in ``Work.withdrawn`` so delivery forgets it, its real-time pacing
as if it had not run: ``Pacer.undo``) and its work fails as the commit's own error would have failed it on a CPU.
Atomic work takes no checkpoint per block: its own, from before the work, undoes the block with the rest of the
work when it fails. The cost: a session's next block is
launched only once its previous block ran on the device (other sessions fill that gap), plus, on a stream, a
rollback copy of the history frames a full history drops per block.

Outputs: each committed unit goes through the session's output stages (``app.outputs.stage``: latents, video, ...),
which the engine runs without knowing their kinds, and is handed on as an ``OutUnit`` (the unit and each stage's
payload). A session with a *deferred* stage (the video's decode) does not get its unit handed on at once: it is
queued for an *output step*, which the engine runs between model calls, one pending unit of each such session per
iteration, in turn order (the scheduler's ``plan_outputs``). Meanwhile the session's next block already runs (its
refine does not wait for the previous block's decode), and another session's forwards are never delayed by more
than one output step per such session. The stages' states are the session's like its KV cache: immutable, so the
checkpoint of atomic work simply keeps the old ones. A work is finished once its units went through its stages; a
flush that refined no block still finishes the stages' tail (a ``"tail"`` unit without latent frames). On a CUDA
device the decode's kernels queue behind the model call's, without a host sync, like every other step.

Errors the engine raises itself are its own types (``app.engine.engine_errors``: ``Draining``, ``EngineBusy``,
``OutputFailed``); ``app.core.error_kinds`` maps them to what clients see. A session's ``closed`` error is whatever its closer
gave (the registry's 404/410), raised as it is.

``pause`` (the drain) stops the engine between two iterations: blocks in flight are dropped, atomic work in
progress is rolled back, and every unfinished work fails with ``draining``; what stays in the sessions is exactly
what was committed, and every committed unit has been handed on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from models.clip import check_clip_length
from models.clock import CallClock
from models.errors import NonFiniteOutputError
from models.move import release_finished
from models.session import BlockRun, RefinerSession, SessionCheckpoint, SessionState, Unit
from models.step import RowForward, run_isolated
from models.transfer import use_device

from app.core.metrics import Metrics
from app.engine.batching import BatchingPolicy, Mode, ProbeShape
from app.engine.engine_errors import Draining, EngineBusy, EngineError, OutputFailed
from app.engine.pacing import PacedBlock, Pacer, Pacing
from app.engine.scheduler import ModelCall, Ready, Scheduler
from app.outputs.catalog import latents_only
from app.outputs.stage import OutputFailure, OutUnit, SessionStages

log = logging.getLogger(__name__)

# How often the engine thread looks at verdicts still on the device when it has nothing else to run (seconds).
VERDICT_POLL_S = 0.0005


@dataclass(eq=False)
class EngineSession:
    """A session as the engine holds it: the model-side session and its queue of work."""

    session: RefinerSession
    name: str = ""
    # Set from the event loop when the session is deleted or evicted (or by the engine when an output stage broke):
    # its queued work then fails with this error, whatever it is.
    closed: BaseException | None = None
    # Engine thread only.
    work: deque = field(default_factory=deque)
    run: BlockRun | None = None
    forward: RowForward | None = None  # the run's next forward, built once even if it waits several iterations
    checkpoint: SessionCheckpoint | None = None  # taken when atomic work starts
    # What its units go through on their way out (app.outputs.stage); states replaced by each push.
    stages: SessionStages = field(default_factory=latents_only)
    stages_checkpoint: dict | None = None  # with ``checkpoint``
    # Committed units waiting for their output step (deferred stages), in commit order: (unit or None for the
    # tail, final).
    pending_outputs: deque = field(default_factory=deque)
    # Guarded by the engine's lock: work submitted and not yet settled.
    queued: int = 0
    # A real-time session's deadlines and late blocks (app.engine.pacing); None when it is not real time.
    pacing: Pacing | None = None
    # The CUDA event of copies of its tensors on a side stream (a page-in's to the device, a crash checkpoint's to
    # the host: its cache is written in place): the engine's stream waits for it on the device before the
    # session's next work touches them (``wait_for``, first thing in
    # ``_next_forward``; a record read for saving waits too: ``app.sessions.saving``), so other sessions' calls
    # queued before do not.
    ready: Any = None
    # Its last committed block's finite verdict, not read yet (accelerators): the gate before its next forward.
    verdict: PendingVerdict | None = None


@dataclass(eq=False)
class PendingVerdict:
    """A committed block whose finite check (``FiniteCheck``, its host copy queued) is not read yet, and what undoes
    it: the session's checkpoint from just before the commit and, once its unit went through the output stages,
    their states from before that (``stages``)."""

    check: Any  # models.session.FiniteCheck
    before: SessionCheckpoint | None  # None in atomic work: its checkpoint from before the work undoes the block
    stages: dict | None = None
    paced: PacedBlock | None = None  # its pacing (real-time sessions): confirmed or undone with the verdict


@dataclass(eq=False)
class Work:
    """Append a chunk to a session and refine every step it makes possible.

    ``atomic``: all or nothing; on any failure the session goes back to its state before this work. Otherwise
    each unit is final once committed. ``on_unit`` runs on the engine thread for each committed unit: it must
    hand the unit on and return (no blocking, no encoding). Every committed unit is also in the result, so a
    hand-off that failed can be made good."""

    target: EngineSession
    latents: torch.Tensor | None
    prompt_embeds: torch.Tensor | None = None
    prompt_attention_mask: torch.Tensor | None = None
    flush: bool = False
    atomic: bool = False
    one_shot: bool = False  # a whole clip (/v1/refine): must have more frames than the sink
    # The service scanned the tensors for NaN/Inf before submitting (``models.session.check_finite``), so the
    # engine thread does not hold up other sessions' forwards with that scan.
    finite_checked: bool = False
    on_unit: Callable[[OutUnit], None] | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    # Engine-side progress; ``started`` means the chunk was checked and appended (accepted).
    started: bool = False
    units: list[OutUnit] = field(default_factory=list)
    hand_over_failed: bool = False
    frames_in: int = 0
    # Non-atomic work: the session's state before its chunk was appended, and whether a block that refined to
    # NaN/Inf made the session drop exactly this work's frames, nothing else (``_drop_unrefined``): then the
    # session is as if the work never came.
    base: SessionState | None = None
    rolled_back: bool = False
    # Units handed on (``on_unit``) whose block a late verdict found NaN/Inf and undid: not in ``units`` any more;
    # the service layer tells delivery to forget them, so the block's retry (same frames) is handed on again.
    withdrawn: list[OutUnit] = field(default_factory=list)
    future: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None


@dataclass(frozen=True)
class WorkResult:
    units: tuple[OutUnit, ...]
    frames_in: int
    state: SessionState
    # Where each output kind stands (say, video frames finalized so far): where an empty response stands.
    positions: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Scheduled:
    target: EngineSession
    forward: RowForward


@dataclass(frozen=True)
class Batch:
    members: tuple[Scheduled, ...]
    call: ModelCall | None = None  # the scheduler's plan it was built from, handed back once it ran

    @property
    def rows(self) -> int:
        return sum(member.forward.rows for member in self.members)


@dataclass(frozen=True)
class BatchResult:
    batch: Batch
    outcomes: tuple[torch.Tensor | Exception, ...]
    seconds: float  # wall time of issuing the call (its cost on a CPU; only the launches on CUDA: see ``clock``)


@dataclass(eq=False)
class _CallJob:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class Engine:
    def __init__(
        self,
        metrics: Metrics,
        queue_depth: int,
        session_depth: int,
        max_batch_rows: int = 8,
        batching: Mode = True,
    ):
        self.metrics = metrics
        self.queue_depth = queue_depth
        self.session_depth = session_depth
        self._model: torch.nn.Module | None = None  # set once the refiner is loaded (``model``)
        # Model calls' cost on the device's own clock (models.clock): wall time on a CPU, CUDA events on a GPU, read
        # without waiting for the GPU. It feeds /metrics' model_call_seconds and the real-time cost model.
        self.clock = CallClock("cpu")
        # The device the engine thread must make current before its next job (``_bind_device``); None: done.
        self._bind: torch.device | None = None
        # What runs a model call: models.step.run_batch, or a compiled step (models.compiled.CompiledStep).
        self.runner: Callable[[torch.nn.Module, list[RowForward]], list[torch.Tensor]] | None = None
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._outstanding = 0
        self._accepting = True
        self._paused = False
        self._stopping = False
        # Engine thread only: the policy (which forwards form a call, which output steps run); see app.engine.scheduler.
        # Which classes of model call may hold several sessions (the ``batching`` setting and the probe per class).
        self.policy = BatchingPolicy(batching)
        self.scheduler = Scheduler(max_batch_rows, batching is not False, batchable=self.policy.allows)
        # Real-time sessions' deadlines and the measured cost per row that admission reads (app.engine.pacing).
        self.pacer = Pacer(on_late=lambda _: metrics.late_blocks.inc(), on_paced=lambda _: metrics.paced_blocks.inc())
        self._thread: threading.Thread | None = None

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model

    @model.setter
    def model(self, model: torch.nn.Module | None) -> None:
        """The refiner's model. Its device becomes the engine thread's current device before the thread's next job
        (with ``device: cuda:1`` everything the thread queues without naming a device, events and streams included,
        must go to cuda:1, not to the process's default cuda:0), and the clock times calls on it."""
        self._model = model
        if model is None:
            return
        device = next(model.parameters()).device
        self.clock = CallClock(device)
        with self._cond:
            self._bind = device
            self._cond.notify()

    # --- event-loop side ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="refiner-engine", daemon=True)
        self._thread.start()

    @property
    def max_batch_rows(self) -> int:
        return self.scheduler.max_batch_rows

    @property
    def batching(self) -> bool:
        """Whether model calls may hold several sessions now (for at least one class)."""
        return self.policy.batching

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def submit(self, work: Work) -> asyncio.Future:
        """Queue work; raises ``Draining`` or ``EngineBusy`` at once when the engine is draining or the engine or
        the session is full."""
        loop = asyncio.get_running_loop()
        work.loop, work.future = loop, loop.create_future()
        target = work.target
        with self._cond:
            if not self._accepting:
                raise Draining("the server is shutting down and takes no new work; retry after restart")
            if self._outstanding >= self.queue_depth:
                raise EngineBusy("engine", self._outstanding)
            if target.queued >= self.session_depth:
                raise EngineBusy("session", target.queued)
            self._outstanding += 1
            target.queued += 1
            self._inbox.append(work)
            self._cond.notify()
        return work.future

    async def run(self, work: Work) -> WorkResult:
        return await self.submit(work)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between two iterations (loading the model, saving sessions, a test's
        hook); not counted against the queue, and run even while paused."""
        loop = asyncio.get_running_loop()
        job = _CallJob(fn, loop.create_future(), loop)
        with self._cond:
            if self._stopping:
                raise Draining("the engine has stopped")
            self._inbox.append(job)
            self._cond.notify()
        return await job.future

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every submitted work has settled; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while self._outstanding and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self._outstanding == 0

    async def pause(self) -> int:
        """Stop running forwards for good (the drain): takes no new work; between two iterations drops the blocks
        in flight, rolls back atomic work in progress and fails every unfinished work with ``draining``. Returns
        how many works it failed. Afterwards only ``call`` jobs run."""
        self.stop_accepting()
        return await self.call(self._pause_now)

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
            while self._turn():
                pass

    def _turn(self) -> bool:
        """One turn of the engine thread: wait for something to do, admit what came, run what is due; False once
        stopping. A call of its own so that what a turn held (the work it admitted, the batch it ran) goes when it
        ends: kept in the loop's locals while the thread waited for the next, the last work's session (its KV cache,
        device memory on CUDA) stayed referenced after it was deleted, until other work came."""
        with self._cond:
            while (not self._inbox and (not self.scheduler.ring or self._paused) and not self._stopping
                   and not (self.policy.pending and not self._paused) and self._bind is None):
                self._cond.wait()
            if self._stopping:
                self._fail_everything(Draining("the server stopped before this work ran; retry after restart"))
                return False
            inbox = list(self._inbox)
            self._inbox.clear()
            bind, self._bind = self._bind, None
        if bind is not None:
            use_device(bind)
        for item in inbox:
            self._admit(item)
        if self._paused:
            return True
        batch = self.schedule()
        if batch is not None:
            self.commit(self.execute(batch))
        if self.scheduler.outputs_pending:
            self.output_step()
        elif batch is None and self.policy.pending:
            self._probe(None)  # idle: probe a class seen for the first time
        elif batch is None and any(t.verdict is not None for t in self.scheduler.ring):
            # Nothing to run but sessions at their verdict gate (their blocks still on the device): look again
            # shortly, or at once when work arrives, rather than spin or wait for one device event.
            with self._cond:
                if not self._inbox and not self._stopping:
                    self._cond.wait(VERDICT_POLL_S)
        return True

    def _admit(self, item) -> None:
        if isinstance(item, _CallJob):
            try:
                value = item.fn()
            except BaseException as exc:  # handed to the awaiting coroutine, which decides
                _resolve(item.loop, item.future, None, exc)
            else:
                _resolve(item.loop, item.future, value, None)
            return
        if self._paused:
            self._settle(item, error=Draining("the server is shutting down and takes no new work; retry after "
                                              "restart"))
            return
        target = item.target
        target.work.append(item)
        self.scheduler.wake(target)

    def schedule(self) -> Batch | None:
        """Which forwards run next. The engine advances every session in the ring to its next forward (work that
        needs none settles here: rejected, replayed, done) and asks the scheduler which of them form the call."""
        ready: dict[EngineSession, RowForward] = {}
        for target in self.scheduler.ring:
            forward = self._next_forward(target)
            if forward is not None:
                ready[target] = forward
                if self.policy.unseen(forward.group):
                    self.policy.saw(forward.group, _probe_shape(target.session, forward))
            elif target.run is None and not target.work:
                self.scheduler.sleep(target)
        group = self.policy.wants_probe([forward.group for forward in ready.values()])
        if group is not None:
            self._probe(group)  # two sessions of a new class ready: batching would pay now
        call = self.scheduler.plan_call([Ready(target, f.rows, f.group) for target, f in ready.items()])
        if call is None:
            return None
        return Batch(tuple(Scheduled(target, ready[target]) for target in call.sessions), call)

    def _probe(self, group) -> None:
        try:
            self.policy.probe_next(group)
        except Exception:  # a probe that breaks leaves its class unbatched; the engine goes on
            log.exception("the batch-invariance probe failed to run")

    def execute(self, batch: Batch) -> BatchResult:
        started = time.perf_counter()
        for member in batch.members:
            wait_for(member.target)  # a no-op since ``_next_forward`` waited; kept as the last line of defence
        tokens = batch.members[0].forward.group[0] if batch.members else 0
        mark = self.clock.start((tokens, batch.rows))
        outcomes = run_isolated(self.model, [member.forward for member in batch.members], self.runner)
        if any(isinstance(o, Exception) for o in outcomes):
            mark.tag = None  # timed for /metrics, but a call that failed (and reran alone) is no cost per row
        self.clock.stop(mark)
        seconds = time.perf_counter() - started
        if batch.call is not None:
            self.scheduler.served(batch.call)
        self.metrics.batch_rows.observe(batch.rows)
        return BatchResult(batch, tuple(outcomes), seconds)

    def observe_calls(self) -> None:
        """Feed the calls the clock has measured since the last look (on CUDA: those the GPU finished; never waits)
        to /metrics and the real-time cost model."""
        release_finished()  # page-ins' host buffers whose copies are done (models.move)
        for tag, seconds in self.clock.finished():
            self.metrics.model_call_seconds.observe(seconds)
            if tag is not None and tag[0] > 0:
                self.pacer.observed_call(tag[0], tag[1], seconds)

    def commit(self, result: BatchResult) -> None:
        self.observe_calls()
        for member, outcome in zip(result.batch.members, result.outcomes):
            target = member.target
            work = target.work[0]
            if isinstance(outcome, Exception):
                log.warning("a forward of %s failed: %r", target.name, outcome)
                self._fail(work, outcome)
                continue
            try:
                target.session.advance(target.run, outcome)
            except Exception as exc:
                self._fail(work, exc)
                continue
            target.forward = None
            if target.run.finished:
                self._commit_run(target)

    def output_step(self) -> None:
        """The oldest pending output step of every session the scheduler names (each that has one, in turn)."""
        started = time.perf_counter()
        for target in self.scheduler.plan_outputs():
            self._output_one(target)
        self.metrics.decode_seconds.observe(time.perf_counter() - started)

    def _queue_output(self, target: EngineSession, unit: Unit | None, final: bool) -> None:
        target.pending_outputs.append((unit, final))
        self.scheduler.output_pending(target)
        if not target.stages.deferred:  # cheap stages run within the commit
            self._output_now(target)

    def _output_one(self, target: EngineSession) -> None:
        unit, final = target.pending_outputs.popleft()
        if not target.pending_outputs:
            self.scheduler.output_idle(target)
        work: Work = target.work[0]
        verdict = target.verdict
        if verdict is not None and unit is not None and unit.check is verdict.check:
            verdict.stages = target.stages.checkpoint()  # what undoing this block restores (states are immutable)
        try:
            if unit is None:  # the tail a flush completes after the last block
                state = target.session.state
                out = target.stages.finish(target.session.empty_latents(), state.frames_returned, time.perf_counter())
            else:
                out = target.stages.push(unit, final)
        except OutputFailure as failure:
            log.exception("%s (a unit of %s) failed", failure.stage.action, target.name)
            self._output_failed(target, work, failure)
            return
        except Exception as exc:  # not a stage's (the tail's empty latents): the work fails, the stages are intact
            self._drop_outputs(target)
            self._fail(work, exc)
            return
        self._deliver(work, out)

    def _output_failed(self, target: EngineSession, work: Work, failure: OutputFailure) -> None:
        self._drop_outputs(target)
        if not work.atomic:
            # Its refined frames are committed but the stage lost its place in the stream: it cannot go on.
            target.closed = OutputFailed(failure.stage.kind, failure.stage.action, failure.cause,
                                         target.session.state.frames_returned)
        self._fail(work, failure.cause)

    def _drop_outputs(self, target: EngineSession) -> None:
        target.pending_outputs.clear()
        self.scheduler.output_idle(target)

    def _output_now(self, target: EngineSession) -> None:
        """Every pending output step of ``target`` at once (before its work settles or the engine pauses)."""
        while target.pending_outputs:
            self._output_one(target)

    # --- work lifecycle (engine thread) ----------------------------------------------------------------------
    def _next_forward(self, target: EngineSession) -> RowForward | None:
        session = target.session
        # A session paged in on a side stream: the engine's stream waits for its copies (on the device, no host
        # wait) before anything of it runs there, and the first thing may be appending a chunk to its paged-in
        # pending frames (``_start``) or rotating its paged-in sink keys (``session.start``), not a model call.
        wait_for(target)
        while True:
            if target.verdict is not None:  # the gate: its last block's verdict first
                if not target.verdict.check.ready():
                    return None  # still on the device: other sessions go on meanwhile
                error = self._read_verdict(target)
                if error is not None and target.work:
                    self._fail(target.work[0], error)
                continue
            if target.run is not None:
                if target.forward is None:
                    try:
                        target.forward = session.next_forward(target.run)
                    except Exception as exc:  # this session's problem: its work fails, the engine goes on
                        self._fail(target.work[0], exc)
                        continue
                if target.forward is not None:
                    return target.forward
                self._commit_run(target)  # a run with no forwards (a sink too short to refine)
                continue
            if not target.work:
                return None
            work: Work = target.work[0]
            if target.closed is not None:
                self._fail(work, target.closed)
                continue
            if not work.started and not self._start(work):
                continue
            try:
                plan = session.plan()
                if plan is None:
                    if self._outputs_unfinished(target, work):
                        if target.work and target.work[0] is work:
                            return None  # its output steps finish it
                        continue  # an output step failed and settled it
                    self._finish(work)
                    continue
                target.run = session.start(plan)
            except Exception as exc:
                self._fail(work, exc)

    def _outputs_unfinished(self, target: EngineSession, work: Work) -> bool:
        """Whether ``work`` (which has nothing left to refine) still waits for output steps, or had them run now;
        a flush queues the stages' tail."""
        if work.flush and not target.stages.done and not any(final for _, final in target.pending_outputs):
            self._queue_output(target, None, final=True)
            if not target.stages.deferred:
                return not (target.work and target.work[0] is work)
        return bool(target.pending_outputs)

    def _start(self, work: Work) -> bool:
        """Check and append the work's chunk; False when the work was refused (and settled)."""
        target = work.target
        session = target.session
        if work.atomic:
            target.checkpoint = session.checkpoint()
            target.stages_checkpoint = target.stages.checkpoint()
        try:
            latents = work.latents
            if latents is None and work.flush:
                latents = session.empty_latents()
            if work.one_shot:
                check_clip_length(latents, session.config)
            chunk = session.check(latents, work.prompt_embeds, work.prompt_attention_mask,
                                  finite_checked=work.finite_checked)
            if not work.atomic and not work.one_shot:
                work.base = session.state
            session.append(chunk, flush=work.flush)
        except Exception as exc:
            self._fail(work, exc)
            return False
        work.started = True
        work.frames_in = chunk.frames
        self.pacer.arrived(target.pacing, session.state.frames_received, work.submitted_at)
        # Release the request's tensors: the session holds its own (device) copy now.
        work.latents = work.prompt_embeds = work.prompt_attention_mask = None
        return True

    def _commit_run(self, target: EngineSession) -> None:
        run, target.run = target.run, None
        work: Work = target.work[0]
        session = target.session
        # A commit that leaves its verdict unread needs a way back to just before it (``_withdraw``), unless its
        # work is atomic: then the work's own checkpoint undoes it (and no second copy of the history is saved).
        defers = run.modes and session.defers_finite_check and target.checkpoint is None
        before = session.checkpoint() if defers else None
        try:
            unit = session.commit(run)
        except Exception as exc:
            if before is not None:
                session.rollback(before)
            self._fail(work, exc)
            return
        paced = self.pacer.committed(target.pacing, unit.kind, unit.frame_start, unit.frame_end,
                                     verdict_pending=unit.check is not None)
        if unit.check is not None:
            target.verdict = PendingVerdict(unit.check, before, paced=paced)
        elif before is not None:
            session.release(before)
        state = target.session.state
        self._queue_output(target, unit, final=state.flushed and state.pending_frames == 0)

    def _deliver(self, work: Work, unit: OutUnit) -> None:
        work.units.append(unit)
        if work.on_unit is not None and not work.hand_over_failed:
            try:
                work.on_unit(unit)
            except Exception:
                # This unit and the work's later ones stay in its result, where the service layer picks them up
                # in order; handing the later ones on now would put them before this one.
                work.hand_over_failed = True
                log.exception("handing on a unit of %s failed; the rest of its units follow with the result",
                              work.target.name)

    def _finish(self, work: Work) -> None:
        target = work.target
        if work.atomic and target.checkpoint is not None:
            target.session.release(target.checkpoint)
            target.checkpoint = target.stages_checkpoint = None
        self._settle(work, WorkResult(tuple(work.units), work.frames_in, target.session.state,
                                      target.stages.positions()))

    def _read_verdict(self, target: EngineSession) -> NonFiniteOutputError | None:
        """Read ``target``'s pending verdict (waiting for the device if it is not in: only the drain and failure
        paths call this before ``ready``): release the block's rollback point if it is finite, else undo the block
        (``_withdraw``) and return the error its work fails with."""
        verdict, target.verdict = target.verdict, None
        error = verdict.check.read()
        if error is None:
            if verdict.before is not None:
                target.session.release(verdict.before)
            self.pacer.confirm(verdict.paced)
            return None
        log.warning("a block of %s refined to NaN or Inf (read after its commit): undone", target.name)
        self._withdraw(target, verdict)
        return error

    def _withdraw(self, target: EngineSession, verdict: PendingVerdict) -> None:
        """Undo the committed block ``verdict`` judged NaN/Inf: it is the session's last one (the gate held every
        later forward), so its checkpoint is exactly the session before it. In atomic work the work's failure rolls
        the session back to before the work (``_fail``), as a CPU commit's error would."""
        # The rollback writes the cache in place, and may come before any forward of the session waited for a crash
        # checkpoint's copies of it (a drain fails work that never started, ``_fail_everything``): they come first.
        wait_for(target)
        if verdict.before is not None:
            target.session.rollback(verdict.before)
        self.pacer.undo(verdict.paced)  # neither paced nor late; its frames' arrivals listed again

        def undone(entry) -> bool:
            return entry[0] is not None and entry[0].check is verdict.check

        if any(undone(entry) for entry in target.pending_outputs):  # its output step has not run: drop it
            # By identity: units compare by value, and their tensors have no truth value.
            target.pending_outputs = deque(entry for entry in target.pending_outputs if not undone(entry))
            if not target.pending_outputs:
                self.scheduler.output_idle(target)
        elif verdict.stages is not None:
            target.stages.restore(verdict.stages)
        if target.work:
            work: Work = target.work[0]
            work.withdrawn.extend(unit for unit in work.units if unit.check is verdict.check)
            work.units = [unit for unit in work.units if unit.check is not verdict.check]

    def _fail(self, work: Work, error: BaseException) -> None:
        target = work.target
        target.run = target.forward = None  # a block in flight never reaches the session
        if target.verdict is not None and (late := self._read_verdict(target)) is not None:
            error = late  # its last block was NaN/Inf after all (undone now): the cause, whatever failed next
        if isinstance(error, NonFiniteOutputError) and work.base is not None:
            error = self._drop_unrefined(work, error)
        if work.atomic and target.checkpoint is not None:
            self._drop_outputs(target)
            target.session.rollback(target.checkpoint)
            target.stages.restore(target.stages_checkpoint)
            target.checkpoint = target.stages_checkpoint = None
        elif target.pending_outputs:
            # The blocks it committed are kept: their units go out through the stages before the error.
            self._output_now(target)
            if not (target.work and target.work[0] is work):
                return  # an output step failed meanwhile and settled the work
        self._settle(work, error=error)

    def _drop_unrefined(self, work: Work, error: NonFiniteOutputError) -> NonFiniteOutputError:
        """A block of non-atomic work (a stream message) refined to NaN/Inf: drop every frame not yet refined.

        Kept pending, those frames would fail every later block the same way (the next message "retries" them).
        Dropping only this message's frames is not enough either: the block may hold frames of an earlier
        message too short to make a block on its own, and either could be the one that overflows. Nothing in
        the KV cache or the output stages changes (the block was never committed). When the session had nothing
        pending before this message and none of its blocks were committed, it is exactly as if the message never
        came (``rolled_back``); otherwise the error says which frames to send again."""
        session, base = work.target.session, work.base
        state = session.state
        # Blocks committed meanwhile were refined with the current prompt; otherwise the one from before.
        source = base if state.frames_returned == base.frames_returned else state
        restored = dataclasses.replace(source, frames_received=state.frames_returned, pending=None, flushed=False)
        session.load(restored, session.kv)
        work.frames_in = max(0, restored.frames_received - base.frames_received)
        if source is base and base.pending_frames == 0:
            work.rolled_back = True
            return NonFiniteOutputError(f"{error}; this message was not taken: the session is as before it")
        return NonFiniteOutputError(
            f"{error}; frames [{restored.frames_received}, {state.frames_received}) were dropped (every frame not "
            f"yet refined, including earlier messages' frames waiting for a full block): the session has "
            f"{restored.frames_received} frames, send again from frame {restored.frames_received}"
        )

    def _settle(self, work: Work, value: Any = None, error: BaseException | None = None) -> None:
        target = work.target
        if target.work and target.work[0] is work:
            target.work.popleft()
        with self._cond:
            self._outstanding -= 1
            target.queued -= 1
        _resolve(work.loop, work.future, value, error)

    def _pause_now(self) -> int:
        self._paused = True
        for target in self.scheduler.plan_outputs():  # committed units are handed on through their stages first
            if target.work and not target.work[0].atomic:
                self._output_now(target)
        stopped = Draining(
            "the server is shutting down: this work was stopped before it finished (what it committed is kept); "
            "retry after restart"
        )
        return self._fail_everything(stopped)

    def _fail_everything(self, error: EngineError) -> int:
        failed = 0
        for item in list(self._inbox):
            if isinstance(item, _CallJob):
                _resolve(item.loop, item.future, None, error)
            else:
                self._settle(item, error=error)
                failed += 1
        self._inbox.clear()
        for target in self.scheduler.ring:
            while target.work:
                self._fail(target.work[0], error)
                failed += 1
        self.scheduler.clear()
        return failed


def wait_for(target: EngineSession) -> None:
    """Make the engine's stream wait (on the device, the host goes on) for ``target``'s copies in flight."""
    if target.ready is not None:
        torch.cuda.current_stream().wait_event(target.ready)
        target.ready = None


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


def _probe_shape(session: RefinerSession, forward: RowForward) -> ProbeShape:
    """How the probe builds sessions of ``forward``'s class: its frame size, block frames and prompt length."""
    geometry = session.state.geometry
    return ProbeShape(geometry.height, geometry.width, forward.frames, int(forward.prompt.kv.shape[3]))  # (Y, 2, B, L, D)
