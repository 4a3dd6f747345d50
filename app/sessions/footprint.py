"""What a session holds, in bytes, by part and by where: the numbers the session JSON, the listing, ``/metrics``
and ``/v1/info`` report, and the ones admission by bytes adds up.

``device`` is the memory the model computes from (the GPU's; on a CPU server the host's own RAM, where nothing
moves), ``host`` what the session keeps off it: on every device the units kept for a reattaching stream and the
last response kept for a repeated ``seq``, and, while the session is *parked*, its KV cache, pending frames and
prompt (pinned host memory on CUDA; on a CPU server the same tensors, counted out of the device budget). Plain
bookkeeping over a handle's fields; no tensor is touched, nothing is awaited.
"""

from __future__ import annotations

import math
from typing import Any

from models.session_bytes import session_bytes

# The parts a parked session moves to the host (``models.move.move_session``); the output stages' states (a video
# decoder's) stay where they are.
MOVED_PARTS = ("kv_window", "kv_sink", "kv_history_keys", "kv_rollback", "pending", "prompt")


def handle_parts(handle: Any) -> dict[str, int]:
    """Every part the session ``handle`` holds, in bytes."""
    parts = session_bytes(handle.session)
    parts["decoder"] = handle.engine_session.stages.nbytes
    parts["retained_units"] = handle.retained.nbytes
    stored = handle.chunks.last_response
    parts["last_response"] = 0 if stored is None else len(stored)
    return parts


def handle_bytes(handle: Any) -> dict[str, Any]:
    """``{"device": n, "host": n, "parts": {...}}`` for the session JSON; device and host sum the parts."""
    parts = handle_parts(handle)
    parked = getattr(handle, "memory_state", "active") != "active"
    on_host = {"retained_units", "last_response", *(MOVED_PARTS if parked else ())}
    device = sum(n for name, n in parts.items() if name not in on_host)
    host = sum(n for name, n in parts.items() if name in on_host)
    return {"device": device, "host": host, "parts": parts}


def parse_bytes(value: Any) -> int:
    """Bytes from an integer or a string such as ``40GiB``, ``512 MiB``, ``1.5e9``."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number of bytes")
    if isinstance(value, (int, float)):
        number = value
    else:
        text = str(value).strip()
        units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
                 "tb": 10**12, "b": 1}
        scale = 1
        for suffix, size in units.items():
            if text.lower().endswith(suffix):
                text, scale = text[: -len(suffix)].strip(), size
                break
        try:
            number = float(text) * scale
        except ValueError:
            raise ValueError(f"{value!r} is not a number of bytes; write e.g. 40000000000, 40GiB or 512MiB") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{value!r} is not a number of bytes (>= 0)")
    return int(number)
