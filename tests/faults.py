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
        if layer is None or not any(row.owner is session for row in layer.rows):
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


# What a C++ compiler that segfaults prints; ``crashing_compiler`` fails with it.
COMPILER_CRASH = "g++: internal compiler error: Segmentation fault signal terminated program cc1plus"


@contextlib.contextmanager
def crashing_compiler():
    """While active, torch.compile's inductor backend (``compile_backend``'s default) fails as when its C++ compiler
    crashes, once dynamo has traced the function and hands inductor the graph: a ``RuntimeError`` worded as inductor
    words a ``CppCompileError`` (the command, then the compiler's output), which dynamo raises as
    ``BackendCompilerFailed``. Dynamo and whatever calls it run for real. Dynamo's caches are reset on entry and exit,
    so nothing compiled before stands in for the compile and nothing half-compiled outlives it."""
    import torch
    import torch._inductor.compile_fx as inductor  # what torch.compile's inductor wrapper calls, looked up per call

    def crashing(graph, example_inputs, **kwargs):
        raise RuntimeError(f"C++ compile error\n\nCommand:\ng++ kernel.cpp -shared -o kernel.so\n\nOutput:\n"
                           f"{COMPILER_CRASH}\n")

    original = inductor.compile_fx
    inductor.compile_fx = crashing
    torch._dynamo.reset()
    try:
        yield
    finally:
        inductor.compile_fx = original
        torch._dynamo.reset()
