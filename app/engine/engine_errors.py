"""The engine's own errors: what went wrong in the engine, in its terms (no HTTP, no WebSocket).

``app.core.error_kinds`` maps each to the code, status and close code a client sees (``from_exception``). Their messages
are written for the client already (they say what to do), so that the mapping only has to pick the code.
"""

from __future__ import annotations

from typing import Literal


class EngineError(Exception):
    """Base of the errors the engine raises itself."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Draining(EngineError):
    """The engine takes no new work (the drain, or it stopped), or stopped this work before it finished."""


class EngineBusy(EngineError):
    """A queue is full: the engine's (``engine_queue_depth`` works) or one session's (``session_queue_depth``)."""

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

    def __init__(self, kind: str, action: str, cause: BaseException, frames_returned: int):
        self.kind = kind
        self.cause = cause
        super().__init__(
            f"{action} failed ({cause!r}); its refined latents up to frame {frames_returned} are kept, but the "
            f"session cannot produce {kind} any more: start a new session"
        )
