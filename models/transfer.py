"""Host <-> device copies that never stall the thread that issues them.

On CUDA an input chunk is staged in pinned memory and copied with ``non_blocking=True``, so the engine thread
queues the copy behind the running kernels instead of waiting for them; a refined unit goes the other way into
pinned memory, with an event the reader waits on (off the engine thread) before it touches the bytes. On a CPU
both are plain tensors and ``wait`` returns at once. Every host-to-device copy of the model code goes through
``to_device`` (never ``torch.tensor(data, device=...)``, a pageable copy that waits for the stream), so that
``tests/models/test_dispatch_audit.py`` can hold the hot path to it.
"""

from __future__ import annotations

import torch


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
    """A tensor on its way to host memory. ``wait()`` returns it once the copy is complete."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._tensor = host
        else:
            self._tensor = tensor

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tensor
