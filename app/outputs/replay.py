"""What a session keeps so a WebSocket client can reattach without losing or duplicating a frame.

Bookkeeping only (no tensors): the encoded units a session already returned, on its stream or in HTTP responses,
newest last, bounded by a count. A client that reconnects names the first frame it has not received
(``resume_from``); every retained unit that holds frames at or after it is sent again (to a stream, those it
streamed: the others were answered in their HTTP responses), and the older ones are no longer needed and are dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from app.core.codec import decode_response, encode, read_metadata
from app.core.error_kinds import ApiError


@dataclass(frozen=True)
class SentUnit:
    """One finalized unit as it goes over the wire: frames ``[frame_start, frame_end)`` and its bytes, or, when
    encoding it failed, its tensors on the host (``app.outputs.kinds.HostUnit``), the session's outputs and the
    metadata its bytes carry besides frames and latency (``seq``, ...), encoded again when it is next sent.
    ``in_response``: it was returned in an HTTP response, so a stream's resume does not send it (api.md: an HTTP
    chunk's units are answered in its response only); a watcher's resume does."""

    frame_start: int
    frame_end: int
    payload: bytes | None
    host: Any = None
    outputs: Any = None
    metadata: Any = None
    in_response: bool = False

    def data(self, encode: Callable[[SentUnit], bytes]) -> bytes:
        return self.payload if self.payload is not None else encode(self)


class RetainedUnits:
    """The last ``capacity`` units of a session, in frame order."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._units: deque[SentUnit] = deque()

    def __len__(self) -> int:
        return len(self._units)

    def __iter__(self):
        return iter(self._units)

    @property
    def nbytes(self) -> int:
        return sum(len(unit.payload) if unit.payload is not None else unit.host.nbytes for unit in self._units)

    def add(self, unit: SentUnit) -> None:
        if self._units and unit.frame_start != self._units[-1].frame_end:
            # Frames in between were not kept (an HTTP response's unit that could not be encoded, a record saved
            # without them): what is kept must be contiguous, or a resume would hand the client a hole.
            self._units.clear()
        self._units.append(unit)
        while len(self._units) > self.capacity:
            self._units.popleft()

    def check(self, resume_from: int, frames_returned: int) -> None:
        """ApiError when a client that has every frame before ``resume_from`` cannot be served; changes
        nothing."""
        if resume_from < 0 or resume_from > frames_returned:
            raise ApiError(
                "invalid_request",
                f"resume_from={resume_from} is outside [0, {frames_returned}]: this session has returned "
                f"{frames_returned} frames; pass the number of frames you received",
            )
        first = self.first_frame(frames_returned)
        if resume_from < first:
            raise ApiError(
                "resume_unavailable",
                f"frames [{resume_from}, {first}) are no longer kept for a stream (ws_resume_units={self.capacity}; "
                "a stream is sent again the units it streamed since the last ones returned in HTTP responses, "
                f"which answered those); reconnect with resume_from={first} to continue without them, or start a "
                "new session",
            )

    def resume(self, resume_from: int, frames_returned: int) -> list[SentUnit]:
        """The units to send again to a stream that has every frame before ``resume_from`` (``streamed``); the
        older ones are no longer needed and are dropped. ApiError (see ``check``) when it cannot be served."""
        self.check(resume_from, frames_returned)
        while self._units and self._units[0].frame_end <= resume_from:
            self._units.popleft()
        # A unit that straddles resume_from (a client counting frames, not units) is sent whole.
        return [unit for unit in self.streamed() if unit.frame_end > resume_from]

    def streamed(self) -> list[SentUnit]:
        """What a stream's resume may send again: the kept units streamed since the last ones returned in HTTP
        responses. Those were answered in their responses (api.md), and a stream resuming from before them is
        refused as it was when they were not kept, rather than sent a stream with a hole where they were."""
        units = list(self._units)
        while units and units[-1].in_response:  # returned after the stream's last unit: not the stream's to resend
            units.pop()
        start = len(units)
        while start and not units[start - 1].in_response:
            start -= 1
        return units[start:]

    def replay(self, resume_from: int, until: int) -> list[SentUnit]:
        """The units a watcher that has every frame before ``resume_from`` missed, up to ``until`` (the end of the
        newest unit offered to watchers: later ones reach it live). Changes nothing (the session's stream may still
        need them). A unit that straddles ``resume_from`` is sent whole, as a stream's resume does; units returned in
        HTTP responses are among them. ApiError ``resume_unavailable`` naming the first frame that can be sent again
        when frames in between are not kept (too old for ``ws_resume_units``)."""
        if resume_from >= until:
            return []
        units = list(self._units)
        first = units[0].frame_start if units and units[-1].frame_end == until else until
        if resume_from < first:
            raise ApiError(
                "resume_unavailable",
                f"frames [{resume_from}, {first}) are no longer kept (a session keeps the last "
                f"ws_resume_units={self.capacity} units it returned, streamed or in HTTP responses); "
                f"reconnect with resume_from={first} to continue without them",
            )
        return [unit for unit in units if unit.frame_end > resume_from]

    def first_frame(self, frames_returned: int) -> int:
        """The earliest frame a stream's resume can ask for (``frames_returned`` when it has no unit to send
        again: a client holding every frame needs nothing resent)."""
        streamed = self.streamed()
        return streamed[0].frame_start if streamed else frames_returned

    def restore(self, units: list[SentUnit]) -> None:
        # Not units[-0:] (every unit) for a capacity of 0: a file saved where more were kept brings none here.
        self._units = deque(units[len(units) - self.capacity :] if self.capacity else ())


def narrowed(data: bytes, dropped: dict[str, tuple[str, ...]]) -> bytes:
    """A unit's bytes without the output kinds in ``dropped`` (kind: the tensors its stage puts on the wire): their
    tensors and their metadata (named ``<kind>_...``) left out, everything else as it was (a watcher asking fewer
    kinds than its session's, sent a retained unit again)."""
    tensors, metadata = decode_response(data)
    names = {name for wire_names in dropped.values() for name in wire_names}
    prefixes = tuple(f"{kind}_" for kind in dropped)
    return encode({name: tensor for name, tensor in tensors.items() if name not in names},
                  {key: value for key, value in metadata.items() if not key.startswith(prefixes)})


def latency_of(data: bytes) -> float | None:
    """The ``latency_ms`` a unit's bytes say (None when they say none)."""
    value = read_metadata(data).get("latency_ms")
    return None if value is None else float(value)
