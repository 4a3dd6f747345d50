"""The client's protocol, without any I/O: what to send, what to retry, what to hand to the caller.

The sync ``Client`` and the asyncio ``AsyncClient`` differ only in how they wait (threads or tasks); every decision
they take is made here, so the two cannot drift apart, and each decision is unit-tested without a socket
(``tests/client/test_protocol_core.py``):

- ``RequestAttempts``: whether an HTTP request that failed is tried again, and after how long: lost connections
  (when the request is idempotent or provably never left), 503s (after ``Retry-After``), a router's 502/504 (a
  replica died mid-request; idempotent requests only), and a 404 for a session that is moving between replicas.
- ``StreamProtocol``: one ``session.stream(...)`` over as many WebSocket connections as it takes: the
  ``resume_from`` of each connection, what to resend after the server's ``session`` event, which messages go out
  next (resends, the caller's chunks, the flush), which received units are new (a reconnect's replay is trimmed),
  when the stream is done, and which failures end it.
- ``ChunkSeq``: the ``seq`` of the next HTTP chunk.

A session "moves" when a replica drains or dies and the router sends its id to another replica, which adopts it
from the shared snapshot folder on its first request; until then that replica answers 404. A 404 is taken for a
move, and retried for at most ``RetryPolicy.move_timeout_s``, only when it comes from a replica other than the one
that last served the session to this client: on a single server (one replica id) a 404 is final at once.
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Any, Callable, Mapping

from ._common import (
    FATAL_CLOSE_CODES,
    FLUSH_MESSAGE,
    RESUMABLE_EVENT_CODES,
    StreamStats,
    event_error,
    geometry_of,
    is_count,
    parse_event,
)
from .errors import (
    APIError,
    PayloadTooLargeCodeError,
    ProtocolError,
    ServiceUnavailableError,
    SessionNotFoundError,
    StreamClosedError,
    StreamInUseError,
    TransportError,
)
from .resume import ChunkSource, UnitTracker, frames_before_flush
from .retry import RetryPolicy
from .units import Array, ReturnTensors, Unit

# A router's answers when the replica behind it failed mid-request (HAProxy: 502 when the connection broke, 504 when
# the replica did not answer in time). The body is the router's HTML, not the service's envelope.
GATEWAY_STATUSES = frozenset({502, 504})


def is_gateway_error(error: APIError) -> bool:
    """A router's 502/504 (not the service's own answer): the request may or may not have reached a replica."""
    return error.status in GATEWAY_STATUSES and not (isinstance(error.body, dict) and "error" in error.body)


# Tries of a client's first request when the server refuses the connection: the retries cover a server that is
# just binding its port (well under a second), not the policy's ~30 s meant for a restart mid-stream.
FIRST_CONTACT_ATTEMPTS = 4
# Causes of a failed first contact that no later try can change (``unreachable_cause``): raised at the first.
FINAL_CAUSES = frozenset({"dns", "tls", "certificate"})
# What OpenSSL says when the bytes that answered a TLS handshake are not TLS (a plain-HTTP server's "400 Bad
# Request"): WRONG_VERSION_NUMBER up to OpenSSL 3.1, "record layer failure" from 3.2 on.
NOT_TLS_REASONS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "RECORD LAYER FAILURE", "WRONG VERSION NUMBER",
                   "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG")
SETTING = "(--server, $WM_REFINER_URL)"


def unreachable_cause(exc: BaseException, server: str | None = None) -> tuple[str, str] | None:
    """``(kind, the likely cause and the fix)`` when ``exc`` (or an exception it was raised from) says the address is
    wrong rather than the server down: ``"dns"`` an unknown host, ``"refused"`` nothing listening, ``"tls"`` a TLS
    (https://) handshake that failed (most often: the server speaks plain HTTP), ``"certificate"`` a server
    certificate this client does not trust, ``"tls-closed"`` a handshake the other end cut off (retried as a
    refusal is: a restart does that too); None for any other failure."""
    where = server or "the server"
    seen: BaseException | None = exc
    for _ in range(8):  # httpx wraps httpcore's error, which wraps the socket's
        if seen is None:
            break
        if isinstance(seen, socket.gaierror):
            return "dns", f"cannot resolve the host of {where} ({seen}): check the address {SETTING}"
        if isinstance(seen, ConnectionRefusedError):
            return "refused", (f"nothing listens at {where} (connection refused): is the server running on that host "
                               "and port? Start it with `python -m app serve` (its port: --port, $WM_REFINER_PORT), "
                               f"or give its address {SETTING}")
        if isinstance(seen, ssl.SSLCertVerificationError):  # before SSLError: it is one
            return "certificate", certificate_cause(seen, where)
        if isinstance(seen, (ssl.SSLEOFError, ssl.SSLSyscallError)):  # before SSLError: a restart may cause these
            return "tls-closed", (f"the TLS (HTTPS) handshake with {where} was cut off ({seen}): is a server or a "
                                  f"proxy restarting there? If it speaks plain HTTP, give {plain_http(server)} "
                                  f"instead {SETTING}")
        if isinstance(seen, ssl.SSLError):
            return "tls", tls_cause(seen, server)
        seen = seen.__cause__ or seen.__context__
    return None


def connect_failure(what: str, exc: BaseException, server: str | None, first_contact: bool) -> TransportError:
    """The error of a WebSocket ``what`` that could not be opened: before the server ever answered this client, a
    wrong address's cause and fix (``unreachable_cause``; ``final`` when no retry can change it, so a stream raises
    it at once rather than reconnecting for minutes; ``tries`` for a refused connection: the few tries a first
    contact gets over HTTP), else the socket's own error (a stream retries it)."""
    cause = unreachable_cause(exc, server) if first_contact else None
    if cause is not None:
        final = cause[0] in FINAL_CAUSES
        return TransportError(f"{what}: {cause[1]}", final=final, tries=None if final else FIRST_CONTACT_ATTEMPTS)
    return TransportError(f"{what}: {type(exc).__name__}: {exc}")


