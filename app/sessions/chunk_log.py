"""The chunk protocol of one session: sequence numbers, safe retries, one chunk at a time.

api.md: ``seq`` counts accepted chunks from 0, over HTTP and the WebSocket alike. Repeating the last accepted
``seq`` returns the stored response again without recomputing (a safe retry) when it is the same request (the
same body bytes and ``flush``: ``app.core.chunk_request``); another request under that ``seq``, or any other
out-of-order ``seq``, is 409 naming the expected one; a rejected request does not use up its ``seq``. Without
``seq`` a chunk is appended in arrival order.

This lives in the service, not in the engine: the engine only appends chunks and runs forwards. Chunks of a
session take turns here (an asyncio lock), so each one is checked against the counters its predecessor left,
and at most ``session_queue_depth`` wait for their turn; beyond that a request is refused at once (503).
Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Callable

from app.core.chunk_request import ChunkRequest
from app.core.error_kinds import ApiError


@dataclass
class ChunkLog:
    next_seq: int = 0
    last_seq: int | None = None
    last_response: bytes | None = None  # the response of ``last_seq``, returned again for a repeat
    # The request of ``last_seq``, which a repeat must equal. None with a ``last_seq``: unknown (a session saved to
    # snapshot_dir before requests were recorded), and a repeat is then replayed whatever it holds, as it was then.
    last_request: ChunkRequest | None = None
    build: Callable[[], bytes] | None = None  # encodes ``last_response`` (from its units) until it is stored
    waiting: int = 0  # chunks holding or awaiting the turn
    _turn: asyncio.Lock | None = field(default=None, repr=False)

    @contextlib.asynccontextmanager
    async def turn(self, limit: int):
        """Hold the session's chunk turn; 503 ``engine_busy`` when ``limit`` chunks already hold or await it."""
        if self.waiting >= limit:
            raise ApiError(
                "engine_busy",
                f"this session already has {self.waiting} chunks queued (session_queue_depth); wait for their "
                "responses before sending more",
            )
        if self._turn is None:
            self._turn = asyncio.Lock()
        self.waiting += 1
        try:
            async with self._turn:
                yield
        finally:
            self.waiting -= 1

    def is_repeat(self, seq: int | None, request: ChunkRequest | None = None) -> bool:
        """True when ``seq`` repeats the last accepted one and ``request`` is that one's (its response is sent
        again); 409 when it is out of order, or the last one's ``seq`` with another request; False when the chunk is
        new. Call while holding the turn."""
        if seq is None:
            return False
        if seq == self.last_seq and (self.last_response is not None or self.build is not None):
            if self.last_request is not None and request is not None:
                self._check_same(seq, request)
            return True
        if seq != self.next_seq:
            if self.last_seq is not None:
                again = f", or seq={self.last_seq} to get the last response again"
            elif seq < self.next_seq:  # a retry of an earlier chunk: say why it is not replayed
                again = (f" (seq={seq} was accepted already; only the last accepted chunk's seq can be sent again, "
                         "and the last one was a stream message or a chunk without seq)")
            else:
                again = ""
            raise ApiError(
                "seq_conflict",
                f"seq={seq} is out of order: this session expects seq={self.next_seq} next{again}",
            )
        return False

    def _check_same(self, seq: int, request: ChunkRequest) -> None:
        differences = self.last_request.differences(request)
        if differences:
            raise ApiError(
                "seq_conflict",
                f"seq={seq} was accepted already for another request: this one has {' and '.join(differences)}, "
                f"so it is not a retry of it and was refused (the session is unchanged). To retry seq={seq}, send "
                f"the same body bytes with the same flush (its stored response comes back); to send new frames or to "
                f"flush, use seq={self.next_seq} (an empty body with flush=true flushes without new frames)",
            )

    def restore(self, next_seq: int, last_seq: int | None, last_response: bytes | None,
                last_request: ChunkRequest | None) -> None:
        """The counters of a session read from its file. A ``last_seq`` is the index of its chunk, so one other than
        ``next_seq - 1`` had stream messages after it: a file written before ``accept_message`` dropped it still
        holds it (and its response), and it is dropped here, so that it is not repeated there either."""
        if last_seq is not None and last_seq != next_seq - 1:
            last_seq = last_response = last_request = None
        self.next_seq, self.last_seq, self.last_response = next_seq, last_seq, last_response
        self.last_request = last_request

    def stored_response(self) -> bytes | None:
        """The last ``seq``'s response, encoding it here if it was not stored yet (None without a ``seq``)."""
        if self.last_response is None and self.build is not None:
            self.last_response = self.build()
        return self.last_response

    def accept_request(self, seq: int | None, build: Callable[[], bytes], request: ChunkRequest | None = None) -> int:
        """Count an accepted HTTP chunk at once, before its response is encoded, so that a drain never finds the
        session advanced and the chunk uncounted. With a ``seq`` the response is kept for a repeat of ``request``:
        ``build`` makes it until ``store`` hands over the bytes. Returns the chunk's index."""
        index = self.next_seq
        self.next_seq += 1
        self.last_seq = seq
        self.last_request = request if seq is not None else None
        self.last_response = None
        self.build = build if seq is not None else None
        return index

    def store(self, index: int, response: bytes) -> None:
        """The encoded response of chunk ``index``, kept if that chunk is still the last one."""
        if index == self.next_seq - 1 and self.last_seq is not None:
            self.last_response = response
            self.build = None

    def accept_message(self) -> None:
        """Count an accepted WebSocket message. It is the last accepted chunk now, and it has no response to
        repeat: the ``seq`` of an HTTP chunk before it can no longer be repeated (its stored response is dropped)."""
        self.next_seq += 1
        self.last_seq = self.last_request = self.last_response = self.build = None
