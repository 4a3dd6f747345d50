"""The attention kernel as a ``torch.library.custom_op``, so that ``torch.compile`` can trace a whole transformer
block (its per-session window and prompt attention included) into one graph: ``fullgraph=True``, no breaks.

Shape letters: B rows, N queries, M keys, D inner dim, A heads.

What breaks the graph today is not the kernel but ``models.attention`` keeping its per-session functions out of it
(``torch.compiler.disable``), which splits a block into pieces; ``fullgraph()`` traces them instead (slicing a
session's rows, RoPE, writing the window, gating), and the kernel is then one opaque node of the graph, with a
fake (shape-only) implementation for tracing. Why an op rather than tracing diffusers' ``dispatch_attention_fn``
too (which torch 2.13's dynamo can: measured, a block also compiles whole without the op under ``aot_eager``): the
op runs exactly the eager kernel (``dispatch_attention_fn``, default backend) on the same shapes, so the compiled
block's attention has the eager bits and the eager backend choice (flash / cuDNN / math), instead of whatever
inductor's attention pattern rewrites and decompositions make of it, and no guards are installed on the
dispatcher's registry.

``models.attention.fullgraph()`` switches attention to this path for code compiled inside it (this module
imports nothing of the package: the switch and its flag live where they are read); the engine's whole step
(``models.step.forward_body``) compiles under it with ``fullgraph=True`` too. Decision: the serving compiled step
(``models.compiled.CompiledStep``) does not use it: a traced per-session loop specialises on the mix of sessions
(measured: a new graph per session count, prompt length and history length), so serving would recompile per mix;
the step keeps its pieces between disabled attention functions until a guard-free form of the window exists (see
``models.compiled``).
"""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn


@torch.library.custom_op("wm_refiner::attend", mutates_args=())
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int,
           mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``query`` (B, N, D) over ``key``/``value`` (B, M, D) in ``heads`` heads; (B, N, D) in the query's
    dtype. ``mask``: additive (B, A, 1 or N, M), or None."""
    out = dispatch_attention_fn(
        query.unflatten(2, (heads, -1)),  # (B, N, A, D/A)
        key.unflatten(2, (heads, -1)),
        value.unflatten(2, (heads, -1)),
        attn_mask=mask,
        dropout_p=0.0,
        is_causal=False,
    )
    return out.flatten(2, 3).to(query.dtype)  # (B, N, D)


@attend.register_fake
def _attend_fake(query, key, value, heads, mask=None):
    return torch.empty_like(query)
