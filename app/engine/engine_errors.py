"""The engine's own errors: what went wrong in the engine, in its terms (no HTTP, no WebSocket).

Each names the kind of ``app.core.error_kinds``'s table it is reported as (``error_kind``), which gives the code,
status and close code a client sees. Their messages are written for the client already (they say what to do), so
that reporting them only picks the code.
"""

from __future__ import annotations

from typing import Literal

from app.core.error_kinds import KindedError


class EngineError(KindedError):
    """Base of the errors the engine raises itself."""


class Draining(EngineError):
    """The engine takes no new work (the drain, or it stopped), or stopped this work before it finished."""

    error_kind = "draining"


class EngineBusy(EngineError):
    """A queue is full: the engine's (``engine_queue_depth`` works) or one session's (``session_queue_depth``)."""

    error_kind = "engine_busy"

    def __init__(self, queue: Literal["engine", "session"], queued: int):
        self.queue = queue
        self.queued = queued
        if queue == "engine":
            message = f"the engine already has {queued} jobs queued (engine_queue_depth); retry shortly"
        else:
            message = (f"this session already has {queued} chunks queued (session_queue_depth); wait for their "
                       "responses before sending more")
        super().__init__(message)


class OutputFailed(EngineError):
    """An output stage of a session failed (say, its video's decode): what it committed is kept, but the session
    cannot produce that output any more; its later work fails with this."""

    error_kind = "internal_error"

    def __init__(self, kind: str, action: str, cause: BaseException, frames_returned: int):
        self.kind = kind
        self.cause = cause
        super().__init__(
            f"{action} failed ({cause!r}); its refined latents up to frame {frames_returned} are kept, but the "
            f"session cannot produce {kind} any more: start a new session"
        )
