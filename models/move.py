"""Moving a live session's tensors to another device (parking to the host, a page-in back) without a host wait:
the copies run on a side stream of the CUDA device (``Move``), and ``move_session`` moves every tensor a session
holds in place. Used by ``app.sessions.parking`` on the engine thread, after ``stage_host`` has page-locked the host
memory the move needs on a worker thread, and by a crash checkpoint's copy (``models.snapshot.copy_session``, its
buffers locked by ``stage_tensors``)."""

from __future__ import annotations

import dataclasses

import torch

from .transfer import pinned_copy, pinned_empty, use_device


class Move:
    """Tensors of a session on their way to another device, queued on a side stream without waiting.

    Both ways the copies run on a side stream of the CUDA device, so neither the engine thread nor the engine's
    (compute) stream waits for them:

    - Device to host (parking, a crash checkpoint's copy): the side stream first waits for everything queued on the compute stream (the last
      forwards that wrote the cache); the copies go into exact-size pinned host buffers
      (``models.transfer.pinned_empty``: the caching host allocator would round a 9 GiB window up to 16 GiB and
      keep it); the source tensors are marked as used by the side stream (``record_stream``), so the caching
      allocator reuses their memory only once the copies are done.
    - Host to device (a page-in): the side stream first waits for ``after`` (the park's own copies); the new device
      tensors are allocated on the side stream and marked as used by the compute stream too (``record_stream``),
      so freeing them later waits for the forwards that read them. The compute stream does *not* wait here: the
      caller makes the session's next forward wait for ``ready`` (``app.engine.worker.wait_for``), so forwards of other
      sessions queued meanwhile run while the window is copied.

    ``ready`` is the event the copies complete with: whoever reads the results waits for it (``after`` on the
    device, ``synchronize`` on the host). The host buffers a page-in reads from, and those a park writes into, are
    kept alive until ``ready`` has passed (``_in_flight``). ``after`` (either way): an event the copies wait for
    first (a page-in: the park's; a park: the last page-in's). Elsewhere (CPU to CPU) nothing is copied unless
    ``copy`` asks for it (tests do, to prove that no tensor of the moved session is shared with the one before)."""

    def __init__(self, device: torch.device, copy: bool = False, after=None, cuda_device: torch.device | None = None,
                 host: dict[int, torch.Tensor] | None = None):
        self.device = torch.device(device)
        self.copy = copy
        self.after = after
        # Pinned host memory ``stage_host`` prepared off the engine thread, by the id of the tensor it is for.
        self.host = dict(host or {})
        # The CUDA device whose streams carry the copies: the target when it is CUDA, else the tensors' own device
        # (``cuda_device``; the current device when not given).
        self.cuda_device = self.device if self.device.type == "cuda" else cuda_device
        self.ready = None
        self._stream = None
        self._compute = None
        self._context = None
        self._sources: list[torch.Tensor] = []

    def __enter__(self) -> Move:
        cuda = self.device.type == "cuda" or (torch.cuda.is_available() and torch.cuda.is_initialized())
        if cuda:
            release_finished()
            device = self.cuda_device or torch.device("cuda", torch.cuda.current_device())
            self._compute = torch.cuda.current_stream(device)
            self._stream = side_stream(device, to_host=self.device.type == "cpu")
            if self.device.type == "cpu":
                self._stream.wait_stream(self._compute)  # the forwards that wrote what is parked
            if self.after is not None:
                # A page-in: the park's copies into the host buffers. A park: the page-in's copies that brought
                # the tensors (on another side stream, which the compute stream waits for only once the session's
                # next work runs: a park right after a page-in would read memory still being written).
                self._stream.wait_event(self.after)
            self._context = torch.cuda.stream(self._stream)
            self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._stream is not None:
            self._context.__exit__(*exc)
            self.ready = torch.cuda.Event()
            self.ready.record(self._stream)
            if self._sources:
                _in_flight.append((self.ready, self._sources))

    def __call__(self, tensor: torch.Tensor | None, key=None) -> torch.Tensor | None:
        """``tensor`` on the target device. ``key``: what ``host`` holds its staged buffer under (default: the
        tensor's id, as ``stage_host`` keys it; a checkpoint's views are made anew on the engine thread, so it keys
        them by name, ``models.snapshot.stage_copy``)."""
        if tensor is None:
            return None
        if tensor.device.type == self.device.type and (self.device.type == "cpu" or tensor.device == self.device):
            return tensor.clone() if self.copy else tensor
        if self.device.type == "cpu":  # from CUDA, on the side stream
            host = self._staged(tensor, key)
            if host is None:  # not staged: locked here, on the engine thread (seconds for gigabytes)
                host = pinned_empty(tensor.shape, tensor.dtype)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._stream)
            # Kept alive until the copy is done: the session may be deleted meanwhile, and an exact-size buffer is
            # plain host memory (unregistered and freed with its tensor) that the copy would go on writing into.
            self._sources.append(host)
            return host
        staged = self._staged(tensor, key)
        if staged is None:  # a spilled session's tensors come back from a file in plain memory
            staged = pinned_copy(tensor)
        moved = staged.to(self.device, non_blocking=True)
        moved.record_stream(self._compute)  # allocated on the side stream, read by the compute stream's forwards
        self._sources.append(staged)
        return moved

    def _staged(self, tensor: torch.Tensor, key=None) -> torch.Tensor | None:
        staged = self.host.pop(id(tensor) if key is None else key, None)
        if staged is not None and (staged.shape != tensor.shape or staged.dtype != tensor.dtype):
            return None  # staged for another tensor that had this id (it changed since): not this one's
        return staged

    @staticmethod
    def after_ready(ready) -> None:
        """Make the current stream wait for a move's copies (no host wait)."""
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)


