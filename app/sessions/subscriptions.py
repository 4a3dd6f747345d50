"""What the sessions layer asks of the connections that subscribe to a session: the protocols a route implements.

Units leave a session for its clients through subscriptions, never through a route object named here. A WebSocket
route implements one of these protocols and registers its connection: a stream with ``StreamSession.claim`` (at
most one per session, ``SessionHandle.stream``), a watcher with ``SessionOps.watch`` (``SessionHandle.watchers``).
From then on the session's units reach it only through these methods (``SessionOps.published``: a stream unit in
commit order; ``SessionOps._offer``: units an HTTP response carried), and the session's end through ``finish``,
``end`` and ``close``. Today's implementations are ``app.api.routes.stream.StreamConnection`` and
``app.api.routes.watch.Watcher``; the tests drive the same protocols with fakes.

Every method here is called on the event loop and must not wait: a subscriber queues what it is given and writes
it out on its own task, so that a slow client never holds up the session, the engine or another subscriber.
"""

from __future__ import annotations

from typing import Protocol

from app.core.error_kinds import ApiError
from app.outputs.delivery import UnitCopies
from app.outputs.kinds import HostUnit, Outputs
from app.outputs.replay import SentUnit


class Connection(Protocol):
    """Any open connection of a session (``SessionStore.connections``): what a drain, a deletion or a lost lease
    asks of it."""

    @property
    def session_id(self) -> str: ...

    @property
    def is_closed(self) -> bool: ...

    def close(self, code: int, reason: str) -> None:
        """Close with ``code`` once what is already queued was sent."""

    def abort(self) -> None:
        """Stop now (a drain's deadline passed with the client neither reading nor closing)."""

    async def closed(self) -> None:
        """Return once the connection is closed."""


class StreamSubscriber(Connection, Protocol):
    """A session's stream connection (``StreamSession.claim`` registers it): it gets every unit the session
    publishes, in commit order, while it is the session's."""

    def send_unit(self, unit: SentUnit) -> None:
        """Queue one published unit (one the client already has, or any before the connection attached, is
        skipped: the session retains units, and a resume sends them)."""

    def abandon(self) -> None:
        """A newer connection resumed the session: stop at once (its units are retained for the new one)."""


class WatchSubscriber(Connection, Protocol):
    """A read-only watcher (``SessionOps.watch`` registers it): offered every unit from when it joined."""

    @property
    def outputs(self) -> Outputs: ...

    def offer(self, unit: HostUnit | UnitCopies, received: float, sent: SentUnit | None = None,
              metadata: dict[str, str] | None = None) -> None:
        """A unit the session finalized (its chunk arrived at ``received``, ``time.perf_counter``); ``sent``: its
        bytes in the session's outputs, given when they are the watcher's too; ``metadata``: what the unit's bytes
        say besides frames and latency (seq, durable_frames). May drop it (a full queue)."""

    def replay(self, units: list[SentUnit], outputs: Outputs, resume_from: int) -> None:
        """A resuming watcher (``?resume_from=N``): first send ``units`` again (retained, in the session's
        ``outputs``: restricted to the watcher's when they differ), before anything offered; from then on skip an
        offered unit ending at or before ``resume_from`` (the client has it)."""

    def finish(self, frames: int) -> None:
        """The session was flushed and every unit offered (``frames`` returned in all)."""

    def end(self, error: ApiError) -> None:
        """The session is gone (deleted, evicted, moved): say why and close."""
