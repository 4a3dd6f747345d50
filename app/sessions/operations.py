"""The session operations: what a request does to a session, once the route has parsed it.

Each route calls one of these and frames what it returns (an HTTP response, WebSocket messages and close codes);
the routes never see ``Work``, ``EngineSession`` or a handle's fields. An operation finds the session in the
store, runs its work on the engine, counts it, hands its units to the session's stream and watchers, and writes
its checkpoint when one is due. Errors are typed where they arise (``ApiError``, the engine's and the model's
own) and mapped to codes by ``app.core.error_kinds``.

    create, put, describe, list, delete      the session's life (POST/PUT/GET/DELETE /v1/sessions...)
    submit_chunk                             an HTTP chunk, all or nothing, with seq and replay
    open_stream -> StreamSession             a WebSocket stream: claim/release, resume, message, flush
    refine_clip                              a whole clip through a throwaway session
    watch, unwatch                           read-only subscribers

Bodies are read through a callable the route passes, so that the order of the checks a client sees (readiness,
the session, the content type, then the body) stays the one the API documents.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
import weakref
from dataclasses import replace
from typing import Any, Awaitable, Callable, Mapping, Protocol

from models import Prompt, Refiner, RefinerSession, SessionConfig
from models.session import check_finite
from models.vae import StreamingDecoder
from wm_refiner_client import spec

from app.core.chunk_request import ChunkRequest
from app.core.codec import EMPTY_CHUNK, EMPTY_MESSAGE, JSON_MESSAGE, LATENTS, PROMPT_EMBEDS, PROMPT_MASK, decode
from app.core.error_kinds import ApiError
from app.core.metrics import Metrics
from app.core.settings import Settings
from app.core.tasks import outlast, retrieve
from app.engine import pacing
from app.engine.worker import Engine, EngineSession, Work
from app.outputs.delivery import Deliveries, Encoder, UnitCopies, unit_metadata
from app.outputs.catalog import outputs_from_fields
from app.outputs.kinds import HostUnit, Outputs
from app.outputs.replay import SentUnit
from app.outputs.stage import OutputStages, OutUnit
from app.sessions import views
from app.sessions.limits import check_config_limits, check_payload
from app.sessions.peers import peer_headers, peer_position, peer_sessions, peer_urls
from app.sessions.registry import SessionHandle, page_after
from app.sessions.store import SessionStore
from app.sessions.subscriptions import StreamSubscriber, WatchSubscriber


class Runtime(Protocol):
    """What the operations use of the running app (``app.runtime.services.Services`` is one): handed in, so that
    this layer never imports the one that builds it."""

    settings: Settings
    metrics: Metrics
    engine: Engine
    encoder: Encoder
    store: SessionStore
    stages: OutputStages
    decoder: StreamingDecoder | None
    default_prompt: Prompt | None

    def require_ready(self) -> None: ...

    def require_model(self) -> Refiner: ...

ReadBody = Callable[[], Awaitable[bytes]]


class RefuseInBand(Exception):
    """A stream request refused after the handshake, with an error event (a bad ``resume_from``): many WebSocket
    clients cannot read a refused handshake's body, and a resuming client handles this in-band."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


class StreamTakenOver(Exception):
    """Another connection resumed the session while this one was attaching."""

    message = "another connection resumed this session"


