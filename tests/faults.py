"""Fault injection for tests: make one session's forwards fail the way a device would, wherever they run
(alone, or batched with other sessions' forwards)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def failing_forwards(model, session, message: str = "CUDA out of memory. Tried to allocate 80.00 GiB", when=None):
    """While active, every model call that carries a forward of ``session`` raises RuntimeError(message) in its
    first block (``when(call_number)`` can limit it to some calls). Yields the list of failed calls."""
    calls: list[int] = []
    seen = {"n": 0}

    def hook(module, args, kwargs):
        layer = kwargs.get("kv_cache")
        if layer is None or not any(row.owner is session for row in layer.window.rows):
            return
        seen["n"] += 1
        if when is None or when(seen["n"]):
            calls.append(seen["n"])
            raise RuntimeError(message)

    handle = model.transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()
