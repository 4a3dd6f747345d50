"""What one app holds and how it starts and stops: the engine, the registry, the metrics, the loaded refiner.

Lifecycle: ``start`` runs the engine thread and loads the refiner on it (a load failure fails start-up), then
warms the model up in the background at the steady-state window shape while ``/health`` already answers and
``/ready`` says why it is not ready. ``drain`` stops admitting, lets in-flight work finish for up to
``drain_timeout_s``, then pauses the engine (blocks still in flight are dropped, HTTP chunks still in progress are
rolled back and answered 503), waits until every committed unit is encoded and retained, writes every live
session to ``snapshot_dir`` (when set) exactly as its clients last saw it, and closes the streams with a code and a
reason (1012 "service restart" for a saved session, 1001 otherwise), waiting for them at most
``drain_timeout_s``, before the server closes connections. Nothing is loaded at start-up: a server on the same
``snapshot_dir`` (this one restarted, or another replica) adopts a saved session on the first request for it,
under its id (``app.sessions.store.SessionStore.lookup``); start-up only removes what dead writers left (their staging
folders and abandoned leases: ``app.persistence.sweeps.FolderSweep.at_start``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from safetensors.torch import load_file

from models import ModelLoadError, Prompt, Refiner, RefinerError, RefinerSession, load_refiner
from models.compiled import CompiledStep, failure_reason, warmup_forwards
from models.determinism import probe_batch_invariance
from models.host_memory import keep_freed_memory
from models.session import check_prompt
from models.transfer import use_device
from models.vae import StreamingDecoder, load_vae

from app.core.error_kinds import WS_GOING_AWAY, WS_SERVICE_RESTART, ApiError
from app.core.metrics import Metrics
from app.core.settings import Settings
from app.engine.batching import ProbeShape
from app.engine.worker import Engine, EngineSession, Work
from app.outputs.catalog import build_stages
from app.outputs.delivery import Encoder
from app.outputs.kinds import OUTPUT_KINDS, Outputs
from app.outputs.stage import OutputStages
from app.persistence.sweeps import FolderSweep
from app.sessions.drain import save_all, settle
from app.sessions.registry import Registry
from app.sessions.store import SessionStore
from app.sessions.upkeep import upkeep_forever

log = logging.getLogger("app")


class Services:
    """What one app holds. Created by ``create_app``, started and stopped by its lifespan."""

    def __init__(self, settings: Settings, warmup_gate: Callable[[], None] | None = None):
        # Imported here: the operations read request plumbing (app.api.deps) that itself names this class.
        from app.sessions.operations import SessionOps

        self.settings = settings
        self.metrics = Metrics()
        self.encoder = Encoder(self.metrics, settings.response_dtype, settings.encode_workers)
        self.engine = Engine(
            self.metrics,
            settings.engine_queue_depth,
            settings.session_queue_depth,
            max_batch_rows=settings.max_batch_rows,
            # ``auto`` batches a class of model call only once its probe has passed (``app.engine.batching``).
            batching=settings.batching,
        )
        self.refiner: Refiner | None = None
        self.decoder: StreamingDecoder | None = None  # the VAE's decoder as a stream (setting ``vae``)
        self.stages: OutputStages = build_stages()  # the output kinds this server can produce (app.outputs.stage)
        # The operations routes call (app.sessions.operations) and where the sessions live (app.sessions.store).
        self.sessions = SessionOps(self)
        self.store = SessionStore(
            settings, self.metrics, self.engine, self.encoder,
            refiner=lambda: self.refiner,
            stages=lambda: self.stages,
            deliveries=self.sessions.deliveries_for,
        )
        # What of snapshot_dir nobody will ask for (app.persistence.sweeps): at start-up and in the upkeep round.
        self.sweep = FolderSweep(self.store.snapshot_folder, settings.replica_id, settings.retention_s,
                                 settings.session_lease_s, tracked=self.store.tracked)
        self.metrics.track(
            sessions=lambda: len(self.registry),
            cache_bytes=self.registry.total_cache_bytes,
            queue=lambda: self.engine.outstanding,
        )
        self.metrics.track_memory(self.store.parking.totals, self.store.parking.counts, self.store.parking.report)
        self.default_prompt: Prompt | None = None  # settings.default_prompt, checked against the model
        self.not_ready_reason: str | None = "loading the model"
        # When the server became ready (time.monotonic()): /ready says for how long, so that a browser page, which
        # cannot read a refused WebSocket handshake's status, can tell that its handshake went out before then.
        self.ready_since: float | None = None
        self.warmup_gate = warmup_gate
        self._tasks: list[asyncio.Task] = []
        self._uncompiled_logged: set[tuple[bool, int]] = set()  # uncompiled shapes already logged
        self.compile_error: str | None = None  # why compile_step's compiling failed (compile_fallback), in one line
        self._drain_task: asyncio.Task | None = None
        self.drain_report: dict[str, Any] | None = None

    @property
    def registry(self) -> Registry:
        """The store's index of live sessions (what /metrics and /v1/info count)."""
        return self.store.registry

    @property
    def batch_invariant(self) -> bool | None:
        """Whether every class of model call probed so far gave batched rows the bits of solo ones (None: none
        probed, as with ``batching: false``)."""
        return self.engine.policy.invariant

    @property
    def batch_probe(self) -> str | None:
        """What the first probe (the warm-up's class) found, in words."""
        first = self.engine.policy.first
        return None if first is None else first.probe

    @property
    def draining(self) -> bool:
        return self.store.draining

    # --- admission -----------------------------------------------------------------------------------------
    def require_ready(self) -> None:
        if self.not_ready_reason is None and not self.draining:
            return
        if self.draining:  # first: a warm-up that ends during a drain does not make the server ready again
            # Not "retry in N s": this process takes no more work; the same request succeeds once the server (or,
            # behind a router, another replica) is back with the saved sessions.
            raise ApiError(
                "draining",
                "the server is shutting down and takes no new work; retry once it is back (sessions saved to "
                "snapshot_dir continue there: repeat the last seq, or reconnect a stream with ?resume_from=N)",
            )
        raise ApiError(
            "not_ready", f"the server is not ready ({self.not_ready_reason}); retry in {self.settings.retry_after_s} s"
        )

    def require_model(self) -> Refiner:
        if self.refiner is None:
            raise ApiError("not_ready", f"the model is not loaded yet ({self.not_ready_reason}); retry shortly")
        return self.refiner

    def reject(self, error: ApiError) -> None:
        self.metrics.rejected_requests.labels(reason=error.kind).inc()

    # --- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.engine.start()
        settings = self.settings
        if settings.torch_threads is not None:
            # Process-wide; on a shared CPU, fewer threads avoid OpenMP workers spinning against each other.
            torch.set_num_threads(settings.torch_threads)
        self.refiner = await self.engine.call(lambda: _load(settings))
        self.engine.model = self.refiner.model
        if self.refiner.device.type == "cpu":
            # Batched forwards' big activations would otherwise be page-faulted in on every forward.
            keep_freed_memory()
        if settings.compile_step:
            refiner = self.refiner
            try:
                self.engine.runner = await self.engine.call(
                    lambda: CompiledStep(refiner.model,
                                         settings.max_batch_rows if settings.batching is not False else 1,
                                         mode=settings.compile_mode, backend=settings.compile_backend,
                                         sizes=settings.compile_buckets, on_uncompiled=self._uncompiled_call)
                )
            except Exception as exc:  # torch.compile itself refused (a Python version dynamo does not support)
                await self._compile_failed(exc)
        log.info("loaded %s", self.refiner.info.to_dict())
        if settings.vae:
            refiner = self.refiner
            self.decoder = await self.engine.call(lambda: StreamingDecoder(load_vae(
                Path(settings.vae).expanduser(), refiner.device, refiner.dtype,
                latent_channels=refiner.info.in_channels)))
            self.stages = build_stages(decoder=self.decoder)
            self.encoder.stages = self.stages
            log.info("loaded the VAE %s", self.decoder.info.to_dict())
        if settings.default_prompt is not None:
            refiner = self.refiner
            self.default_prompt = await self.engine.call(lambda: load_default_prompt(settings.default_prompt, refiner))
        self.sweep.at_start()
        if settings.device_memory_budget != "auto":
            self.store.parking.resolve_budget(self.refiner.device)
        self._tasks.append(asyncio.create_task(self._warm_up(), name="warm-up"))
        self._tasks.append(asyncio.create_task(
            upkeep_forever(settings, self.store.registry, self.store.parking, self.store.endings, self.sweep,
                           lambda: self.store.draining),
            name="evict-idle"))
        if settings.snapshot_dir is not None:
            self._tasks.append(asyncio.create_task(self.store.checkpoints.renew_forever(self.store.registry.handles),
                                                   name="renew-leases"))

    def _uncompiled_call(self, rows: int, tokens: int) -> None:
        """A model call at a shape the compiled step's warm-up did not compile (run eagerly: engine thread)."""
        self.metrics.uncompiled_calls.inc()
        largest = max(self.engine.runner.buckets)
        why = (rows > largest, tokens)
        if why in self._uncompiled_logged:
            return
        self._uncompiled_logged.add(why)
        if rows > largest:
            log.warning("a model call of %d rows (one session's batch) is wider than the largest compiled batch size "
                        "(%d: max_batch_rows, or 1 with batching: false) and runs eagerly (slower)", rows, largest)
        else:
            log.warning("a model call of %d rows x %d tokens per row (frames x latent height x width) was not "
                        "compiled during the warm-up and runs eagerly (slower): a stream of a latent size not in "
                        "warmup_geometries (add it there), or a session's block_size / sink_frames other than the "
                        "server's defaults (compiled for the defaults only)", rows, tokens)

    async def _warm_up(self) -> None:
        try:
            if self.compile_error is not None and self.settings.compile_fallback == "fail":
                return  # torch.compile refused at start-up: /ready keeps saying why (``_compile_failed``)
            if self.warmup_gate is not None:
                self.not_ready_reason = "warming up"
                await self.engine.call(self.warmup_gate)
            settings, refiner, runner = self.settings, self.refiner, self.engine.runner
            if runner is not None:
                try:
                    await self._compile(runner)
                except Exception as exc:
                    if self.draining:
                        raise
                    if not await self._compile_failed(exc):
                        return
            if settings.warmup:
                self.not_ready_reason = "warming up"
                started = time.perf_counter()
                await self.engine.run(warmup_work(refiner, settings, self.stages))
                log.info("warm-up done in %.2f s", time.perf_counter() - started)
                await self._decide_batching()
            if settings.device_memory_budget == "auto":
                # What is free once the weights, the warm-up's activations and any compiled graphs are in place.
                self.store.parking.resolve_budget(self.refiner.device)
            if not self.draining:
                self.not_ready_reason = None
                self.ready_since = time.monotonic()
            if not settings.warmup:
                # Ready at once, as asked; every call serves one session until the probe (run now, between the
                # sessions' forwards) has passed.
                await self._decide_batching()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self.draining:  # the drain stopped the engine under the warm-up: /ready keeps saying "draining"
                log.info("warm-up stopped by the drain: %s", exc)
                return
            log.exception("warm-up failed")
            self.not_ready_reason = f"warm-up failed: {exc}"

    async def _compile(self, runner: CompiledStep) -> None:
        """Every bucket and kind of forward compiled now, so that no client pays for it."""
        settings, refiner = self.settings, self.refiner
        self.not_ready_reason = "compiling the batched step"
        started = time.perf_counter()
        geometries, config = settings.compile_geometries(), settings.session_defaults()
        shapes = runner.shapes_to_compile(config, geometries)

        def progress(done: int) -> None:  # /ready's reason says how far it got (minutes on a GPU)
            if not self.draining:
                self.not_ready_reason = f"compiling the batched step: {done} of {shapes} shapes"

        # Every size's forwards in turn, built lazily on the engine thread: one throwaway window at a time.
        forwards = itertools.chain.from_iterable(
            warmup_forwards(refiner, config, height, width, settings.warmup_prompt_tokens)
            for height, width in geometries)
        calls = await self.engine.call(lambda: runner.warm_up(forwards, progress=progress))
        log.info("compiled the batched step for batch sizes %s at latent sizes %s (%d warm-up calls) in "
                 "%.1f s", runner.buckets, ", ".join(f"{h}x{w}" for h, w in geometries), calls,
                 time.perf_counter() - started)

    async def _compile_failed(self, exc: Exception) -> bool:
        """Compiling the step failed (``compile_fallback``): with ``eager`` the step runs eagerly from here, as with
        ``compile_step: false``, and the warm-up goes on (True); with ``fail`` the server stays unready (False). Either
        way the reason is logged once (one line: ``failure_reason``), shown by /v1/info's ``engine.step`` and
        counted in ``refiner_compile_failed``. The real-time cost model needs nothing: it learns from the calls the
        engine times, none of which the failed compile made, so it measures the eager step."""
        self.compile_error = failure_reason(exc)
        self.metrics.compile_failed.set(1)
        # On the engine thread, the only one that runs model calls: the half-compiled step is dropped for good.
        await self.engine.call(lambda: setattr(self.engine, "runner", None))
        if self.settings.compile_fallback == "fail":
            log.error("compiling the batched step failed: %s; not ready (compile_fallback: fail; eager would serve "
                      "the step uncompiled)", self.compile_error)
            self.not_ready_reason = (f"compiling the batched step failed: {self.compile_error} (compile_fallback: "
                                     f"fail; set compile_fallback: eager to serve the step uncompiled, or "
                                     f"compile_step: false)")
            return False
        log.warning("compiling the batched step failed: %s; serving the step eagerly (compile_fallback: eager)",
                    self.compile_error)
        return True

    @property
    def step(self) -> dict[str, str]:
        """What runs the model calls (``mode``: ``eager``, ``compiling``, ``compiled``, or ``none`` when compiling
        failed under ``compile_fallback: fail``) and why (``reason``): /v1/info's ``engine.step``."""
        settings, runner = self.settings, self.engine.runner
        if self.compile_error is not None:
            fallback = settings.compile_fallback
            return {"mode": "eager" if fallback == "eager" else "none",
                    "reason": f"compile_step: true, but compiling failed ({self.compile_error}); compile_fallback: "
                              + ("eager serves the step uncompiled" if fallback == "eager" else "fail serves nothing")}
        if not settings.compile_step:
            return {"mode": "eager", "reason": "compile_step: false"}
        if runner is None or not runner.sealed:
            return {"mode": "compiling", "reason": "compile_step: true; compiling before /ready"}
        return {"mode": "compiled", "reason": "compile_step: true; compiled during the warm-up"}

    async def _decide_batching(self) -> None:
        """Start probing batch invariance (``app.engine.batching``): the warm-up's classes now (its block, its sink, a
        short last block of each length), every other class of model call when the engine first sees it.
        ``batching: auto`` batches a class only once its probe passed (so retries, restores, reattaches and crash
        resumes stay bit-identical); ``true`` batches regardless and warns for a class that fails; ``false`` never
        probes."""
        settings, policy = self.settings, self.engine.policy
        if settings.batching is False:
            return
        refiner, engine = self.refiner, self.engine
        # On a GPU each probe session holds a whole KV window (9 GiB at 720p for the released refiner): two rows
        # tell whether the stacked GEMMs change a row's bits; on a CPU up to 8 rows try more kernel choices.
        max_rows = min(settings.max_batch_rows, 2 if refiner.device.type == "cuda" else 8)
        defaults = settings.session_defaults()

        def shape(frames: int, height: int = settings.warmup_height, width: int = settings.warmup_width) -> ProbeShape:
            return ProbeShape(height, width, frames, settings.warmup_prompt_tokens)

        def start_probing():  # on the engine thread: no idle-time probe can come between the two lines
            policy.prober = lambda shape: probe_batch_invariance(
                refiner, shape.height, shape.width, shape.prompt_tokens, engine.runner, max_rows=max_rows,
                block_frames=shape.block_frames)
            return policy.probe(shape(defaults.block_size))

        await self.engine.call(start_probing)
        # Every other class a session of the warm-up's sizes (warmup_height x warmup_width, then warmup_geometries)
        # meets: its blocks, its sink's forward and a short last block (a flush) of each length, each a class of its
        # own (tokens per row). Probed now, one engine call each (other sessions' forwards come between them when
        # the server is ready already, `warmup: false`), so that none is probed, holding the engine, when the first
        # client's block, sink or flush at a listed size meets it.
        frames_per_call = sorted({defaults.block_size, defaults.sink_frames, *range(1, defaults.block_size)})
        for height, width in settings.compile_geometries():
            for frames in frames_per_call:
                # (One the engine probed meanwhile, idle between these calls, is not probed again.)
                probe = shape(frames, height, width)
                await self.engine.call(lambda probe=probe: None if policy.probed(probe) else policy.probe(probe))

    async def drain(self) -> dict[str, Any]:
        """Stop admitting, finish in-flight blocks, save the sessions, close streams cleanly. Idempotent: later
        calls (SIGTERM after the admin route, then the lifespan) wait for the first and get its report."""
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        return await asyncio.shield(self._drain_task)

    async def _drain(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.store.draining = True
        self.not_ready_reason = "draining: the server is shutting down"
        self.engine.stop_accepting()
        timeout = self.settings.drain_timeout_s
        if not await self.engine.wait_idle(timeout):
            log.warning("drain: %d job(s) still running after %.0f s; stopping them", self.engine.outstanding, timeout)
        # From here the sessions no longer move: what is left of unfinished work is dropped or rolled back, and
        # the engine hands its last units to the loop before this returns.
        stopped = 0
        with contextlib.suppress(Exception):
            stopped = await self.engine.pause()
        # Every committed unit retained and no checkpoint write in flight, then the sessions saved as they stand.
        store = self.store
        saved = await save_all(await settle(store.registry, store.parking), folder=store.snapshot_folder,
                               settings=self.settings, engine=self.engine, encoder=self.encoder,
                               leases_held=store.leases, saving=store.checkpoints.saving, lose=store.lose)
        streams = list(self.store.connections)
        for stream in streams:
            if stream.session_id in saved:
                stream.close(
                    WS_SERVICE_RESTART,
                    "service restart: session saved; reconnect with ?resume_from=<frames received> when back",
                )
            else:
                stream.close(WS_GOING_AWAY, "server shutting down; reconnect after it restarts")
        # A client that neither reads nor closes must not hold the shutdown past drain_timeout_s.
        closing = [asyncio.ensure_future(stream.closed()) for stream in streams]
        if closing:
            _, stuck = await asyncio.wait(closing, timeout=timeout)
            for stream in streams:
                if not stream.is_closed:
                    stream.abort()
            for task in stuck:
                task.cancel()
        self.drain_report = {
            "draining": True,
            "sessions": len(self.registry),
            "sessions_saved": len(saved),
            "snapshot_dir": None if self.settings.snapshot_dir is None else str(self.settings.snapshot_dir),
            "streams_closed": len(streams),
            "work_stopped": stopped,
            "seconds": round(time.perf_counter() - started, 3),
        }
        log.info("drain done: %s", self.drain_report)
        return self.drain_report

    async def abort_start(self) -> None:
        """Start-up failed: stop what started, quietly (there is nothing to drain or save)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.to_thread(self.engine.stop)
        self.encoder.close()

    async def stop(self) -> None:
        await self.drain()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.engine.stop)
        self.encoder.close()


def warmup_work(refiner: Refiner, settings: Settings, stages: OutputStages | None = None) -> Work:
    """A throwaway stream long enough that its last block attends to a full window (sink + K - S history
    frames + the block), so start-up pays for every allocation and kernel choice of the steady state; with a VAE
    its video is decoded too, and the flush decodes the tail."""
    config = settings.session_defaults()
    blocks = math.ceil(config.max_history_frames / config.block_size) + 1
    frames = config.sink_frames + blocks * config.block_size
    generator = torch.Generator().manual_seed(0)
    info = refiner.info
    latents = torch.randn(
        1, info.in_channels, frames, settings.warmup_height, settings.warmup_width, generator=generator
    )  # (1, C, T, H, W)
    prompt = torch.randn(1, settings.warmup_prompt_tokens, info.caption_channels, generator=generator)  # (1, L, D)
    target = EngineSession(session=RefinerSession(refiner, config), name="warm-up")
    if stages is not None:
        # Every output kind this server can produce (a VAE's video above all), so that no client pays for the first.
        target.stages = stages.for_session(Outputs(tuple(k for k in OUTPUT_KINDS if k in stages.by_kind)), config)
    # A flush when a stage holds a tail (a video's last frames), so that finishing one is warmed up too.
    return Work(target, latents, prompt, flush=not target.stages.done)


def model_dir(settings: Settings) -> Path:
    """The folder to serve: the configured one, or the embedded tiny refiner (built on first use)."""
    if settings.model:
        return Path(settings.model).expanduser()
    return ensure_embedded_model(settings.embedded_model_dir)


def ensure_embedded_model(folder: Path) -> Path:
    from models.checkpoints import write_checkpoint

    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a crash or a second server starting at once never leaves (or
    # reads) a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=folder.parent))
    write_checkpoint(staging, preset="tiny")
    try:
        os.rename(staging, folder)
    except OSError:
        if not (folder / "config.json").is_file():
            raise
    log.info("built the embedded tiny refiner in %s", folder)
    return folder


def _load(settings: Settings) -> Refiner:
    """On the engine thread: a ``cuda:N`` device becomes the thread's current one before anything is allocated, so
    that nothing lands on cuda:0 first (``auto`` resolves to the current device anyway)."""
    if settings.device.startswith("cuda"):
        use_device(settings.device)
    return load_refiner(model_dir(settings), device=settings.device, dtype=settings.dtype)


def load_default_prompt(path: Path, refiner: Refiner) -> Prompt:
    """The server's default prompt conditioning; a bad file stops start-up with a message naming it."""
    path = Path(path).expanduser()
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # missing, unreadable or not safetensors: the operator must fix the setting
        raise ModelLoadError(
            f"default_prompt {str(path)!r} is not a readable safetensors file ({exc}); write prompt_embeds "
            "(1, L, caption_channels) with safetensors.torch.save_file"
        ) from None
    if "prompt_embeds" not in tensors:
        raise ModelLoadError(f"default_prompt {str(path)!r} holds no 'prompt_embeds' tensor (found {sorted(tensors)})")
    try:
        return check_prompt(refiner, tensors["prompt_embeds"], tensors.get("prompt_attention_mask"), batch=1)
    except RefinerError as exc:
        raise ModelLoadError(f"default_prompt {str(path)!r}: {exc}") from None