def tls_cause(error: ssl.SSLError, server: str | None) -> str:
    """Why a TLS handshake with ``server`` failed, and the fix: an answer that is not TLS is a plain-HTTP server (the
    service serves plain HTTP unless a proxy in front of it terminates TLS); any other failure names OpenSSL's
    reason."""
    where, plain = server or "the server", plain_http(server)
    said = f"{getattr(error, 'reason', None) or ''} {error}".upper()
    if any(reason in said for reason in NOT_TLS_REASONS):
        there = f"the server at {server}" if server else "the server"
        return (f"{there} does not speak TLS (HTTPS): it answered the handshake with something else ({error}); most "
                f"likely it is a plain-HTTP server: give {plain} instead {SETTING}")
    return (f"the TLS (HTTPS) handshake with {where} failed ({error}): the server's TLS settings refuse this client "
            f"(a client certificate it requires, no protocol version or cipher in common); if it is a plain-HTTP "
            f"server, give {plain} instead {SETTING}")


def certificate_cause(error: ssl.SSLCertVerificationError, where: str) -> str:
    """A server certificate this client does not trust: OpenSSL's reason, and the two fixes."""
    reason = error.verify_message or error.reason or str(error)
    return (f"the TLS certificate of {where} cannot be verified ({reason}): fix the server's certificate (it must "
            "name this host and be signed by a CA this client trusts), or, for a private CA or a self-signed "
            "certificate, point $SSL_CERT_FILE at that CA's certificate (PEM; a self-signed certificate is its own "
            "CA)")


def plain_http(server: str | None) -> str:
    """``server`` with http:// for https:// (the address of the same port, spoken in plain HTTP)."""
    if server and server.startswith("https://"):
        return "http://" + server[len("https://"):]
    return "http://host:port"


def shorten(text: str, limit: int = 120) -> str:
    """``text`` on one line, cut at a word to at most ``limit`` characters (a message quoted in a log line)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return text[: limit - 3].rsplit(" ", 1)[0] + "..."


def describe_failure(failure: BaseException) -> str:
    """A failure in a retry's log line: an error answer's status, code and message (shortened), else the
    exception's type and text."""
    if isinstance(failure, APIError):
        return f"{failure.status} {failure.code} ({shorten(failure.message)})"
    text = shorten(str(failure))
    return f"{type(failure).__name__} ({text})" if text else type(failure).__name__