# Host buffers page-ins read from and parks write into, with the event their copies complete with: released
# once the event has passed, checked without waiting at the next move and at every engine commit.
_in_flight: list[tuple[object, list[torch.Tensor]]] = []
_side_streams: dict[tuple[torch.device, bool], object] = {}


def side_stream(device: torch.device, to_host: bool):
    """One side stream per device and direction, kept: the caching allocator pools blocks per stream, so a new
    stream per move (torch hands out 32 in turn) would leave each page-in's freed windows in a pool that the next
    page-ins, on other streams, cannot reuse until an out-of-memory retry empties the cache. Parks and page-ins
    keep one stream each, so a park's copies out and a page-in's copies in can still run at once."""
    key = (device, to_host)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device)
    return _side_streams[key]


def release_finished() -> None:
    """Drop the host buffers of page-ins whose copies have completed (never waits)."""
    if _in_flight:
        _in_flight[:] = [(event, tensors) for event, tensors in _in_flight if not event.query()]


def moved_tensors(session) -> list[torch.Tensor]:
    """The tensors ``move_session`` moves: the KV cache's, the prompt's, the pending frames."""
    kv, state = session.kv, session.state
    held = [kv.window, kv.sink_key, kv.history_key] if kv is not None else []
    if state.prompt is not None:
        held += [state.prompt.embeds, state.prompt.mask]
    return [tensor for tensor in held + [state.pending] if tensor is not None]


def stage_host(session, device: torch.device) -> dict[int, torch.Tensor]:
    """The pinned host memory a ``move_session(session, device)`` needs, page-locked here instead of on the engine
    thread: to the host, an empty exact-size pinned buffer per CUDA tensor; to CUDA, a pinned copy of each tensor in
    plain host memory (a spilled session read back from its file). Keyed by the tensor's id; pass it as
    ``move_session(..., host=)``. Locking a 720p window's 9 GiB faults in and maps every page (seconds), which on
    the engine thread would stall every session; a worker thread calls this (``app.sessions.parking``) while the
    session is excluded from scheduling (its tensors are only read here, by shape, or copied on the host). Nothing
    without CUDA."""
    return stage_tensors({id(tensor): tensor for tensor in moved_tensors(session)}, device)


def stage_tensors(tensors: dict, device: torch.device) -> dict:
    """``stage_host`` for any tensors, under the caller's keys: what a ``Move`` to ``device`` of each needs in
    pinned host memory (``Move(host=)``, each called with its key). Off the engine thread."""
    device = torch.device(device)
    cuda = next((t.device for t in tensors.values() if t.device.type == "cuda"),
                device if device.type == "cuda" else None)
    if cuda is None:
        return {}
    use_device(cuda)  # a thread with no current device would open a context on cuda:0 for the registration
    staged = {}
    for key, tensor in tensors.items():
        if device.type == "cpu" and tensor.device.type == "cuda":
            staged[key] = pinned_empty(tensor.shape, tensor.dtype)
        elif device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
            staged[key] = pinned_copy(tensor)
    return staged


def move_session(session, device: torch.device, copy: bool = False, after=None,
                 host: dict[int, torch.Tensor] | None = None):
    """Move every tensor ``session`` holds (its KV cache, pending frames and prompt) to ``device`` in place, without
    a host wait; returns the CUDA event the copies complete with (None elsewhere): reading the moved tensors on the
    device (or on the host) must wait for it. ``after``: an event the copies must wait for first (a page-in waits
    for the park's copies, a park for the last page-in's). ``host``: what ``stage_host`` prepared (a tensor it has
    nothing for is staged here, on the calling thread). The caption projection prepared
    from the prompt is dropped (recomputed from the moved prompt by the next forward, bit for bit: it is the same
    computation on the same values). Only the engine thread may call this, between two of its jobs, and only for a
    session with no run in flight (nothing else reads those tensors then)."""
    state = session.state
    if session.kv is not None and session.kv.rollback_open:
        raise RuntimeError("a session is moved between two pieces of work, never with a rollback point open")
    held = session.kv.window if session.kv is not None else state.pending
    source = held.device if held is not None and held.device.type == "cuda" else None
    with Move(device, copy, after=after, cuda_device=source, host=host) as move:
        kv = session.kv
        if kv is not None:
            kv.window = move(kv.window)
            kv.sink_key = move(kv.sink_key)
            kv.history_key = move(kv.history_key)
        prompt = state.prompt
        if prompt is not None:
            prompt = type(prompt)(embeds=move(prompt.embeds), mask=move(prompt.mask))
        session.load(dataclasses.replace(state, pending=move(state.pending), prompt=prompt), kv)
        session._prepared = None
    return move.ready
