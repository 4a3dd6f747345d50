"""Host memory behaviour that decides whether a batched forward on the CPU pays for page faults.

A batched forward's activations are big (8 sessions x 192 tokens x 1536 = 9 MB per FF tensor for the medium
refiner at 8x8). glibc serves allocations that large with ``mmap`` and returns them to the kernel on ``free``, so
every such tensor of every forward is faulted in again, page by page: measured here, a stacked forward of eight
sessions took 58,000 minor page faults and ~10% of its time; a solo forward's smaller tensors stay in the heap
and take none. PyTorch's CPU tuning guide swaps in jemalloc or tcmalloc for this; glibc's own ``mallopt`` knobs
do the same job without a preloaded library: allocations up to 32 MiB come from the heap, and freed memory stays
there for the next forward (resident memory then stays at its high-water mark instead of breathing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit systems
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Make glibc keep large freed blocks for reuse (see the module docstring). True if it took effect; False where
    the C library is not glibc (nothing changes there)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if not ok:
        log.warning("mallopt refused the heap settings; large CPU tensors will be page-faulted in every forward")
    return ok