class RestartWindow:
    """The time a client gives a server to come back from a restart (``RetryPolicy.restart_timeout_s``): failures
    while it restarts count here, not against the policy's ``attempts``, and the time runs from the first of them.

    A stream carries one restart across connections that get the session event but close again (1012/1001) before
    any work: ``back()`` forgives the restart's failures but keeps its start until ``progress()`` (a unit refined).
    A request never calls either: its window ends with the request."""

    def __init__(self, policy: RetryPolicy, clock: Callable[[], float]):
        self.policy = policy
        self.clock = clock
        self.failures = 0  # failures while the server restarts: not against ``attempts``
        self._since: float | None = None  # the first of them
        self._carried: float | None = None  # the start of a restart the server came back from, until progress

    @property
    def waiting(self) -> bool:
        """Whether the server is restarting now (a restart's failure is the last thing seen)."""
        return self._since is not None

    def count(self) -> bool:
        """Count a failure as a restart's. False when the policy waits for no restart (``attempts=1`` retries
        nothing, docs/client.md; ``restart_timeout_s=0``): it then counts against ``attempts`` as any failure."""
        if self.policy.attempts <= 1 or self.policy.restart_timeout_s <= 0:
            return False
        if self._since is None:
            self._since = self.clock()
        self.failures += 1
        return True

    def _began(self) -> float | None:
        return self._carried if self._carried is not None else self._since

    def spent(self) -> bool:
        """Whether ``restart_timeout_s`` has been reached since the restart began (a failure at exactly that time is
        the last)."""
        began = self._began()
        return began is not None and self.clock() - began >= self.policy.restart_timeout_s

    def left(self) -> float:
        """Seconds of ``restart_timeout_s`` left (for the log line)."""
        began = self._began()
        elapsed = 0.0 if began is None else self.clock() - began
        return max(self.policy.restart_timeout_s - elapsed, 0.0)

    def back(self) -> int:
        """The server answered again: how many failures to forgive (they never counted against ``attempts``)."""
        forgiven = self.failures
        if self._since is not None and self._carried is None:
            self._carried = self._since
        self.failures, self._since = 0, None
        return forgiven

    def progress(self) -> None:
        """The server did work again: a later restart's time starts anew."""
        self._carried = None


