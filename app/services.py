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
under its id (``_adopt``); start-up only removes interrupted writes and gives back this replica's stale claims.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from safetensors.torch import load_file

from models import ModelLoadError, Prompt, Refiner, RefinerError, RefinerSession, SessionConfig, load_refiner
from models.compiled import CompiledStep, warmup_forwards
from models.determinism import probe_batch_invariance
from models.memory import keep_freed_memory
from models.session import check_prompt
from models.vae import StreamingDecoder, load_vae
from wm_refiner_client import spec

from .delivery import Deliveries, Encoder, UnitCopies
from .engine import Engine, EngineSession, Work
from .engine_errors import Draining
from .errors import WS_GOING_AWAY, WS_SERVICE_RESTART, ApiError
from .metrics import Metrics
from .outputs import OUTPUT_KINDS, HostUnit, Outputs
from .registry import Registry, SessionHandle
from .resume import SentUnit
from .settings import Settings
from .stages import OutputStages, OutUnit, SessionStages, build_stages
from .snapshots import (
    SUFFIX,
    SessionRecord,
    claim,
    has_snapshot,
    load_record,
    snapshot_limits,
    record_tensors,
    release_claim,
    remove_record,
    save_record,
    write_record,
)

log = logging.getLogger("app")


class Services:
    """What one app holds. Created by ``create_app``, started and stopped by its lifespan."""

    def __init__(self, settings: Settings, warmup_gate: Callable[[], None] | None = None):
        self.settings = settings
        self.metrics = Metrics()
        self.encoder = Encoder(self.metrics, settings.response_dtype)
        self.engine = Engine(
            self.metrics,
            settings.engine_queue_depth,
            settings.session_queue_depth,
            max_batch_rows=settings.max_batch_rows,
            # ``auto`` batches only once the warm-up's probe has passed (``_decide_batching``).
            batching=settings.batching is True,
        )
        self.registry = Registry(
            max_sessions=settings.max_sessions,
            idle_timeout_s=settings.session_idle_timeout_s,
            remember_evicted=settings.evicted_ids_remembered,
            retry_after_s=settings.retry_after_s,
            reattach_grace_s=settings.ws_reattach_grace_s,
            resume_units=settings.ws_resume_units,
            flushed_ttl_s=settings.flushed_session_ttl_s,
            deliveries=self._deliveries_for,
            on_close=self._forget_checkpoint,
            stages=lambda: self.stages,
        )
        self.metrics.track(
            sessions=lambda: len(self.registry),
            cache_bytes=self.registry.total_cache_bytes,
            queue=lambda: self.engine.outstanding,
        )
        self.refiner: Refiner | None = None
        self.decoder: StreamingDecoder | None = None  # the VAE's decoder as a stream (setting ``vae``)
        self.stages: OutputStages = build_stages()  # the output kinds this server can produce (app.stages)
        self.default_prompt: Prompt | None = None  # settings.default_prompt, checked against the model
        self.batch_invariant: bool | None = None  # measured during the warm-up unless batching is false
        self.batch_probe: str | None = None  # what the probe found, in words
        self.not_ready_reason: str | None = "loading the model"
        self.draining = False
        self.streams: set[Any] = set()  # open WebSocket streams (app.routes.stream.StreamConnection)
        self.warmup_gate = warmup_gate
        self._tasks: list[asyncio.Task] = []
        self._drain_task: asyncio.Task | None = None
        self._adopting: dict[str, asyncio.Lock] = {}
        self.drain_report: dict[str, Any] | None = None

    # --- admission -----------------------------------------------------------------------------------------
    def require_ready(self) -> None:
        if self.not_ready_reason is None:
            return
        if self.draining:
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

    # --- units out -----------------------------------------------------------------------------------------
    def count_out(self, units, handle: SessionHandle | None = None, received: float | None = None) -> None:
        """Metrics for units delivered to a client (a published stream unit, a returned response)."""
        for unit in units:
            self.metrics.frames_out.inc(unit.frame_end - unit.frame_start)
            if unit.kind != "block":
                continue
            self.metrics.blocks_refined.inc()
            if handle is not None and not handle.first_block_done and received is not None:
                handle.first_block_done = True
                self.metrics.time_to_first_block.observe(time.perf_counter() - received)

    def _deliveries_for(self, handle: SessionHandle) -> Deliveries:
        def published(unit: OutUnit, sent: SentUnit, received: float, host: HostUnit) -> None:
            self.count_out([unit], handle, received)
            handle.publish(sent)
            for watcher in list(handle.watchers):
                watcher.offer(host, received, sent if watcher.outputs == handle.outputs else None)

        return Deliveries(self.encoder, published, handle.outputs)

    def watch(self, handle: SessionHandle, units, received: float, done: bool = False) -> None:
        """Offer units that went out another way (an HTTP response) to the session's watchers; ``done``: the
        session was flushed with them."""
        watchers = list(handle.watchers)
        if watchers:
            # One host copy per unit, whatever the number of watchers.
            copies = [UnitCopies(unit, self.stages) for unit in units]
            for watcher in watchers:
                for unit in copies:
                    watcher.offer(unit, received)
        if done:
            self.finish_watchers(handle)

    def finish_watchers(self, handle: SessionHandle) -> None:
        for watcher in list(handle.watchers):
            watcher.finish()

    # --- outputs ---------------------------------------------------------------------------------------------
    def outputs(self, fields: dict[str, Any]) -> Outputs:
        """A session's outputs from its config fields; 422 for video without a VAE."""
        return Outputs.from_fields(fields, self.decoder is not None)

    def session_stages(self, outputs: Outputs, config: SessionConfig) -> SessionStages:
        """The output stages of a new session (its ``outputs``' kinds, already checked against this server)."""
        return self.stages.for_session(outputs, config)

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
            self.engine.runner = await self.engine.call(
                lambda: CompiledStep(refiner.model, settings.max_batch_rows if settings.batching is not False else 1,
                                     mode=settings.compile_mode, backend=settings.compile_backend)
            )
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
        if settings.snapshot_dir is not None:
            self._clean_snapshot_dir(Path(settings.snapshot_dir).expanduser())
        self._tasks.append(asyncio.create_task(self._warm_up(), name="warm-up"))
        self._tasks.append(asyncio.create_task(self._evict_forever(), name="evict-idle"))

    async def _warm_up(self) -> None:
        try:
            if self.warmup_gate is not None:
                self.not_ready_reason = "warming up"
                await self.engine.call(self.warmup_gate)
            settings, refiner, runner = self.settings, self.refiner, self.engine.runner
            if runner is not None:
                # Every bucket and kind of forward compiled now, so that no client pays for it.
                self.not_ready_reason = "compiling the batched step"
                started = time.perf_counter()
                calls = await self.engine.call(lambda: runner.warm_up(warmup_forwards(
                    refiner, settings.session_defaults(), settings.warmup_height, settings.warmup_width,
                    settings.warmup_prompt_tokens)))
                log.info("compiled the batched step (%d warm-up calls) in %.1f s", calls, time.perf_counter() - started)
            if settings.warmup:
                self.not_ready_reason = "warming up"
                started = time.perf_counter()
                await self.engine.run(warmup_work(refiner, settings, self.stages))
                log.info("warm-up done in %.2f s", time.perf_counter() - started)
            await self._decide_batching()
            self.not_ready_reason = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("warm-up failed")
            self.not_ready_reason = f"warm-up failed: {exc}"

    async def _decide_batching(self) -> None:
        """``batching: auto`` batches only when the probe finds every row of a batched call bit-identical to its solo
        forward for this model on this device (so retries, restores, reattaches and crash resumes stay bit-identical);
        ``true`` batches regardless and warns when the probe fails; ``false`` skips the probe."""
        mode = self.settings.batching
        if mode is False:
            return
        settings, refiner, runner = self.settings, self.refiner, self.engine.runner
        started = time.perf_counter()
        probe = await self.engine.call(lambda: probe_batch_invariance(
            refiner, settings.warmup_height, settings.warmup_width, settings.warmup_prompt_tokens, runner,
            max_rows=settings.max_batch_rows))
        self.batch_invariant, self.batch_probe = probe.ok, str(probe)
        self.engine.scheduler.batching = probe.ok or mode is True
        log.info("batch invariance probe (%.2f s): %s", time.perf_counter() - started, probe)
        if probe.ok:
            return
        if mode is True:
            log.warning("batching: true, but batched forwards are NOT bit-identical to solo forwards here (%s): a "
                        "session's bytes may depend on the sessions it shares model calls with (still within the "
                        "parity tolerance), so retries, restores and resumes may differ in the last bits. Set "
                        "batching: auto or false to keep them bit-identical.", probe.failure)
        else:
            log.warning("batching: auto turned batching OFF: batched forwards are not bit-identical to solo forwards "
                        "here (%s); every model call serves one session. batching: true forces it.", probe.failure)

    # --- sessions that move (snapshot_dir, shared by replicas) ---------------------------------------------------
    async def lookup(self, session_id: str) -> SessionHandle:
        """The session ``session_id``: a live one of this replica, else one adopted from ``snapshot_dir`` (saved by
        a drain or a checkpoint, here or on another replica); ApiError 404 / 410 otherwise."""
        if not spec.is_session_id(session_id):
            # No session was ever given such an id, and it must never reach the snapshot folder as a path.
            raise ApiError("session_not_found", f"no session {session_id[:80]!r}: session ids are "
                                                f"{spec.SESSION_ID_RULE}; use the session_id POST /v1/sessions returned")
        handle = self.registry.existing(session_id)
        if handle is not None:
            return handle
        folder = self.snapshot_folder
        if folder is not None and has_snapshot(folder, session_id):
            lock = self._adopting.setdefault(session_id, asyncio.Lock())
            async with lock:  # one adoption per id in this process; other replicas are kept off by the claim
                handle = self.registry.existing(session_id) or await self._adopt(folder, session_id)
            self._adopting.pop(session_id, None)
            if handle is not None:
                return handle
        return self.registry.get(session_id)

    # --- crash checkpoints ---------------------------------------------------------------------------------------
    async def checkpoint(self, handle: SessionHandle) -> None:
        """Write the session's checkpoint when one is due (``checkpoint_every_blocks`` / ``checkpoint_interval_s``).
        Called by a chunk or stream message that just finished, within the session's turn, so the session is
        between two pieces of work: the engine copies its tensors (one ``call``, between two model calls), and the
        file is serialized and written on a worker thread while the session goes on. A write still in flight makes
        this one wait for the next chance; the drain waits for them before it saves."""
        settings, folder = self.settings, self.snapshot_folder
        every, interval = settings.checkpoint_every_blocks, settings.checkpoint_interval_s
        if folder is None or self.draining or not (every or interval):
            return
        blocks = handle.session.state.blocks_refined
        due = (every and blocks - handle.checkpoint_blocks >= every) or (
            interval and blocks != handle.checkpoint_blocks and time.monotonic() - handle.checkpoint_at >= interval)
        if not due or (handle.checkpoint_write is not None and not handle.checkpoint_write.done()):
            return
        if handle.deliveries is not None:
            await handle.deliveries.flush()  # the units it streamed are retained, for a resume after the crash
        record = _record(handle, self.encoder)
        try:
            tensors, metadata = await self.engine.call(lambda: record_tensors(record(), copy=True))
        except Draining:  # the engine stopped (drain): the drain saves the session itself
            return
        handle.checkpoint_blocks, handle.checkpoint_at = blocks, time.monotonic()
        metrics = self.metrics

        def write() -> None:
            started = time.perf_counter()
            path = write_record(folder, handle.id, tensors, metadata)
            metrics.checkpoint_seconds.observe(time.perf_counter() - started)
            metrics.checkpoint_bytes.inc(path.stat().st_size)

        handle.checkpoint_write = asyncio.ensure_future(asyncio.to_thread(write))
        handle.checkpoint_write.add_done_callback(_log_failed_checkpoint)

    def _forget_checkpoint(self, handle: SessionHandle) -> None:
        """A session that ended must never be adopted back from its last checkpoint."""
        folder = self.snapshot_folder
        if folder is None or not (self.settings.checkpoint_every_blocks or self.settings.checkpoint_interval_s):
            return
        pending = handle.checkpoint_write

        async def remove() -> None:
            if pending is not None:
                await asyncio.wait({pending})
            await asyncio.to_thread(remove_record, folder, handle.id)

        asyncio.ensure_future(remove())

    def peer_urls(self) -> list[str]:
        """Base URLs of the other replicas (setting ``peers``); this replica's own address is left out."""
        spec = self.settings.peers or ""
        if spec.startswith("dns:"):
            _, name, port = spec.split(":", 2)
            try:
                addresses = sorted({info[4][0] for info in socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)})
            except OSError:
                return []
            urls = [f"http://{'[' + a + ']' if ':' in a else a}:{port}" for a in addresses]
        else:
            urls = [part.strip().rstrip("/") for part in spec.split(",") if part.strip()]
        own = {f"http://{self.settings.host}:{self.settings.port}", f"http://127.0.0.1:{self.settings.port}",
               f"http://localhost:{self.settings.port}"}
        own |= {f"http://{a}:{self.settings.port}" for a in _own_addresses()}
        return [url for url in urls if url not in own]

    @property
    def snapshot_folder(self) -> Path | None:
        folder = self.settings.snapshot_dir
        return None if folder is None else Path(folder).expanduser()

    async def _adopt(self, folder: Path, session_id: str) -> SessionHandle | None:
        """Claim the session's file (None when another replica was first), load it and hold the session. An adopted
        session counts against max_sessions: when full, the file goes back and the request gets 503."""
        claimed = claim(folder, session_id, self.settings.replica_id)
        if claimed is None:
            return None
        try:
            self.registry.require_capacity()
        except ApiError:
            release_claim(claimed, session_id)
            raise
        try:
            record = await self.engine.call(lambda: load_record(claimed, self.refiner, self.stages, session_id,
                                                                     snapshot_limits(self.settings)))
        except Exception as exc:
            aside = folder / f"{session_id}{SUFFIX}.corrupt"
            log.warning("snapshot of %s cannot be adopted (%s); moved aside to %s", session_id, exc, aside.name)
            with contextlib.suppress(OSError):
                os.replace(claimed, aside)
            return None
        handle = self._hold(record)
        claimed.unlink(missing_ok=True)
        log.info("adopted session %s from %s", session_id, folder)
        return handle

    def _hold(self, record: SessionRecord) -> SessionHandle:
        # A session whose stream was open when it was saved waits ws_reattach_grace_s for its client.
        detached = record.streaming and not record.session.state.flushed
        handle = self.registry.adopt(record.session_id, record.session, detached=detached,
                                     outputs=record.outputs, stages=record.stages)
        if record.created_at is not None:
            handle.created_at = record.created_at
        handle.from_checkpoint = record.checkpoint
        chunks = handle.chunks
        chunks.next_seq, chunks.last_seq, chunks.last_response = record.next_seq, record.last_seq, record.last_response
        handle.first_block_done = record.session.state.blocks_refined > 0
        handle.retained.restore(record.units)
        if handle.deliveries is not None and record.units:
            handle.deliveries.handed_until = handle.engine_session.stages.key_at(record.units[-1].frame_end)
        return handle

    def _clean_snapshot_dir(self, folder: Path) -> None:
        """Writes that never reached their rename are garbage; claims of this replica id from an earlier life of
        it (a crash between claim and load) go back to the folder. Nothing else is touched: sessions are adopted on
        their first request, by whichever replica the router sends it to."""
        if not folder.is_dir():
            return
        for leftover in folder.glob(f".*{SUFFIX}.*.tmp"):
            leftover.unlink(missing_ok=True)
        for stale in folder.glob(f".*{SUFFIX}.claimed-{self.settings.replica_id}"):
            session_id = stale.name[1 : -len(f"{SUFFIX}.claimed-{self.settings.replica_id}")]
            with contextlib.suppress(OSError, ValueError):  # ValueError: not a session's name, not ours to move
                release_claim(stale, session_id)

    async def _evict_forever(self) -> None:
        settings = self.settings
        interval = min(settings.session_idle_timeout_s / 2, settings.ws_reattach_grace_s / 2, 5.0)
        while True:
            await asyncio.sleep(interval)
            if self.draining:
                # The sessions are saved as they stand; evicting them now would not remove their snapshots.
                continue
            evicted = self.registry.evict_idle()
            if evicted:
                log.info("evicted %d idle session(s)", len(evicted))

    async def drain(self) -> dict[str, Any]:
        """Stop admitting, finish in-flight blocks, save the sessions, close streams cleanly. Idempotent: later
        calls (SIGTERM after the admin route, then the lifespan) wait for the first and get its report."""
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        return await asyncio.shield(self._drain_task)

    async def _drain(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.draining = True
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
        handles = self.registry.handles()
        await asyncio.gather(*(h.deliveries.flush() for h in handles if h.deliveries is not None),
                             return_exceptions=True)
        # A checkpoint still being written must not land after (and over) the snapshot below.
        writes = [h.checkpoint_write for h in handles if h.checkpoint_write is not None]
        if writes:
            await asyncio.wait(writes)
        saved: set[str] = set()
        if self.settings.snapshot_dir is not None:
            saved = await self._save_sessions(Path(self.settings.snapshot_dir).expanduser(), handles)
        streams = list(self.streams)
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

    async def _save_sessions(self, folder: Path, handles: list[SessionHandle]) -> set[str]:
        """Write every live session to ``folder``, on the engine thread (paused by now, so no forward can run
        while a session is read). Returns the ids written."""
        # The service's fields that live on the loop are read here, on the loop.
        records = {handle.id: _record(handle, self.encoder) for handle in handles}

        def save_all() -> set[str]:
            written = set()
            for session_id, record in records.items():
                try:
                    save_record(folder, record())
                except Exception:  # one session that cannot be saved must not cost the others
                    log.exception("drain: could not save session %s", session_id)
                    continue
                written.add(session_id)
            return written

        try:
            written = await self.engine.call(save_all)
        except Exception:
            log.exception("drain: saving sessions to %s failed", folder)
            return set()
        log.info("drain: saved %d of %d session(s) to %s", len(written), len(handles), folder)
        return written

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


def _record(handle: SessionHandle, encoder: Encoder) -> Callable[[], SessionRecord]:
    """What saving ``handle`` writes, read now (on the loop); the returned function builds the record (on the
    engine thread: it may encode the last response)."""
    chunks = handle.chunks
    units = list(handle.retained)
    streaming = handle.streaming or handle.detached
    next_seq, last_seq = chunks.next_seq, chunks.last_seq

    def build() -> SessionRecord:
        return SessionRecord(handle.id, handle.session, next_seq, last_seq, chunks.stored_response(), units, streaming,
                             encode=encode, outputs=handle.outputs, stages=handle.engine_session.stages,
                             created_at=handle.created_at)

    def encode(unit: SentUnit) -> bytes:
        return encoder.unit_bytes(unit.host, unit.outputs, time.perf_counter())

    return build


def _log_failed_checkpoint(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("writing a checkpoint failed: %r", task.exception())


def _own_addresses() -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return set()


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
