"""Host <-> device copies that never stall the thread that issues them, and the thread's device.

On CUDA an input chunk is staged in pinned memory and copied with ``non_blocking=True``, so the engine thread
queues the copy behind the running kernels instead of waiting for them; a refined unit goes the other way into
pinned memory, with an event the reader waits on (off the engine thread) before it touches the bytes. On a CPU
both are plain tensors and ``wait`` returns at once.

**Exact-size pinned buffers** (``pinned_empty``). ``torch.empty(..., pin_memory=True)`` and ``Tensor.pin_memory()``
both allocate through PyTorch's caching host allocator (``ATen/core/CachingHostAllocator.h`` in torch 2.13), which
rounds every request up to the next power of two (``pinned_max_round_threshold`` is unlimited by default) and keeps
freed blocks cached for reuse: a parked 9.02 GiB window took a 16 GiB block and held it after the page-in. For
buffers of a session's size we instead allocate plain host memory and page-lock exactly its bytes with
``cudaHostRegister`` (what ``torch.cuda._pin_memory_utils`` does for checkpoint staging); the registration is
undone when the tensor is freed. Locking and unlocking gigabytes takes a while (the pages are faulted in and mapped
for the GPU: seconds for a 720p window), so neither happens on the engine thread: ``models.move.stage_host`` locks
a session's buffers on a worker thread before the engine queues its copies, and a freed buffer is unlocked (then
freed) on a thread of its own (``_unlocking``). Small, short-lived buffers (a chunk, a unit) keep the caching
allocator: its rounding costs little there and its reuse saves a registration per call.

Every host-to-device copy of the model code goes through
``to_device`` (never ``torch.tensor(data, device=...)``, a pageable copy that waits for the stream), so that
``tests/models/test_dispatch_audit.py`` can hold the hot path to it.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

# Buffers at least this big get an exact-size registration instead of the caching host allocator's power of two.
EXACT_PIN_BYTES = 64 * 1024 * 1024


def use_device(device: torch.device | str) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing on a CPU). The engine thread calls it first
    thing once it knows the model's device, so that what it queues without naming a device goes there."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:  # plain "cuda" is the current device already
        torch.cuda.set_device(device)


_unlocker: ThreadPoolExecutor | None = None
_unlocker_lock = threading.Lock()


def _unregister(base: torch.Tensor, pointer: int) -> None:
    """Unlock an exact-size buffer, then let its memory go (``base``, the last reference to it, dies here: after the
    unlock, never before)."""
    torch.cuda.cudart().cudaHostUnregister(pointer)
    del base


def _unlocking(base: torch.Tensor, pointer: int) -> None:
    """The buffer's tensor was freed (on whatever thread dropped it, often the engine's): its unlock goes to a
    thread of its own. At interpreter exit, when that thread takes no more work, it happens here."""
    global _unlocker
    try:
        with _unlocker_lock:
            if _unlocker is None:
                _unlocker = ThreadPoolExecutor(1, thread_name_prefix="wm-unpin")
        _unlocker.submit(_unregister, base, pointer)
    except RuntimeError:  # shutting down: "cannot schedule new futures"
        _unregister(base, pointer)


class HostMemoryError(MemoryError):
    """Host memory could not be locked (``cudaHostRegister`` refused): the machine's limits, not the data."""


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised page-locked host tensor. From ``EXACT_PIN_BYTES`` up, exactly its bytes are locked (see the
    module docstring: seconds for gigabytes, so not on the engine thread), and unlocked off the thread that frees it;
    a caller that copies into or out of it asynchronously keeps it alive until the copy's event has passed
    (``models.move.Move`` does)."""
    if torch.Size(shape).numel() * dtype.itemsize < EXACT_PIN_BYTES:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    base = torch.empty(shape, dtype=dtype)
    pointer = base.data_ptr()
    error = int(torch.cuda.cudart().cudaHostRegister(pointer, base.nbytes, 1))  # 1: portable (every device)
    if error != 0:
        raise HostMemoryError(f"cudaHostRegister of {base.nbytes} bytes failed with CUDA error {error} (host memory "
                              "locked past the limit? check `ulimit -l` and the container's memlock)")
    # The caller gets a view; ``base`` stays with the finalizer, so the memory outlives the caller's tensor until
    # the unlocking thread has unregistered it (freeing first would let malloc hand out pages still registered).
    tensor = base.view(base.shape)
    weakref.finalize(tensor, _unlocking, base, pointer)
    return tensor


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor's copy in pinned memory (exact-size from ``EXACT_PIN_BYTES`` up); the tensor itself when it is
    pinned already."""
    if tensor.is_pinned():
        return tensor
    if tensor.nbytes < EXACT_PIN_BYTES:
        return tensor.pin_memory()
    return pinned_empty(tensor.shape, tensor.dtype).copy_(tensor)


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype``; from host to CUDA through pinned memory, without blocking."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        staged = tensor if tensor.is_pinned() else tensor.pin_memory()
        return staged.to(device, non_blocking=True).to(dtype)
    if device.type != "cpu" and tensor.device.type == "cpu":
        # Another accelerator (or ``meta``, where the audit runs): no pinned staging here, but still a copy
        # that does not ask to wait.
        return tensor.to(device=device, dtype=dtype, non_blocking=True)
    return tensor.to(device=device, dtype=dtype)


def host_values(values, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small tensor of host ``values`` (a list of numbers) on ``device``, through ``to_device``."""
    return to_device(torch.tensor(values, dtype=dtype), device, dtype)


class HostCopy:
    """A tensor on its way to host memory. ``wait()`` returns it once the copy is complete.

    The copy and its event go on the current stream *of the tensor's device* (under ``torch.cuda.device``): with
    the model on cuda:1, an event recorded on the thread's current device would be on cuda:0's stream and could
    pass before the copy on cuda:1 ended."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type == "cuda":
            with torch.cuda.device(tensor.device):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(torch.cuda.current_stream(tensor.device))
            self._tensor = host
        else:
            self._tensor = tensor

    def ready(self) -> bool:
        """Whether ``wait`` would return at once (the copy's event has passed): a query, never a wait."""
        event = self._event
        return event is None or event.query()

    def wait(self) -> torch.Tensor:
        """The tensor on the host, once its copy ended. Safe from two threads at once (the engine thread and an
        encoder thread both read a unit's finite flag): the event is read once into a local."""
        event = self._event
        if event is not None:
            event.synchronize()
            self._event = None
        return self._tensor
