"""The engine's policy: which forwards form the next model call, which output steps run, in what order.

Pure bookkeeping over plain records (no threads, no tensors, no model), so that it can be read and tested alone;
the engine (``app.engine.worker``) owns the thread, the queues, running the model and committing its results, and asks
this for a plan each iteration.

Sessions are opaque hashable keys here. A session with work is in the *ring*, in turn order:

- ``wake(s)`` when work arrives for a session, ``sleep(s)`` once it has nothing left to do;
- each iteration the engine advances every session of ``ring`` to its next forward (or finds it has none) and hands
  the ready ones to ``plan_call`` as ``Ready`` records (id, rows, group): the first ready one in turn order and the
  following ones of the same group (tokens per row, so they stack into one call) up to ``max_batch_rows`` rows
  form the call; with batching off, or for a group ``batchable`` refuses (``app.engine.batching``: its batch-invariance
  probe has not passed), a call holds one session;
- ``served(call)`` takes the call back once it ran: its sessions move to the back of the ring, so that a session
  of another group goes first next time (no group starves) and a session's next forward joins the very next call
  (nobody waits for a batch to fill);
- output steps (a video's decode) are costly per-unit work that runs between model calls rather than inside the
  commit: ``output_pending(s)`` / ``output_idle(s)`` say which sessions have some pending, and ``plan_outputs``
  says whose oldest pending step runs now: one per such session, in the order they started waiting, so another
  session's forwards are never delayed by more than one step per session with output pending. The engine asks
  for them after it committed the call, so that a unit committed by this call is decoded in this iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence


@dataclass(frozen=True)
class Ready:
    """A session's next forward as the scheduler sees it: ``rows`` of the model call it takes, and its ``group``
    (forwards of one group can share a call)."""

    session: Hashable
    rows: int
    group: Hashable


@dataclass(frozen=True)
class ModelCall:
    """The forwards that form one model call, in the order they stack."""

    members: tuple[Ready, ...]

    @property
    def sessions(self) -> tuple[Hashable, ...]:
        return tuple(member.session for member in self.members)

    @property
    def rows(self) -> int:
        return sum(member.rows for member in self.members)


class Scheduler:
    def __init__(self, max_batch_rows: int = 8, batching: bool = True,
                 batchable: Callable[[Hashable], bool] | None = None):
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.max_batch_rows = max_batch_rows
        self.batching = batching
        # Whether forwards of a group may share a call (``app.engine.batching``: the group's probe passed); default: all.
        self.batchable = batchable or (lambda group: True)
        self._ring: dict[Hashable, None] = {}  # insertion order is the turn order
        self._outputs: dict[Hashable, None] = {}  # sessions with output steps pending, in the order they started

    # --- the ring ----------------------------------------------------------------------------------------------
    @property
    def ring(self) -> tuple[Hashable, ...]:
        """Sessions with work, in turn order."""
        return tuple(self._ring)

    def __contains__(self, session: Hashable) -> bool:
        return session in self._ring

    def wake(self, session: Hashable) -> None:
        """``session`` has work: it joins the back of the ring (a session already in it keeps its place)."""
        self._ring.setdefault(session, None)

    def sleep(self, session: Hashable) -> None:
        """``session`` has nothing left to do: it leaves the ring."""
        self._ring.pop(session, None)

    def clear(self) -> None:
        self._ring.clear()
        self._outputs.clear()

    def plan_call(self, ready: Sequence[Ready]) -> ModelCall | None:
        """The next model call from the sessions' ready forwards (any order; every one must be in the ring); None
        when none is ready."""
        if not ready:
            return None
        order = {session: index for index, session in enumerate(self._ring)}
        missing = [r.session for r in ready if r.session not in order]
        if missing:
            raise ValueError(f"ready forwards of sessions that are not in the ring: {missing!r}; wake them first")
        ranked = sorted(ready, key=lambda r: order[r.session])
        head = ranked[0]
        members, rows = [head], head.rows
        if self.batching and self.batchable(head.group):
            for candidate in ranked[1:]:
                if candidate.group == head.group and rows + candidate.rows <= self.max_batch_rows:
                    members.append(candidate)
                    rows += candidate.rows
        return ModelCall(tuple(members))

    def served(self, call: ModelCall) -> None:
        """``call`` ran: its sessions go to the back of the ring (those that left it meanwhile stay out)."""
        for session in call.sessions:
            if session in self._ring:
                del self._ring[session]
                self._ring[session] = None

    # --- output steps ------------------------------------------------------------------------------------------
    @property
    def outputs_pending(self) -> bool:
        return bool(self._outputs)

    def output_pending(self, session: Hashable) -> None:
        """``session`` has output steps waiting (it keeps its place if it already had)."""
        self._outputs.setdefault(session, None)

    def output_idle(self, session: Hashable) -> None:
        """``session`` has no output step waiting any more."""
        self._outputs.pop(session, None)

    def plan_outputs(self) -> tuple[Hashable, ...]:
        """Whose oldest pending output step runs now: each session that has one, once, in the order they started
        waiting."""
        return tuple(self._outputs)