class RequestAttempts:
    """The retry decisions of one HTTP request. After each failure the driver asks for the wait before the next
    try; the failure is raised instead once it is not worth retrying or the policy's bounds are spent.

    ``idempotent``: repeating the request is harmless (reads, deletes, PUT of a session, a chunk with its ``seq``).
    ``known_replica``: the replica that last served this request's session to this client (None: not a session
    request, or a session not served yet); a 404 from another replica is a move (module docstring).
    ``first_contact``: the client has had no answer from ``server`` yet. Then an unknown host, a failed TLS
    handshake (https:// to a plain-HTTP server) and an untrusted certificate fail at once, and a refused connection
    after ``FIRST_CONTACT_ATTEMPTS`` tries (about a second), naming the likely cause: a wrong address is far likelier
    than a restart, and retrying it for the policy's half minute only hides the typo. Once the server has answered,
    a refused connection, or a 503 ``not_ready`` / ``draining``, is a restart: such tries do not count against the
    policy's ``attempts`` but against its ``restart_timeout_s``, from the first of them (a restart of the released
    model takes minutes).

    ``deadline_s`` (the policy's): the whole request's time, from this object's making. ``try_timeout`` cuts each
    try's timeout to the time left, a wait that would end past it raises instead, and ``check_deadline`` is asked as
    the answer's body arrives.

    ``retry_note(wait)`` is the log line of a retry: the last failure, the try that comes next of how many (logged at
    INFO with the wait as the record's ``wait_s``: the command line shows the long ones)."""

    def __init__(self, policy: RetryPolicy, what: str, *, idempotent: bool = True,
                 known_replica: str | None = None, clock: Callable[[], float] = time.monotonic,
                 first_contact: bool = False, server: str | None = None):
        self.policy = policy
        self.what = what
        self.idempotent = idempotent
        self.known_replica = known_replica
        self.clock = clock
        self.first_contact = first_contact
        self.server = server
        self.failures = 0
        self.last_failure: BaseException | None = None
        self.tries = policy.attempts  # how many tries the last failure allows in all (fewer for a first contact)
        self._moving_since: float | None = None
        self.restart = RestartWindow(policy, clock)
        self.deadline = None if policy.deadline_s is None else clock() + policy.deadline_s

    def _spent(self) -> bool:
        return self.failures - self.restart.failures >= self.policy.attempts

    def try_timeout(self, timeout: Any) -> Any:
        """The timeout of the next try: the client's ``timeout``, cut to the time the deadline leaves."""
        if self.deadline is None:
            return timeout
        self.check_deadline("before a try")
        left = self.deadline - self.clock()
        return left if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) else min(timeout, left)

    def check_deadline(self, doing: str) -> None:
        """``TransportError`` once ``RetryPolicy.deadline_s`` has passed (``doing``: what the request was at)."""
        if self.deadline is not None and self.clock() >= self.deadline:
            last = f" ({self.failures} failed before, the last: {describe_failure(self.last_failure)})" \
                if self.last_failure is not None else ""
            raise TransportError(f"{self.what}: RetryPolicy.deadline_s ({self.policy.deadline_s:g} s) passed "
                                 f"{doing}{last}")

    def _past_deadline(self, wait: float) -> bool:
        """Whether waiting ``wait`` s before the next try would end at or past the deadline (no try left then)."""
        return self.deadline is not None and self.clock() + wait >= self.deadline

    def after_transport_error(self, exc: BaseException, *, never_sent: bool) -> float:
        """The connection failed (``never_sent``: it was refused before the request left)."""
        self.failures += 1
        self.last_failure = exc
        # A wrong address shows while connecting (TLS is part of it): an error after the request left is the
        # server's hiccup, whatever it wraps.
        cause = unreachable_cause(exc, self.server) if self.first_contact and never_sent else None
        self.tries = self.policy.attempts if cause is None else min(FIRST_CONTACT_ATTEMPTS, self.policy.attempts)
        if cause is not None and (cause[0] in FINAL_CAUSES or self.failures >= self.tries):
            raise TransportError(f"{self.what}: {cause[1]}", final=cause[0] in FINAL_CAUSES) from exc
        if self._past_deadline(0.0):  # the try's timeout was cut to the time left: the deadline ended it, whether or
            raise self._deadline_passed(exc) from exc  # not it may be retried (a POST /v1/sessions may not)
        if never_sent and not self.first_contact:  # the server that answered before is down: a restart
            if self.restart.count() and self.restart.spent():
                raise TransportError(f"{self.what}: the server was not back {self.policy.restart_timeout_s:.0f} s "
                                     f"after it went down (RetryPolicy.restart_timeout_s; last: "
                                     f"{type(exc).__name__}: {exc})") from exc
        elif not self.idempotent and not never_sent:
            raise TransportError(f"{self.what}: {type(exc).__name__}: {exc}") from exc
        if self._spent():
            raise TransportError(f"{self.what}: {type(exc).__name__}: {exc}") from exc
        wait = self.policy.delay(self.failures)
        if self._past_deadline(wait):
            raise self._deadline_passed(exc) from exc
        return wait

    def _deadline_passed(self, exc: BaseException) -> TransportError:
        tries = "1 try" if self.failures == 1 else f"{self.failures} tries"
        return TransportError(f"{self.what}: RetryPolicy.deadline_s ({self.policy.deadline_s:g} s) passed without an "
                              f"answer ({tries}, the last: {type(exc).__name__}: {exc})")

    def after_error(self, error: APIError, replica: str | None = None) -> float:
        """The server (or the router) answered with ``error``; ``replica``: its ``X-Replica`` header."""
        self.failures += 1
        self.last_failure = error
        self.tries = self.policy.attempts
        if not self.retryable(error, replica):
            raise error
        if isinstance(error, ServiceUnavailableError) and error.code in ("not_ready", "draining") \
                and not self.first_contact:  # loading or warming up after a restart (or draining before one)
            if self.restart.count() and self.restart.spent():
                raise error
        if self._spent():
            raise error
        wait = self.policy.delay(self.failures, getattr(error, "retry_after", None))
        if self._past_deadline(wait):
            raise error  # as when the tries are spent: the server's own answer says best what stood in the way
        return wait

    def retry_note(self, wait: float) -> str:
        """The log line of the retry about to wait ``wait`` seconds: what failed (a server's error: its status, code
        and message), and which try comes next of how many (the policy's ``attempts``; ``FIRST_CONTACT_ATTEMPTS``
        for a refused first contact), e.g. ``POST /v1/sessions: 503 too_many_sessions (the server holds its
        maximum ...); try 2 of 10 in 30.0 s``."""
        failed = describe_failure(self.last_failure) if self.last_failure is not None else "failed"
        if self.restart.waiting:
            return (f"{self.what}: {failed}; the server is restarting: try {self.failures + 1} in {wait:.1f} s "
                    f"(trying for {self.restart.left():.0f} s more)")
        return f"{self.what}: {failed}; try {self.failures + 1} of {self.tries} in {wait:.1f} s"

    def retryable(self, error: APIError, replica: str | None = None) -> bool:
        """Whether the same request may succeed later: a 503 (refused before anything changed), a router's
        502/504 when the request is idempotent, a 404 of a session moving between replicas."""
        if isinstance(error, ServiceUnavailableError):
            return True
        if is_gateway_error(error):
            return self.idempotent
        return self.moving(error, replica)

    def moving(self, error: APIError, replica: str | None) -> bool:
        """Whether ``error`` is a 404 of a session on its way to another replica, still within the time allowed."""
        if not isinstance(error, SessionNotFoundError) or self.known_replica is None:
            return False
        if replica is not None and replica == self.known_replica:
            return False  # the replica that holds the session says it is gone: it is
        now = self.clock()
        if self._moving_since is None:
            self._moving_since = now
        return now - self._moving_since < self.policy.move_timeout_s


