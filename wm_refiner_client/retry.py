"""When and how long to wait before trying again.

The client retries only what is safe to repeat: a request the server refused with 503 (it changed nothing), an
HTTP chunk with its ``seq`` (the server answers a repeated last seq with the stored response), a ``PUT`` of a
session, reads and deletes, and a WebSocket stream (it reconnects with ``resume_from`` and resends what the
server did not get). ``POST /v1/sessions`` is retried only when the request never left (connection refused).
Behind a router, a 502/504 (a replica died mid-request) is retried like a lost connection, and a 404 for a session
that another replica served is retried for at most ``move_timeout_s`` (the session is moving: ``protocol``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts``: tries of one operation, the first included, before the error is raised (a stream that makes
    progress starts counting again). The n-th wait is ``backoff_s * 2**n`` capped at ``max_backoff_s``, scaled
    by a random factor in [0.5, 1] so clients reconnecting to a restarted server do not arrive in step; a 503's
    ``Retry-After`` is waited at least, up to ``max_retry_after_s``. So one request waits at most ``attempts - 1``
    times ``max(max_backoff_s, max_retry_after_s)`` in all: with the defaults 9 x 30 s, about 4.5 min, on a server
    that keeps answering 503 with a long ``Retry-After`` (a full server: ``too_many_sessions``); ``attempts=1``
    (``NO_RETRY``) fails at the first error instead. ``move_timeout_s``: how long a 404 for a
    session is retried when it comes from a replica other than the one that last served the session (behind a
    router the session is moving: the next replica adopts it from the shared snapshots on a request); the 404 is
    raised (``SessionNotFoundError``) after that, or at once when the session's own replica answers it.
    ``max_resend_bytes``: how much input a stream keeps for frames already refined but not yet covered by the
    server's last crash checkpoint (``durable_frames``), so that it can resend them to a replica that adopts the
    session from that checkpoint after a crash; past it the oldest go (a crash that far behind then ends the
    stream with ``ProtocolError``). Input not yet refined is always kept. ``restart_timeout_s``: how long a stream
    keeps reconnecting to a server that is restarting (its connection closed with 1012 or 1001, then refused, or
    answered 503 ``not_ready`` / ``draining`` while it loads and warms up): those tries do not count against
    ``attempts`` (a restart of the released model, weights and warm-up, takes minutes), only against this time,
    counted from the first of them; the stream raises ``TransportError`` once it is spent.

    ``deadline_s``: the most one HTTP call (``info()``, ``send()``, ``refine()``, ...) may take in all, its tries,
    the waits between them and the reading of the answer included; None (the default): no bound beyond the others.
    Without it a server that accepts requests and never answers costs ``attempts`` times the client's ``timeout``
    for an idempotent request (10 x 120 s, 20 min, by default), and one whose answer trickles in a byte at a time
    (each read within the timeout) costs as long as the answer's size limit allows. Each try's timeout is cut to the
    time left, a wait that would end past the deadline is not waited, and the body is checked as it arrives: the
    call raises at the deadline (a server that keeps sending pieces of its body: with the first piece after it).
    What it raises: the last error the server answered (a 503 that kept coming: ``ServiceUnavailableError``), else
    ``TransportError`` naming the deadline. A stream's reconnections are bounded by it too: from the moment a stream
    is without a connection (its first try, or the failure that ended one) until a connection gets the session
    event, its waits, each connection's opening and the wait for its session event stop at ``deadline_s`` (a
    server restarting included, whatever ``restart_timeout_s`` allows), with a ``TransportError`` naming it; a
    connected stream is never cut (it lasts as long as its chunks). ``watch()``'s opening (its ``GET /v1/info`` and
    its handshake) is bounded by it, the watch itself is not."""

    attempts: int = 10
    backoff_s: float = 0.25
    max_backoff_s: float = 8.0
    max_retry_after_s: float = 30.0
    move_timeout_s: float = 15.0
    max_resend_bytes: int = 512 * 2**20
    restart_timeout_s: float = 600.0
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 seconds (or None: no deadline), got {self.deadline_s}")
        if min(self.backoff_s, self.max_backoff_s, self.max_retry_after_s, self.move_timeout_s,
               self.max_resend_bytes, self.restart_timeout_s) < 0:
            raise ValueError("waits must be >= 0")

    def delay(self, failures: int, retry_after: float | None = None, jitter: float | None = None) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (1 = the first)."""
        base = min(self.max_backoff_s, self.backoff_s * 2 ** max(failures - 1, 0))
        wait = base * (random.uniform(0.5, 1.0) if jitter is None else jitter)
        if retry_after is not None:
            wait = max(wait, min(float(retry_after), self.max_retry_after_s))
        return wait


NO_RETRY = RetryPolicy(attempts=1)


def parse_retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (the service always sends an integer)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