class SessionOps:
    def __init__(self, services: Runtime):
        self.services = services
        self.settings = services.settings
        self._watching: dict[WatchSubscriber, SessionHandle] = {}  # each watcher's session, for unwatch
        # HTTP chunks handed to the engine, kept until done: one whose request went away still runs to its end,
        # and the loop holds tasks only weakly.
        self._chunks: set[asyncio.Future] = set()

    @property
    def store(self):
        return self.services.store

    # --- the session's life --------------------------------------------------------------------------------
    async def create(self, read_fields: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """A new session from the fields a client set (read after the readiness check)."""
        services = self.services
        services.require_ready()
        fields = await read_fields()
        flags = pacing.take_flags(fields)
        config, outputs = self.resolve_config(fields)
        handle = await self.store.create(services.require_model(), config, services.default_prompt, outputs,
                                         realtime=flags["realtime"])
        return {"session_id": handle.id, "config": {**config.to_dict(), **outputs.to_dict(), **flags}}

    async def put(self, session_id: str, read_fields: Callable[[], Awaitable[dict[str, Any]]]) -> tuple[dict[str, Any], bool]:
        """A session under the client's id; (its description, created). The same id and config again is a safe
        retry (created False); another config is 409."""
        services = self.services
        services.require_ready()
        try:
            spec.check_session_id(session_id)
        except ValueError as exc:
            raise ApiError("invalid_request", str(exc)) from None
        fields = await read_fields()
        flags = pacing.take_flags(fields)
        config, outputs = self.resolve_config(fields)
        body = {"session_id": session_id, "config": {**config.to_dict(), **outputs.to_dict(), **flags}}
        async with self.store.creating(session_id):  # the id checked free and taken in one turn
            try:
                existing = await self._existing(session_id)
            except ApiError as error:
                if error.kind != "session_evicted":
                    raise
                # A PUT is a creation: "create a new session" alone sent clients back to this same id.
                raise ApiError("session_evicted", f"{error.message} under another id (PUT /v1/sessions/{{another "
                                                  "id}}, or POST /v1/sessions for one the server picks): this id "
                                                  "stays taken while the server remembers it as evicted (its last "
                                                  "evicted_ids_remembered ended sessions), so that a client resuming "
                                                  "it learns that it is gone instead of finding it empty") from None
            if existing is not None:
                if existing.config == config and existing.outputs == outputs and pacing.flags_of(existing) == flags:
                    return body, False
                raise ApiError(
                    "session_exists",
                    f"session {session_id} already exists with another config "
                    f"({_differences(existing, config, outputs, flags)}); PUT it with the same config to get it "
                    "again, or choose another id",
                )
            # With a shared snapshot_dir, an id live on another replica is refused here (503 session_moved naming
            # it): its lease is held from the session's creation (SessionStore.create).
            handle = await self.store.create(services.require_model(), config, services.default_prompt, outputs,
                                             session_id=session_id, realtime=flags["realtime"])
        return {**body, "session_id": handle.id}, True

    async def _existing(self, session_id: str) -> SessionHandle | None:
        try:
            return await self.store.lookup(session_id)
        except ApiError as error:
            if error.kind == "session_not_found":
                return None
            raise  # 410 while remembered as evicted

    async def describe(self, session_id: str) -> dict[str, Any]:
        # A spilled session is described from what it was when spilled, not brought back for a GET.
        live = self.store.registry.existing(session_id) if spec.is_session_id(session_id) else None
        if live is not None:
            return views.description(live)  # read, not taken: a parked session stays parked
        spilled = await self.store.parking.read(session_id)
        if spilled is not None:
            return spilled
        return views.description(await self.store.lookup(session_id))

    async def delete(self, session_id: str) -> None:
        if self.store.registry.existing(session_id) is None and await self.store.parking.forget(session_id):
            return  # spilled: its file goes, nothing is loaded
        await self.store.lookup(session_id)  # a session saved by another replica is taken and ended here
        await self.store.delete(session_id)

    async def list(self, limit: int, after: str | None, scope: str) -> dict[str, Any]:
        """A page of sessions, oldest first. Behind a router (``peers`` set, scope ``deployment``) the deployment's
        (api.md 1.1): every peer's own sessions (asked with the replicas' credential, ``app.sessions.peers``), merged; a peer
        that gives no bounded, well-formed listing within 2 s in all is left out and named in ``"unreachable"``."""
        replica = self.settings.replica_id
        if scope == "local" or not self.settings.peers:
            page, following = await self.store.listing(limit, after)
            body = {"sessions": [{**views.summary(entry), "replica": replica} for entry in page], "next": following}
            if after is not None and (created_at := self.store.created_at(after)) is not None:
                body["after_created_at"] = views.iso_time(created_at)  # where the page starts (peers ask it)
            return body
        urls, headers = await peer_urls(self.settings), peer_headers(self.settings)
        mine = [{**views.summary(entry), "replica": replica} for entry in await self.store.everything()]
        theirs, unreachable = await peer_sessions(urls, headers)
        merged: dict[str, dict[str, Any]] = {}
        for entry in [*mine, *theirs]:
            merged.setdefault(entry["session_id"], entry)  # a session seen twice (mid-move): the first answer
        elsewhere = None
        if after is not None and after not in merged and self.store.registry.ended_position(after) is None:
            # Ended on another replica (the router sent the previous page's request there): that replica knows
            # where it stood.
            elsewhere = await peer_position(urls, headers, after)

        def ended(session_id: str) -> tuple[str, str] | None:  # one that ended lately (ISO times sort)
            position = self.store.registry.ended_position(session_id)
            if position is not None:
                return views.iso_time(position[0]), session_id
            return (elsewhere, session_id) if elsewhere is not None and session_id == after else None

        page, following = page_after(list(merged.values()), lambda e: (e["created_at"], e["session_id"]), after,
                                     limit, ended, "this deployment")
        body: dict[str, Any] = {"sessions": page, "next": following}
        if unreachable:
            body["unreachable"] = unreachable
        return body

    def resolve_config(self, fields: dict[str, Any]) -> tuple[SessionConfig, Outputs]:
        """The session's config and outputs from the fields a client set (JSON values, checked by the route's
        ``check_fields``): unset fields take the server's defaults; 422 for what the model or this server's limits
        refuse (video without a VAE among them)."""
        outputs = outputs_from_fields({name: fields.pop(name) for name in spec.OUTPUT_NAMES if name in fields},
                                      self.services.decoder is not None)
        defaults = self.settings.session_defaults().to_dict()
        config = check_config_limits(SessionConfig.from_dict({**defaults, **fields}), self.settings)
        return config, replace(outputs, fps=config.fps)  # the H.264 segments' timing

    # --- HTTP chunks -----------------------------------------------------------------------------------------
    async def submit_chunk(self, session_id: str, seq: int | None, flush: bool, read_payload: ReadBody,
                           ) -> tuple[bytes, bool]:
        """One chunk, all or nothing: (the response's bytes, replayed). A repeat of the last ``seq`` gets the
        stored response again instead of appending the frames twice, if it is the same request (body and flush;
        another one under that seq is 409). An empty body with ``flush`` is a flush
        without new frames (the stream's ``{"type": "flush"}``); without ``flush`` it is refused (400)."""
        services, settings = self.services, self.settings
        services.require_ready()
        handle = await self.store.lookup(session_id)
        handle.requests_in_flight += 1
        try:
            data = await read_payload()
            received = time.perf_counter()  # the body read: where the response's latency_ms starts (api.md)
            if not data and flush:
                tensors, latents = {}, None
            else:
                tensors = decode(data, empty=EMPTY_CHUNK)
                latents = check_payload(tensors, settings, settings.max_frames_per_chunk, "max_frames_per_chunk",
                                        services.require_model().info.in_channels)
                await scan_finite(tensors)
            request = None if seq is None else await chunk_request(data, flush)
            # Once the chunk is handed over it runs to the end and is counted even if this request goes away, so a
            # retry of its seq gets the stored response instead of appending the frames twice.
            chunk = asyncio.ensure_future(self._chunk(handle, seq, request, flush, tensors, latents, received))
            self._chunks.add(chunk)
            chunk.add_done_callback(_settled(self._chunks))
            return await asyncio.shield(chunk)
        finally:
            handle.requests_in_flight -= 1
            self.store.touch(handle)

    async def _chunk(self, handle: SessionHandle, seq, request, flush, tensors, latents, received
                     ) -> tuple[bytes, bool]:
        services, chunks = self.services, handle.chunks
        encoder = services.encoder
        async with chunks.turn(self.settings.session_queue_depth):
            if chunks.is_repeat(seq, request):
                return await encoder.run(chunks.stored_response), True
            await self.store.prepare(handle, None if latents is None else tuple(latents.shape),
                                     _prompt_tokens(tensors.get(PROMPT_EMBEDS)))
            # No frames (an empty flush): the shape of the zero-frame chunk the engine appends for it.
            shape = tuple((handle.session.empty_latents() if latents is None else latents).shape)
            work = Work(handle.engine_session, latents, tensors.get(PROMPT_EMBEDS), tensors.get(PROMPT_MASK),
                        flush=flush, atomic=True, finite_checked=True)
            result = await services.engine.run(work)
            # Counted before anything else runs on the loop: a drain must never find the session advanced and the
            # chunk uncounted. Until it is encoded, the response is kept (for a repeated seq) as what builds it.
            # One host copy of each unit for the response and the watchers (its video encoded once for all).
            copies = [UnitCopies(unit, services.stages) for unit in result.units]
            metadata = unit_metadata(chunks.next_seq, durable_metadata(handle))
            build = encoder.response(copies, result.state, shape, metadata, outputs=handle.outputs,
                                     positions=result.positions, received=received)
            index = chunks.accept_request(seq, build, request)
            # A chunk accepted over HTTP means the client is back: a detached session's grace period ends (a stream
            # message of the dropped connection, still finishing, does not count).
            self.store.registry.attach(handle)
            services.metrics.frames_in.inc(result.frames_in)
            self.count_out(result.units, handle, received)
            self._offer(handle, copies, received, metadata, done=result.state.flushed)
            response = asyncio.ensure_future(encoder.run(build))
            retaining = self._retain(handle, copies, received, metadata, response)
            try:
                payload = await response
            finally:
                # Within the turn, so the next chunk's units are kept after these; waited for, not awaited: a
                # response that failed keeps its own error.
                if retaining is not None:
                    await asyncio.wait([retaining])
            chunks.store(index, payload)
            # Still within the turn: no other chunk of this session runs.
            await self.store.checkpoints.write_due(handle)
            return payload, False

    # --- one-shot clips --------------------------------------------------------------------------------------
    async def refine_clip(self, read_fields: Callable[[], dict[str, Any]], read_payload: ReadBody) -> bytes:
        """A whole clip through a throwaway session that holds one of ``max_sessions`` places while it runs; its
        forwards take turns (and share model calls) with the sessions'. A client that goes away stops it at the
        next block."""
        services, settings = self.services, self.settings
        services.require_ready()
        config, wanted = self.resolve_config(read_fields())
        data = await read_payload()
        received = time.perf_counter()  # the body read: where the response's latency_ms starts (api.md)
        tensors = decode(data)
        latents = check_payload(tensors, settings, settings.max_clip_frames, "max_clip_frames",
                                services.require_model().info.in_channels)
        await scan_finite(tensors)
        if PROMPT_EMBEDS not in tensors and services.default_prompt is None:
            raise ApiError(
                "missing_input",
                "the payload has no 'prompt_embeds' tensor; a clip needs prompt_embeds (B, L, caption_channels) and "
                "optionally prompt_attention_mask (B, L) (this server has no default_prompt)",
            )
        self.store.admit()  # its place first: no session is parked for a clip max_sessions refuses anyway
        refiner = services.require_model()
        # Its KV cache and, unlike a session's, every frame of the clip pending at once.
        need = self.store.parking.estimate(config, tuple(latents.shape)) + latents.numel() * refiner.dtype.itemsize
        async with self.store.parking.clip(need):  # its bytes (device_memory_budget), then its place (max_sessions)
            with self.store.clip():
                result = await self._clip(config, wanted, latents, tensors)
        self.services.metrics.frames_in.inc(result.frames_in)  # a clip's frames count in, as a chunk's do
        self.count_out(result.units)
        # The clip is its throwaway session's one chunk: seq 0, as the first chunk of a session would say.
        return await services.encoder.run(services.encoder.response(
            result.units, result.state, tuple(latents.shape), unit_metadata(0), outputs=wanted,
            positions=result.positions, received=received))

    async def _clip(self, config, wanted, latents, tensors):
        services = self.services
        session = RefinerSession(services.require_model(), config, services.default_prompt)
        target = EngineSession(session=session, name="one-shot clip", stages=services.stages.for_session(wanted, config))
        work = Work(target, latents, tensors.get(PROMPT_EMBEDS), tensors.get(PROMPT_MASK), flush=True, one_shot=True,
                    finite_checked=True)
        run = asyncio.ensure_future(services.engine.run(work))
        try:
            return await asyncio.shield(run)
        except asyncio.CancelledError:
            # The engine drops it at its next block; until then its tensors are held, so its place and its bytes
            # (device_memory_budget) stay counted: the caller gives them back only once this returns.
            target.closed = ApiError("invalid_request", "the client went away before its clip was refined")
            await outlast(run)  # through a second cancellation too (the server's shutdown)
            retrieve(run)  # nobody is left to tell
            raise

    # --- streams ---------------------------------------------------------------------------------------------
    async def open_stream(self, session_id: str, resume_from: str | None) -> StreamSession:
        """The session for a new WebSocket stream. ApiError: refuse the handshake; RefuseInBand: accept, say why
        and close (a bad resume). Nothing is taken over yet (``StreamSession.claim`` does)."""
        self.services.require_ready()
        handle = await self.store.lookup(session_id)
        try:
            start = parse_resume_from(resume_from)
            if start is not None:
                # Refused before taking anything over, so a bad resume leaves the session and its stream as they
                # were. Frames still being refined for the old connection may make a larger resume_from valid, so
                # that bound is only checked here when nothing is in flight (and again once it is).
                frames_returned = handle.session.state.frames_returned
                if handle.from_checkpoint:
                    # Adopted from a crash checkpoint: the client may hold frames the session has to refine again.
                    start = max(start, 0)
                else:
                    handle.retained.check(start, frames_returned if not handle.stream_jobs else start)
        except ApiError as error:
            raise RefuseInBand(error) from None
        if handle.streaming and start is None:
            raise ApiError(
                "stream_in_use",
                f"session {session_id} already has an open stream; close it before opening another, or "
                "reconnect with ?resume_from=N to take the session over",
            )
        if handle.session.state.flushed and start is None:
            # A new stream could only be refused chunk by chunk; a client that lost the tail reconnects with
            # resume_from.
            raise ApiError(
                "stream_closed",
                f"session {session_id} was flushed and takes no more frames; reconnect with ?resume_from=N (the "
                "frames you received) to get the units you missed, or create a new session",
            )
        return StreamSession(self, handle, start)

    def stream_for(self, handle: SessionHandle, resume_from: int | None = None) -> StreamSession:
        """A stream on a session already looked up (tests drive a connection with it directly)."""
        return StreamSession(self, handle, resume_from)

    # --- watchers --------------------------------------------------------------------------------------------
    async def watch(
        self, session_id: str, query: Mapping[str, str | None], subscribe: Callable[[str, Outputs], WatchSubscriber],
    ) -> WatchSubscriber:
        """Add a read-only subscriber asking for ``query`` (``outputs``, ``video_format``, ``video_quality``,
        ``resume_from``, each text or None; any other parameter was refused before the route ran,
        ``app.api.factory.QueryRule``): ``subscribe(session_id, outputs)`` builds it (the route's
        ``app.sessions.subscriptions.WatchSubscriber``); it gets every unit published from now on and, with
        ``resume_from=N``, first the retained units holding frames at or after N that watchers were offered before
        it joined. The replay is taken and the watcher registered in one step, after the last await, so that a unit
        published meanwhile is either replayed or offered live, never both and never neither. ApiError: refuse the
        handshake; RefuseInBand: accept, say why and close (a bad ``resume_from``, as a stream's)."""
        self.services.require_ready()
        handle = await self.store.lookup(session_id)
        try:
            start = parse_resume_from(query.get("resume_from"))
        except ApiError as error:
            raise RefuseInBand(error) from None
        while start is not None and handle.retaining is not None:
            # An HTTP response's units, offered already, being kept (``_retain``): the replay must reach them.
            await asyncio.wait([handle.retaining])
            # Looked up again: a session ended meanwhile (deleted, evicted, moved) told the watchers it had, not
            # this one, which nothing would end once registered on it; it is refused as a watch of it is now.
            handle = await self.store.lookup(session_id)
        outputs = handle.outputs.restrict(query.get("outputs"), query.get("video_format"), query.get("video_quality"))
        if len(handle.watchers) >= self.settings.max_watchers:
            # over_capacity, as a watcher past max_watch_encodings is: the engine is not what is busy.
            raise ApiError(
                "over_capacity",
                f"session {session_id} already has {len(handle.watchers)} watchers (max_watchers "
                f"{self.settings.max_watchers}); retry once one of them leaves",
                retry_after_s=self.settings.retry_after_s,
                fields={"watchers": len(handle.watchers), "max_watchers": self.settings.max_watchers},
            )
        self._check_watch_encodings(handle, outputs)
        replay: list[SentUnit] = []
        if start is not None:
            try:
                replay = self._watch_replay(handle, start, outputs)
            except ApiError as error:
                raise RefuseInBand(error) from None
        watcher = subscribe(handle.id, outputs)
        handle.watchers.add(watcher)
        self.store.connections.add(watcher)
        self._watching[watcher] = handle
        if start is not None:
            watcher.replay(replay, handle.outputs, start)
        if handle.finished:
            # Flushed before it joined: no unit will come, and the flush's "done" went out already. Said now, or the
            # watcher would wait for the session's release (flushed_session_ttl_s) and end with an error.
            watcher.finish(handle.session.state.frames_returned)
        return watcher

    def _watch_replay(self, handle: SessionHandle, start: int, outputs: Outputs) -> list[SentUnit]:
        """The retained units a watcher resuming from frame ``start`` missed (``RetainedUnits.replay``), by the
        rules of a stream's resume: ``start`` within the frames returned (an adopted crash checkpoint may be behind
        the client: any ``start`` then, its frames come again live), and the units in the watcher's outputs."""
        frames_returned = handle.session.state.frames_returned
        if start > frames_returned and not handle.from_checkpoint:
            raise ApiError(
                "invalid_request",
                f"resume_from={start} is outside [0, {frames_returned}]: this session has returned "
                f"{frames_returned} frames; pass the number of frames you received",
            )
        units = handle.retained.replay(start, handle.offered_until)
        own = handle.outputs
        if outputs.video and own.video and any(unit.payload is not None for unit in units) and (
                (outputs.video_format, outputs.video_quality) != (own.video_format, own.video_quality)):
            # The kept units hold the video as the session encodes it; encoding it again would need the frames it
            # was encoded from (gone, or lossy for jpeg and h264).
            raise ApiError(
                "invalid_request",
                f"resume_from={start} sends again the units the session kept, whose video is in the session's own "
                f"encoding (video_format={own.video_format}, video_quality={own.video_quality}), not the "
                f"video_format={outputs.video_format}, video_quality={outputs.video_quality} this watch asks for; "
                "resume without video_format and video_quality (the session's own video) or without video "
                "(outputs=latents), or watch without resume_from (from now on)",
            )
        return units

    def _check_watch_encodings(self, handle: SessionHandle, outputs: Outputs) -> None:
        """503 over_capacity when a watcher of ``outputs`` would add a video encoding past ``max_watch_encodings``
        (distinct (video_format, video_quality) pairs beyond the producer's). Each one costs encoder CPU per unit
        however many watchers share it, on a machine whose cores the engine needs: bounded, so that watchers
        never slow the producer down (issue 25 item 7). A watcher asking for an encoding already asked for, the
        producer's own, or no video adds none."""
        added = _watch_encoding(handle.outputs, outputs)
        if added is None:
            return
        limit = self.settings.max_watch_encodings
        asked = sorted({pair for watcher in handle.watchers
                        if (pair := _watch_encoding(handle.outputs, getattr(watcher, "outputs", None))) is not None},
                       key=repr)
        if added in asked or len(asked) < limit:
            return
        named = ", ".join(f"video_format={fmt}" + ("" if quality is None else f"&video_quality={quality}")
                          for fmt, quality in asked) or "none"
        raise ApiError(
            "over_capacity",
            f"session {handle.id}'s watchers already ask for {len(asked)} video encoding(s) besides the producer's "
            f"(max_watch_encodings {limit}): {named}. Watch with one of those, with the session's own video (no "
            "video_format or video_quality), or without video (outputs=latents); or retry once a watcher leaves",
            retry_after_s=self.settings.retry_after_s,
            fields={"watch_encodings": [list(pair) for pair in asked], "max_watch_encodings": limit},
        )

    def unwatch(self, watcher: WatchSubscriber) -> None:
        handle = self._watching.pop(watcher, None)
        if handle is not None:
            handle.watchers.discard(watcher)
        self.store.connections.discard(watcher)

    # --- units out -------------------------------------------------------------------------------------------
    def count_out(self, units, handle: SessionHandle | None = None, received: float | None = None) -> None:
        """Metrics for units delivered to a client (a published stream unit, a returned response)."""
        metrics = self.services.metrics
        for unit in units:
            metrics.frames_out.inc(unit.frame_end - unit.frame_start)
            if unit.kind != "block":
                continue
            metrics.blocks_refined.inc()
            if handle is not None and not handle.first_block_done and received is not None:
                handle.first_block_done = True
                metrics.time_to_first_block.observe(time.perf_counter() - received)

    def deliveries_for(self, handle: SessionHandle) -> Deliveries:
        """The session's deliveries (``app.outputs.delivery``: its stream units from commit to publication). They
        call back into this layer in two places only, both given here: ``published`` once a unit is encoded, in
        commit order, and ``durable_metadata`` for what each unit says of the session's last checkpoint.

        Both hold the handle weakly: the handle holds its deliveries, and a strong reference back made a cycle that
        kept every ended session (its KV cache: ~9.6 GiB of device memory at 720p) until Python's cyclic collector
        happened to run. A handle gone is a session nobody serves any more: nothing is left to publish to."""
        session = weakref.ref(handle)

        def publish(*args) -> None:
            live = session()
            if live is not None:
                self.published(live, *args)

        def metadata() -> dict[str, str]:
            live = session()
            return {} if live is None else durable_metadata(live)

        deliveries = Deliveries(self.services.encoder, publish, handle.outputs)
        deliveries.metadata = metadata
        return deliveries

    def published(self, handle: SessionHandle, unit: OutUnit, sent: SentUnit, received: float,
                  host: HostUnit, metadata: dict[str, str]) -> None:
        """A stream unit of ``handle`` is ready (on the loop, in commit order): counted, retained for a reattach,
        sent to the stream subscribed to the session if any (while detached it is only retained, for the client's
        reconnect) and offered to its watchers with the unit's ``metadata`` (seq, durable_frames), and the session's
        own bytes when a watcher wants the same outputs. Subscribers are reached through
        ``app.sessions.subscriptions`` only."""
        self.count_out([unit], handle, received)
        handle.retained.add(sent)
        handle.offered_until = max(handle.offered_until, sent.frame_end)
        if handle.stream is not None:
            handle.stream.send_unit(sent)
        for watcher in list(handle.watchers):
            watcher.offer(host, received, sent if watcher.outputs == handle.outputs else None, metadata)

    def _offer(self, handle: SessionHandle, units, received: float, metadata: dict[str, str],
               done: bool = False) -> None:
        """Offer units that went out another way (an HTTP response) to the session's watchers, with the response's
        ``metadata`` (seq, durable_frames); ``done``: the session was flushed with them."""
        watchers = list(handle.watchers)
        for unit in units:
            described = unit.unit if isinstance(unit, UnitCopies) else unit
            handle.offered_until = max(handle.offered_until, described.frame_end)
        if watchers:
            # One host copy per unit, whatever the number of watchers.
            copies = [unit if isinstance(unit, UnitCopies) else UnitCopies(unit, self.services.stages)
                      for unit in units]
            for watcher in watchers:
                for unit in copies:
                    watcher.offer(unit, received, None, metadata)
        if done:
            self._finish_watchers(handle)

    def _retain(self, handle: SessionHandle, copies: list[UnitCopies], received: float,
                metadata: dict[str, str], response: asyncio.Future) -> asyncio.Future | None:
        """Keep an HTTP response's units with the session's retained units (``ws_resume_units``), so that a
        watcher's ``resume_from`` sends them again, on this replica or one that adopts the session. Each is
        encoded as a watcher of the session's outputs gets it (from the response's host copies: the video is
        encoded once), after every stream unit committed before them is retained, so the window stays in frame
        order. Until they are kept, ``handle.retaining`` says so: a watcher's resume waits for it, since they were
        offered to watchers already (``offered_until``). A unit that cannot be encoded (the response fails with
        it) is not kept, nor any after it: a resume from before them is ``resume_unavailable``, never a hole.
        None with ``ws_resume_units: 0``: nothing is kept, so nothing is encoded for it and the response waits for
        nothing.

        A response of one unit with a payload of every output kind (a chunk of one block, the usual case) is that
        unit's bytes as a watcher gets them: ``response`` (its bytes, being built) is kept as they are, so the unit
        is serialized once and a resuming watcher gets exactly the bytes the HTTP client got. Each unit of another
        response is encoded on its own (a watcher gets a response's units one by one)."""
        if not handle.retained.capacity:
            return None
        encoder, outputs = self.services.encoder, handle.outputs

        def encode(unit: UnitCopies) -> bytes:
            return encoder.unit_bytes(unit.wait(), outputs, received, metadata)

        async def retain() -> None:
            if handle.deliveries is not None:
                await handle.deliveries.flush()
            kept = copies[-handle.retained.capacity:]  # the window keeps no more
            if len(copies) == 1 and set(outputs.kinds) <= set(copies[0].unit.payloads):
                encoded = await asyncio.gather(asyncio.shield(response), return_exceptions=True)
            else:
                encoded = await asyncio.gather(*(encoder.run(functools.partial(encode, unit)) for unit in kept),
                                               return_exceptions=True)
            for unit, data in zip(kept, encoded):
                if isinstance(data, BaseException):
                    return
                handle.retained.add(SentUnit(unit.unit.frame_start, unit.unit.frame_end, data, in_response=True))

        task = asyncio.ensure_future(retain())
        handle.retaining = task

        def settled(done: asyncio.Future) -> None:
            if handle.retaining is done:
                handle.retaining = None
            retrieve(done)

        task.add_done_callback(settled)
        return task

    def _finish_watchers(self, handle: SessionHandle) -> None:
        handle.finished = True
        frames = handle.session.state.frames_returned
        for watcher in list(handle.watchers):
            watcher.finish(frames)


class StreamSession:
    """One WebSocket connection's hold on its session: what ``app.api.routes.stream.StreamConnection`` asks of it.

    The connection is the session's (``claim``) from before its first await until ``release``; a later connection
    with ``?resume_from=N`` takes it over (``resume`` abandons this one). Messages handed to the engine belong to
    the session, not the connection: if the client drops they still run to the end, are counted, and their units
    are retained for a reattach."""

    def __init__(self, ops: SessionOps, handle: SessionHandle, resume_from: int | None):
        self.ops = ops
        self.handle = handle
        self.resume_from = resume_from
        self.previous: StreamSubscriber | None = None  # the connection this one takes over, if any
        self._claimed = False

    @property
    def session_id(self) -> str:
        return self.handle.id

    @property
    def pending_units(self) -> int:
        """Units committed and still being encoded: they are the connection's as soon as they are published."""
        return self.handle.deliveries.pending

    def claim(self, connection: StreamSubscriber) -> None:
        """Register ``connection`` as the session's stream subscription (``app.sessions.subscriptions``): units go
        to its ``send_unit`` from now on, and a drain closes it."""
        if self._claimed:
            return
        self._claimed = True
        handle = self.handle
        self.previous = handle.stream
        handle.stream = connection
        handle.streaming = True
        self.ops.store.registry.attach(handle)
        self.ops.store.connections.add(connection)

    def release(self, connection: StreamSubscriber, dropped: bool) -> None:
        """The connection ended; ``dropped``: its client went away (rather than the server closing it)."""
        store = self.ops.store
        store.connections.discard(connection)
        handle = self.handle
        if handle.stream is connection:  # not taken over by a newer connection
            handle.stream = None
            handle.streaming = False
            store.touch(handle)
            # The client left before the end of the stream: keep the session ws_reattach_grace_s for it to
            # reattach. A stream the server closed (an error, a deletion) leaves the session as it was.
            if dropped and not handle.session.state.flushed:
                store.registry.detach(handle)

    def touch(self) -> None:
        self.ops.store.touch(self.handle)

    async def settle(self) -> None:
        """Every unit already committed handed to the connection (or retained)."""
        await self.handle.deliveries.flush()

    async def resume(self, connection: StreamSubscriber, timeout: float) -> tuple[dict[str, Any], list[SentUnit]]:
        """Take the session over for a resuming ``connection``: the previous connection is abandoned, the messages
        it handed over are waited for (so the frame counts are final and the client resends exactly the rest).
        Returns the ``session`` event and the retained units to send again; the caller sends them and attaches
        without awaiting in between, so a unit published meanwhile is either among them or sent live.
        StreamTakenOver: an even newer connection took over meanwhile; ApiError: engine_busy (the old messages
        are still running) or a resume_from the retained units cannot serve."""
        handle = self.handle
        previous = self.previous
        if previous is not None and previous is not connection:
            previous.abandon()
            # wait_for, not wait: on a timeout the wait is cancelled rather than left running unreferenced.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(previous.closed(), timeout=timeout)
        if handle.stream is not connection:
            raise StreamTakenOver()
        jobs = list(handle.stream_jobs)
        if jobs:
            await asyncio.wait(jobs, timeout=timeout)
        if handle.stream_jobs:
            # Counts taken now could still move, and the client would resend frames the session gets anyway.
            raise ApiError("engine_busy",
                           "the previous connection's messages are still being refined; reconnect shortly")
        # Units committed for those messages may still be on their way (encoding): retain them all first.
        await handle.deliveries.flush()
        if handle.stream is not connection:
            raise StreamTakenOver()
        state = handle.session.state
        # After a crash, the checkpoint may be behind the client: its refined frames come again, bit-identical,
        # and the ones the client has are not sent twice.
        units = handle.retained.resume(min(self.resume_from, state.frames_returned), state.frames_returned)
        event = {
            "type": "session",
            "session_id": handle.id,
            "frames_received": state.frames_received,
            "frames_returned": state.frames_returned,
            "pending_frames": state.pending_frames,
            "next_seq": handle.chunks.next_seq,
            "flushed": state.flushed,
            "resume_from": self.resume_from,
            "resent_from": units[0].frame_start if units else state.frames_returned,
            **({} if handle.durable_frames is None else {"durable_frames": handle.durable_frames}),
        }
        return event, units

    async def message(self, data: bytes) -> None:
        """One binary message: a chunk payload, refined and published unit by unit."""
        received = time.perf_counter()
        services, settings = self.ops.services, self.ops.settings
        tensors = decode(data, empty=EMPTY_MESSAGE, json_text=JSON_MESSAGE)
        latents = check_payload(tensors, settings, settings.max_frames_per_chunk, "max_frames_per_chunk",
                                services.require_model().info.in_channels)
        await scan_finite(tensors)
        services.require_ready()
        await self._run(latents, tensors.get(PROMPT_EMBEDS), tensors.get(PROMPT_MASK), False, received)

    @property
    def frames_received(self) -> int:
        """The frames the session holds (a client resends from here after an error that dropped frames)."""
        return self.handle.session.state.frames_received

    async def flush(self) -> int:
        """The client's flush: the pending frames refined as a final block (once; a second flush just repeats
        "done"), every unit delivered, the watchers done. Returns the frames the session returned."""
        handle = self.handle
        if not handle.session.state.flushed:
            self.ops.services.require_ready()
            await self._run(None, None, None, True, time.perf_counter())
        await handle.deliveries.flush()  # every unit queued before "done"
        self.ops._finish_watchers(handle)
        return handle.session.state.frames_returned

    def encode_again(self, unit: SentUnit) -> bytes:
        """A retained unit's bytes when its first encoding failed (a resume sends it again)."""
        return self.ops.services.encoder.unit_bytes(unit.host, unit.outputs, time.perf_counter(), unit.metadata)

    async def _run(self, latents, embeds, mask, flush: bool, received: float) -> None:
        """Hand one message to the session and wait for it; it runs to the end even if the connection goes."""
        task = asyncio.ensure_future(self._message(latents, embeds, mask, flush, received))
        jobs = self.handle.stream_jobs
        jobs.add(task)

        def settled(done: asyncio.Future) -> None:
            jobs.discard(done)
            retrieve(done)  # a job whose connection is gone must not log "never retrieved"

        task.add_done_callback(settled)
        await asyncio.shield(task)

    async def _message(self, latents, embeds, mask, flush: bool, received: float) -> None:
        """One stream message through the session's chunk turn and the engine, counted as accepted once appended;
        every unit it committed is handed to the session's deliveries (again, if a hand-over failed)."""
        services, handle = self.ops.services, self.handle
        async with handle.chunks.turn(self.ops.settings.session_queue_depth):
            seq = handle.chunks.next_seq  # this message's, once accepted below: its units say so
            await self.ops.store.prepare(handle, None if latents is None else tuple(latents.shape),
                                         _prompt_tokens(embeds))
            work = Work(handle.engine_session, latents, embeds, mask, flush=flush, finite_checked=True,
                        on_unit=handle.deliveries.hand_over(received, seq))
            try:
                await services.engine.run(work)
            finally:
                # A message whose block refined to NaN/Inf and was rolled back never happened (engine, _fail).
                if work.started and not work.rolled_back:
                    handle.chunks.accept_message()
                    services.metrics.frames_in.inc(work.frames_in)
                for unit in work.withdrawn:  # undone after a late NaN/Inf verdict (app.engine.worker): never published
                    handle.deliveries.withdraw(unit)
                for unit in work.units:
                    handle.deliveries.push(unit, None, received, seq)
            if work.started and not work.rolled_back:
                # Still within the turn: no other chunk of this session runs.
                await self.ops.store.checkpoints.write_due(handle)


def durable_metadata(handle: SessionHandle) -> dict[str, str]:
    """What a unit or a response says of the session's last checkpoint: the input frames it covers (a client keeps
    what it may have to resend until then). Nothing when this server writes no checkpoints."""
    return {} if handle.durable_frames is None else {"durable_frames": str(handle.durable_frames)}


def _settled(running: set[asyncio.Future]) -> Callable[[asyncio.Future], None]:
    def settled(done: asyncio.Future) -> None:
        running.discard(done)
        retrieve(done)  # the request that awaited it may be gone; its own caller saw the error

    return settled


async def scan_finite(tensors: dict[str, Any]) -> None:
    """The chunk's NaN/Inf scan, before it is submitted: on a worker thread, so that neither the event loop nor
    the engine thread (other sessions' forwards) waits for a scan of a large chunk. Same error as the session's
    own check (invalid_input, naming the tensor and the count)."""
    floats = {name: tensors.get(name) for name in (LATENTS, PROMPT_EMBEDS, PROMPT_MASK)}
    if sum(tensor.nbytes for tensor in floats.values() if tensor is not None) <= _INLINE_SCAN_BYTES:
        check_finite(floats)  # microseconds: cheaper than the hop to a thread
    else:
        await asyncio.to_thread(check_finite, floats)


# Chunks up to this size are scanned on the event loop (a 256 KiB isfinite takes tens of microseconds).
_INLINE_SCAN_BYTES = 256 * 1024


async def chunk_request(body: bytes, flush: bool) -> ChunkRequest:
    """The identity of a chunk sent with a ``seq`` (its repeat must equal it), hashed on a worker thread when the
    body is large: SHA-256 of a 64 MiB body takes ~40 ms (``app.core.chunk_request``), which on the event loop would
    stall every other request; up to ``_INLINE_DIGEST_BYTES`` (~0.15 ms) the hop to a thread costs more."""
    if len(body) <= _INLINE_DIGEST_BYTES:
        return ChunkRequest.of(body, flush)
    return await asyncio.to_thread(ChunkRequest.of, body, flush)


_INLINE_DIGEST_BYTES = 256 * 1024


def parse_resume_from(value: str | None) -> int | None:
    if value is None:
        return None
    # Decimal digits only, like every integer in a query (``app.api.deps.PlainInteger``): int() would take "+4",
    # "4_0" (as 40) or other scripts' digits, and the error would then name a number the client never sent.
    number = int(value) if re.fullmatch(r"[0-9]{1,19}", value) else -1
    if number < 0:
        raise ApiError(
            "invalid_request",
            f"resume_from={value!r} is not a frame index; pass the number of frames received so far (>= 0)",
        )
    return number


def _differences(existing: SessionHandle, config: SessionConfig, outputs: Outputs, flags: dict[str, Any]) -> str:
    have = {**existing.config.to_dict(), **existing.outputs.to_dict(), **pacing.flags_of(existing)}
    want = {**config.to_dict(), **outputs.to_dict(), **flags}
    return ", ".join(f"{name}: {have[name]!r} there, {want[name]!r} asked" for name in want if have[name] != want[name])


def _prompt_tokens(embeds) -> int | None:
    """L of a prompt (B, L, caption_channels) a message brings (its bytes are reserved before it runs); None: none
    (or a malformed one, which the session refuses with what to send instead)."""
    if embeds is None or getattr(embeds, "ndim", 0) != 3:
        return None
    return int(embeds.shape[1])


def _watch_encoding(producer: Outputs, outputs: Outputs | None) -> tuple[str, int | None] | None:
    """The video encoding (video_format, video_quality) a watcher of ``outputs`` adds to the producer's, or None:
    no video, or the producer's own (its bytes are reused)."""
    if outputs is None or not outputs.video:
        return None
    pair = (outputs.video_format, outputs.video_quality)
    if producer.video and pair == (producer.video_format, producer.video_quality):
        return None
    return pair
