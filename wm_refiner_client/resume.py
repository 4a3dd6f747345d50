"""The bookkeeping of a stream that survives reconnects, without any I/O (the sync and async clients share it).

A stream's frames are counted two ways. Going out, ``ChunkSource`` numbers the frames of the caller's chunks from
0 and keeps every message the server may not have yet, or may lose: a server that writes crash checkpoints says
in every unit (and the ``session`` event) how many input frames its last checkpoint covers (``durable_frames``), and
a message is kept until it is covered, since a crash brings the session back from that checkpoint, behind frames
already refined; without checkpoints a message goes once its frames came back refined. When a reconnect's
``session`` event says the server has ``frames_received`` of them, the source sends again from exactly there (a message lost in flight is not counted by
the server, so it is resent whole, its prompt with it). Coming back, ``UnitTracker`` counts the session's frames the
caller has got: a reconnect asks the server to resend from that count (``resume_from``), and a unit that straddles
it (the server resends units whole) is trimmed, so no frame is delivered twice; a unit beginning past the count
would skip frames and is a ``ProtocolError``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .errors import ProtocolError
from .units import Array, Unit, encode


@dataclass(frozen=True)
class Chunk:
    """One message of a stream: ``latents`` (B, C, t, H, W) and, to set or switch the prompt from these frames on,
    ``prompt`` (B, L, D) and optionally ``prompt_mask`` (B, L)."""

    latents: Array
    prompt: Array | None = None
    prompt_mask: Array | None = None

    @property
    def frames(self) -> int:
        return int(self.latents.shape[2])


@dataclass(frozen=True)
class _Sent:
    start: int  # frames of the source, end exclusive
    end: int
    chunk: Chunk


def as_chunk(item: Any) -> Chunk:
    if isinstance(item, Chunk):
        chunk = item
    elif isinstance(item, dict):
        unknown = sorted(set(item) - {"latents", "prompt", "prompt_mask"})
        if unknown or "latents" not in item:
            raise TypeError(f"a chunk dict holds 'latents'[, 'prompt', 'prompt_mask'], got {sorted(item)}")
        chunk = Chunk(item["latents"], item.get("prompt"), item.get("prompt_mask"))
    else:
        chunk = Chunk(item)
    if len(getattr(chunk.latents, "shape", ())) != 5:
        raise ValueError(
            f"latents must be shaped (B, C, t, H, W), got shape {tuple(getattr(chunk.latents, 'shape', ()))}"
        )
    return chunk


class ChunkSource:
    """The caller's chunks as stream messages, numbered in frames, with the ones the server may lack kept for a
    resend. Thread-safe: the sync client's sender thread adds while its receiver confirms.

    ``max_kept_bytes``: a bound on the input kept for frames that already came back refined but are not durable
    yet (the server's checkpoints lag, or fail); past it the oldest such messages go, and a reconnect to a
    checkpoint behind them fails with ``ProtocolError``. Messages not refined yet are always kept (an ordinary
    reconnect resends them); the stream's flow control bounds those."""

    def __init__(self, prompt: Array | None = None, prompt_mask: Array | None = None,
                 max_kept_bytes: int | None = None):
        self._first_prompt = (prompt, prompt_mask)
        self.max_kept_bytes = max_kept_bytes
        self._log: list[_Sent] = []  # oldest first, contiguous in frames
        self._refined = 0  # frames that came back refined
        self._durable: int | None = None  # frames the server's last checkpoint covers; None: it reports none
        self._over_bound = 0  # frames dropped past max_kept_bytes before they were durable
        self._resend: list[tuple[bytes, int]] = []  # (payload, frames)
        self._lock = threading.Lock()
        self.frames_added = 0  # frames taken from the caller
        self.frames_sent = 0  # frames handed to a connection (resends included once per connection)
        self.exhausted = False  # the caller's chunks are all taken
        self.skip = 0  # the server had this many of the source's frames before it began (``rewind(ahead=True)``)

    def add(self, item: Any) -> bytes | None:
        """Number and keep the caller's next chunk; its payload, or None for a chunk of no frames."""
        chunk = as_chunk(item)
        if chunk.frames == 0:
            return None
        with self._lock:
            if self.frames_added == 0 and chunk.prompt is None and self._first_prompt[0] is not None:
                chunk = Chunk(chunk.latents, *self._first_prompt)
            sent = _Sent(self.frames_added, self.frames_added + chunk.frames, chunk)
            self._log.append(sent)
            self.frames_added = sent.end
            if sent.end <= self.skip:
                return None  # the server has all of it (a rerun of the same clip)
            self.frames_sent += sent.end - max(sent.start, self.skip)
        return _payload(sent, max(sent.start, self.skip))

    @property
    def frames_known(self) -> int:
        """Frames of this source the server can have: those taken from the caller (each added before it is sent),
        or more that it reported having before they were taken (``skip``, a rerun)."""
        return max(self.frames_added, self.skip)

    def finish(self) -> None:
        self.exhausted = True

    def next_resend(self) -> bytes | None:
        """The next message to send again after a rewind, or None when there is none left."""
        with self._lock:
            if not self._resend:
                return None
            payload, frames = self._resend.pop(0)
            self.frames_sent += frames
            return payload

    def rewind(self, frames_received: int, *, ahead: bool = False) -> None:
        """The server has the first ``frames_received`` frames of this source: queue the rest again. ``ahead``: the
        source is the whole of what the session was sent (a rerun), so frames not taken from the caller yet may
        be among them; they are skipped as they are taken."""
        with self._lock:
            if ahead and frames_received > self.frames_added:
                self.skip = max(self.skip, frames_received)
            elif frames_received > self.frames_added:
                raise ProtocolError(
                    f"the server has {frames_received} frames of this stream but only {self.frames_added} were sent; "
                    "another client is sending to this session"
                )
            first_kept = self._log[0].start if self._log else self.frames_added
            if frames_received < first_kept:
                why = (f"the frames up to {self._over_bound} were no longer kept: over max_resend_bytes "
                       f"({self.max_kept_bytes} bytes of input the server had not made durable)"
                       if self._over_bound > frames_received else
                       f"frames before {first_kept} were confirmed as received earlier")
                raise ProtocolError(f"the server has only {frames_received} frames of this stream, but {why}")
            self._resend = [
                (_payload(sent, frames_received), sent.end - max(sent.start, frames_received))
                for sent in self._log
                if sent.end > frames_received
            ]
            self.frames_sent = frames_received

    def confirm(self, frames: int) -> None:
        """The first ``frames`` frames came back refined: the live server has them (and, when the server reports
        no checkpoints, nothing else could ask for them again)."""
        with self._lock:
            self._refined = max(self._refined, frames)
            self._drop()

    def durable(self, frames: int) -> None:
        """The server's last checkpoint covers the first ``frames`` frames: a crash cannot lose them any more.
        From the first call on, messages are kept until durable rather than until refined."""
        with self._lock:
            self._durable = max(self._durable or 0, frames)
            self._drop()

    def _drop(self) -> None:
        until = self._refined if self._durable is None else self._durable
        while self._log and self._log[0].end <= until:
            self._log.pop(0)
        if self.max_kept_bytes is None:
            return
        kept = sum(_nbytes(sent.chunk) for sent in self._log if sent.end <= self._refined)
        while self._log and kept > self.max_kept_bytes and self._log[0].end <= self._refined:
            dropped = self._log.pop(0)
            kept -= _nbytes(dropped.chunk)
            self._over_bound = dropped.end

    @property
    def kept_frames(self) -> int:
        with self._lock:
            return sum(sent.end - sent.start for sent in self._log)


def _nbytes(chunk: Chunk) -> int:
    return sum(int(getattr(array, "nbytes", 0) or 0) for array in (chunk.latents, chunk.prompt, chunk.prompt_mask)
               if array is not None)


def _payload(sent: _Sent, from_frame: int) -> bytes:
    """The message's bytes from ``from_frame`` on. A message the server never got is resent whole, with its
    prompt; a message it got (``from_frame`` inside) only for the rest, whose prompt is already in force."""
    chunk = sent.chunk
    if from_frame <= sent.start:
        return encode({"latents": chunk.latents, "prompt_embeds": chunk.prompt, "prompt_attention_mask": chunk.prompt_mask})
    return encode({"latents": chunk.latents[:, :, from_frame - sent.start :]})  # (B, C, t', H, W)


class UnitTracker:
    """How many of the session's latent (``frames``) and pixel (``video_frames``) frames the caller has."""

    def __init__(self, frames: int = 0, video_frames: int = 0):
        self.frames = frames
        self.video_frames = video_frames
        self.units = 0

    def accept(self, unit: Unit) -> Unit | None:
        """The part of ``unit`` the caller does not have yet, or None when it has all of it."""
        if unit.frame_start > self.frames:
            raise ProtocolError(
                f"the server sent frames [{unit.frame_start}, {unit.frame_end}) but frames from {self.frames} "
                "were never received: they would be skipped"
            )
        if unit.video_frame_start is not None and unit.video_frame_start > self.video_frames:
            raise ProtocolError(
                f"the server sent pixel frames from {unit.video_frame_start} but frames from {self.video_frames} "
                "were never received: they would be skipped"
            )
        new_latents = unit.frame_end > self.frames
        new_video = unit.video_frame_end is not None and unit.video_frame_end > self.video_frames
        if not new_latents and not new_video:
            return None
        fresh = unit.after(self.frames, self.video_frames)
        self.frames = max(self.frames, unit.frame_end)
        if unit.video_frame_end is not None:
            self.video_frames = max(self.video_frames, unit.video_frame_end)
        self.units += 1
        return fresh


def frames_before_flush(frames_received: int, config: dict[str, Any]) -> int:
    """How many of a session's ``frames_received`` frames come back before a flush: the sink once complete, then
    every full block (the rest waits for the flush). 0 when the config is unknown (nothing to wait for).

    A stream sends its flush only once these are back: the server answers messages in order, so an error about
    any message (a bad chunk) has arrived by then, and a stream that fails is never flushed behind its back."""
    sink, block = config.get("sink_frames"), config.get("block_size")
    if not isinstance(sink, int) or not isinstance(block, int) or block < 1 or frames_received < sink:
        return 0
    return sink + (frames_received - sink) // block * block