class ChunkSeq:
    """The ``seq`` of a session's next HTTP chunk: counted from the server's ``next_seq``, asked again after a
    stream (stream messages count as chunks too)."""

    def __init__(self, next_seq: int | None = None):
        self.next_seq = next_seq

    @property
    def known(self) -> bool:
        return self.next_seq is not None

    def learn(self, next_seq: int) -> None:
        self.next_seq = next_seq

    def take(self) -> int:
        if self.next_seq is None:
            raise RuntimeError("the next seq is unknown: ask the server (GET /v1/sessions/{id}) first")
        return self.next_seq

    def accepted(self, seq: int) -> None:
        self.next_seq = seq + 1

    def forget(self) -> None:
        self.next_seq = None


# What ``StreamProtocol.next_message`` asks the driver to do when it has nothing to send right now.
NEED_CHUNK = "need-chunk"  # take the caller's next chunk and ``add`` it (or ``finish`` when there is none)
WAIT = "wait"  # wait for a unit to arrive (the flush waits for the full blocks), then ask again
DONE_SENDING = "done-sending"  # this connection has sent everything, the flush included


class StreamProtocol:
    """One ``session.stream(...)``, across reconnects. The driver (sync or asyncio) runs, per connection:

        wait(protocol.wait_before_connect()); connect with protocol.query()   -> failed: protocol.refused(exc)
        protocol.opened(first message, replica)                               -> False: reconnect
        a sender: loop on protocol.next_message() (add/finish the caller's chunks when it says NEED_CHUNK)
        a receiver: protocol.received(message) -> a Unit for the caller, True when done; on a close protocol.lost()

    and stops when ``received`` says the stream is done or a method raises (the error for the caller)."""

    def __init__(self, session_id: str, config: Mapping[str, Any], policy: RetryPolicy, *,
                 prompt: Array | None = None, prompt_mask: Array | None = None, frames_returned: int = 0,
                 video_frames_returned: int = 0, known_replica: str | None = None,
                 return_tensors: ReturnTensors = "np", on_unit: Callable[[Unit], None] | None = None,
                 stats: StreamStats | None = None, clock: Callable[[], float] = time.monotonic,
                 from_session_start: bool = False, geometry: tuple[int, int, int, int] | None = None):
        self.session_id = session_id
        self.what = f"stream of session {session_id}"
        # (B, C, H, W) of the session's latents, which bounds the size of a unit (``_common.MessageLimit``): the
        # handle's (its HTTP chunks'), else the first chunk's (``expect``: before the first connection when
        # ``reads_first_chunk``, else as it is sent), else None (the driver takes the widest the server allows).
        self.geometry = geometry
        self.config = dict(config)
        self.policy = policy
        self.source = ChunkSource(prompt, prompt_mask, max_kept_bytes=policy.max_resend_bytes)
        self.tracker = UnitTracker(frames_returned, video_frames_returned)
        self.stats = stats if stats is not None else StreamStats()
        self.return_tensors: ReturnTensors = return_tensors
        self.on_unit = on_unit
        self.replica = known_replica  # the replica of the last connection that got the session event
        self.base: int | None = None  # the session's frame count when this stream's first frame was added
        # The chunks begin at the session's frame 0 (a rerun of a clip): the frames it has are skipped, not resent.
        self.from_session_start = from_session_start
        if from_session_start:
            self.base = 0
        self._connections = 0
        self.failures = 0
        # Failures while the server restarts (``_restarting``): counted for the backoff, not against ``attempts``,
        # bounded by ``policy.restart_timeout_s`` from the first of them (``RestartWindow``).
        self.restart = RestartWindow(policy, clock)
        self._went_away = False  # the last connection ended as a server going down does
        self.retry_after: float | None = None
        self.last_error: BaseException | None = None
        self.server_flushed = False
        self._flush_sent = False
        self._attempts = self._new_attempts(clock)
        self._clock = clock
        # When the stream last stood without a connection that got the session event (its first connection's try,
        # or the failure after one): ``RetryPolicy.deadline_s`` bounds the time from there; None while connected.
        self._outage_since: float | None = None

    def _new_attempts(self, clock: Callable[[], float]) -> RequestAttempts:
        return RequestAttempts(self.policy, f"stream of session {self.session_id}", known_replica=self.replica,
                               clock=clock)

    # --- connecting ---------------------------------------------------------------------------------------------
    def wait_before_connect(self) -> float:
        """Seconds to wait before the next connection (0 for the first); raises ``TransportError`` once the policy's
        attempts are spent without a unit in between, or when the wait would end past ``RetryPolicy.deadline_s``
        from the moment the stream was left without a connection (a stream that is connected is never cut)."""
        if self._outage_since is None:
            self._outage_since = self._clock()
        if not self.failures:
            return 0.0
        if self.restart.spent():
            raise TransportError(f"stream of session {self.session_id}: the server was not back "
                                 f"{self.policy.restart_timeout_s:.0f} s after it went away to restart (RetryPolicy."
                                 f"restart_timeout_s; last: {self.last_error})") from self.last_error
        if self.failures - self.restart.failures >= self.policy.attempts:
            raise TransportError(f"stream of session {self.session_id}: gave up after {self.failures} failed "
                                 f"attempts (last: {self.last_error})") from self.last_error
        wait = self.policy.delay(self.failures, self.retry_after)
        self.retry_after = None
        if self.policy.deadline_s is not None and self._clock() + wait - self._outage_since >= self.policy.deadline_s:
            raise self._deadline_passed()
        return wait

    def connect_timeout(self, timeout: float) -> float:
        """The timeout of the next connection's opening and of its session event: the client's ``timeout``, cut to
        what ``RetryPolicy.deadline_s`` leaves of this reconnection (``TransportError`` when nothing is left)."""
        if self.policy.deadline_s is None or self._outage_since is None:
            return timeout
        left = self._outage_since + self.policy.deadline_s - self._clock()
        if left <= 0:
            raise self._deadline_passed()
        return min(timeout, left)

    def _deadline_passed(self) -> TransportError:
        tries = "1 failed try" if self.failures == 1 else f"{self.failures} failed tries"
        last = f", the last: {describe_failure(self.last_error)}" if self.last_error is not None else ""
        error = TransportError(f"stream of session {self.session_id}: RetryPolicy.deadline_s "
                               f"({self.policy.deadline_s:g} s) passed without a connection ({tries}{last})")
        error.__cause__ = self.last_error
        return error

    def reconnect_note(self, wait: float) -> str:
        """The log line of a reconnection about to wait ``wait`` seconds (as ``RequestAttempts.retry_note``): what
        ended or refused the last connection, and which connection comes next of how many."""
        failed = describe_failure(self.last_error) if self.last_error is not None else "connection lost"
        if self.restart.waiting:
            return (f"stream of session {self.session_id}: {failed}; the server is restarting: connection "
                    f"{self.failures + 1} in {wait:.1f} s (trying for {self.restart.left():.0f} s more)")
        return (f"stream of session {self.session_id}: {failed}; connection {self.failures + 1} of "
                f"{self.policy.attempts} in {wait:.1f} s")

    def _count(self, exc: BaseException, restarting: bool) -> None:
        """One more failure, ``exc``; ``restarting``: the server is going away or coming back (a restart), which
        counts against ``restart_timeout_s`` rather than ``attempts``."""
        self.failures += 1
        self.last_error = exc
        if self._outage_since is None:
            self._outage_since = self._clock()
        if restarting:
            self.restart.count()

    def query(self) -> dict[str, int]:
        """The next connection's query: replay from the first frame the caller lacks."""
        return {"resume_from": self.tracker.frames}

    def refused(self, exc: BaseException, replica: str | None = None) -> None:
        """The connection could not be opened: ``exc`` is a ``TransportError`` or the handshake's ``APIError``.
        Counts a failure when another try may succeed (503, a router's 502/504, a session moving between
        replicas, no connection), else raises ``exc``."""
        if isinstance(exc, APIError):
            if not self._attempts.retryable(exc, replica):
                raise exc
            self.retry_after = exc.retry_after if isinstance(exc, ServiceUnavailableError) else None
            # A server that is loading, warming up or draining: it restarts (after a stream it served went away).
            restarting = exc.code in ("not_ready", "draining") and self._restarting()
        elif not isinstance(exc, TransportError) or exc.final:
            raise exc
        elif exc.tries is not None and self.failures + 1 >= min(exc.tries, self.policy.attempts):
            raise exc  # a first contact refused a few times: a wrong address, as over HTTP (``FIRST_CONTACT_ATTEMPTS``)
        else:
            restarting = self._restarting()  # refused or cut: the server that served this stream is down
        self._count(exc, restarting)

    def failed(self, exc: BaseException) -> None:
        """The connection broke before the session event (a server going down): try again."""
        self._count(exc, self._restarting())

    def _restarting(self) -> bool:
        """Whether a failure now is a restart's: this stream was served before (a wrong address never was) and
        its server went away, or is going (a close with 1012 or 1001, a refused or cut connection since, a 503
        not_ready or draining), with no unit refined since."""
        return self._connections > 0 and (self.restart.waiting or self._went_away)

    def opened(self, first: str | bytes, replica: str | None = None) -> bool:
        """The first message of a connection: True when it is the ``session`` event (the source is rewound to what
        the server has), False after a resumable error event (the server closes; reconnect). Raises otherwise."""
        if isinstance(first, bytes):
            raise ProtocolError("expected the session event, got a binary message")
        event = parse_event(first)
        if event["type"] == "error":
            error = event_error(event)
            if error.code not in RESUMABLE_EVENT_CODES:
                raise error
            self._count(error, False)
            return False
        if event["type"] != "session":
            raise ProtocolError(f"expected the session event first, got {event}")
        for name in ("frames_received", "durable_frames"):
            value = event.get(name, None if name == "durable_frames" else "missing")
            if value is not None and not is_count(value):
                raise ProtocolError(f"the session event's {name} is {value!r}, not a frame count: {str(event)[:200]}")
        if type(event.get("flushed")) is not bool:  # read as truth, "no" would say flushed; missing, a KeyError
            raise ProtocolError(f"the session event's flushed is {event.get('flushed', 'missing')!r}, not true or "
                                f"false: {str(event)[:200]}")
        if self.base is None:
            self.base = event["frames_received"]
        if self._connections:
            self.stats.reconnects += 1
        self._connections += 1
        if replica is not None:
            self.replica = replica
        self._attempts = self._new_attempts(self._clock)  # a move, if any, is over
        # The server is back: its restart's tries never counted against ``attempts`` (its time runs on until a
        # unit: a server that closes again before any work is the same restart).
        self.failures -= self.restart.back()
        self._went_away = False
        self._outage_since = None  # connected: the deadline waits for the next failure
        self.source.rewind(event["frames_received"] - self.base, ahead=self.from_session_start)
        if event.get("durable_frames") is not None:
            self.source.durable(event["durable_frames"] - self.base)
        self.server_flushed = event["flushed"]
        if self.server_flushed and not self.source.exhausted and not self.from_session_start:
            raise StreamClosedError(f"session {self.session_id} is flushed: it takes no more frames", status=409)
        self._flush_sent = False
        self.stats.frames_sent = self.source.frames_sent
        return True

    def lost(self, code: int | None, reason: str = "", exc: BaseException | None = None) -> None:
        """The connection closed before ``done`` (close ``code``, None when there was no close frame): raises when
        reconnecting is pointless (the session was taken over, a message was too big), else counts a failure."""
        if code in FATAL_CLOSE_CODES:
            if code == 1009:
                raise PayloadTooLargeCodeError(
                    f"session {self.session_id}: {reason or 'a message was over the size limit'} (the server's "
                    "max_ws_message_bytes); send fewer frames per chunk", status=413)
            raise StreamInUseError(f"session {self.session_id}: the stream was closed: {reason or 'policy violation'}",
                                   status=409)
        # 1012 (service restart: drained, sessions saved) and 1001 (going away): the server restarts; a connection
        # that breaks without a close frame (None) may be its kill, counted as such once refused after it.
        if code in (1012, 1001, None):
            self._went_away = True
        self._count(exc if exc is not None else TransportError(f"closed with {code} {reason}".strip()),
                    code in (1012, 1001) and self._connections > 0)

    # --- sending ------------------------------------------------------------------------------------------------
    def next_message(self) -> bytes | str:
        """The next message for the current connection: a payload (bytes), the flush (text), or ``NEED_CHUNK``,
        ``WAIT``, ``DONE_SENDING``. Resends come first; the flush waits for the caller's chunks to be exhausted and
        for their full blocks to come back, so an error about any chunk arrives before the stream is flushed."""
        payload = self.source.next_resend()
        if payload is not None:
            self.stats.frames_sent = self.source.frames_sent
            return payload
        if not self.source.exhausted:
            return NEED_CHUNK
        if self._flush_sent:
            return DONE_SENDING
        if not self.may_flush():
            return WAIT
        self._flush_sent = True
        return FLUSH_MESSAGE

    def reads_first_chunk(self) -> bool:
        """Whether the driver reads the caller's next chunk before it connects, for the geometry that bounds what may
        come back: only while the stream has none and the caller holds no unit of the session. A caller that holds
        some continues a session whose units a resume may replay, and may wait for them before it yields its next
        chunk (a closed-loop source): a driver waiting for that chunk first would wait for ever. It connects then
        with the widest bound the server allows, and the chunks it sends give the geometry for the next connection."""
        return self.geometry is None and self.tracker.frames == 0

    def expect(self, item: Any) -> None:
        """The caller's next chunk, not taken yet (None: there is none): its geometry, when the stream has none."""
        if self.geometry is None and item is not None:
            self.geometry = geometry_of(item)

    def add(self, item: Any) -> bytes | None:
        """The caller's next chunk, numbered and kept for a resend; its payload (None: no frames, nothing to send)."""
        self.expect(item)
        payload = self.source.add(item)
        self.stats.frames_sent = self.source.frames_sent
        return payload

    def finish(self) -> None:
        """The caller's chunks are exhausted."""
        self.source.finish()

    def may_flush(self) -> bool:
        if self.server_flushed:
            return True
        base = self.base or 0
        return self.tracker.frames >= frames_before_flush(base + self.source.frames_added, self.config)

    # --- receiving ----------------------------------------------------------------------------------------------
    def _check_within_input(self, unit: Unit, base: int) -> None:
        """A unit refines frames the session was sent: at most the ``base`` it had when this stream began and the
        frames this stream has sent it (or, rerunning a clip from its frame 0, the frames the server said it had).
        One past them is not the service's answer: a ``ProtocolError`` now, rather than at ``done`` after the
        caller was handed frames that were never sent."""
        sent = self.source.frames_known
        if unit.frame_end > base + sent:
            raise ProtocolError(
                f"stream of session {self.session_id}: the server sent frames [{unit.frame_start}, {unit.frame_end}), "
                f"but the session has only {base + sent} frames: {sent} sent by this stream"
                + (f" after the {base} it had" if base else "") + "; a unit past the input is not the service's")

    def received(self, message: str | bytes) -> Unit | bool | None:
        """One message after the session event: a unit to hand to the caller (the part it lacks), True when the
        stream is done, None when there is nothing new (a replayed unit, a resumable error before a close).
        Other error events are raised."""
        if isinstance(message, bytes):
            unit = Unit.from_payload(message, self.return_tensors)
            base = self.base or 0
            self._check_within_input(unit, base)
            if "durable_frames" in unit.metadata:
                durable = unit.metadata["durable_frames"]
                if not (isinstance(durable, str) and durable.isascii() and durable.isdigit()):
                    # int() of "x" or "inf" raised a bare ValueError; of "-5", a count below any frame
                    raise ProtocolError(f"stream of session {self.session_id}: the server sent a unit whose "
                                        f"durable_frames {durable!r} is not a frame count; not the service's")
                self.source.durable(int(durable) - base)
            fresh = self.tracker.accept(unit)
            if fresh is None:
                return None
            self.source.confirm(self.tracker.frames - base)
            if self.on_unit is not None:
                self.on_unit(fresh)
            self.stats.frames_refined, self.stats.video_frames = self.tracker.frames - base, self.tracker.video_frames
            self.stats.units += 1
            if fresh.latency_ms is not None:
                self.stats.last_latency_ms = fresh.latency_ms
            self.failures = 0
            self.restart.progress()
            return fresh
        event = parse_event(message)
        if event["type"] == "done":
            if event.get("frames") != self.tracker.frames:
                raise ProtocolError(f"the server returned {event.get('frames')} frames in all but this stream "
                                    f"received {self.tracker.frames}")
            return True
        if event["type"] == "error":
            error = event_error(event)
            if error.code not in RESUMABLE_EVENT_CODES:
                raise error
            self.last_error = error  # the server closes the stream after it; the close starts the reconnect
        return None
