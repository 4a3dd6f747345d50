"""The attention kernel as a custom op (models.attention_op): a registered op that torch.library's checks accept,
with the eager kernel's bits, and a whole transformer block (two sessions' window attention, their prompts'
cross-attention, K/V written into the windows) compiled by torch.compile with fullgraph=True on the CPU."""

from __future__ import annotations

import torch

from models import RefinerSession, SessionConfig
from models.attention import ForwardWindow, _attend
from models.attention_op import attend, fullgraph
from models.step import run_batch

from .conftest import make_inputs


def test_the_op_passes_torch_library_checks_and_has_the_eager_bits():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, n, 64, generator=generator) for n in (6, 9, 9))
    mask = torch.randn(2, 4, 1, 9, generator=generator)
    for args in ((query, key, value, 4), (query, key, value, 4, mask)):
        torch.library.opcheck(attend, args)
    assert torch.equal(attend(query, key, value, 4, mask), _attend(query, key, value, 4, None, None, mask))


def _steady_forwards(refiner, count):
    forwards = []
    for seed in range(count):
        latents, embeds = make_inputs(frames=16, height=4, width=4, prompt_len=7 + seed, seed=seed)
        session = RefinerSession(refiner, SessionConfig(seed=seed))
        session.push(latents[:, :, :13], embeds)
        session.append(session.check(latents[:, :, 13:]))
        forwards.append(session.next_forward(session.start(session.plan())))
    return forwards


def test_a_transformer_block_compiles_whole(tiny_refiner):
    """fullgraph=True fails on any graph break; the compiled block matches the eager one within float32 rounding
    (inductor fuses differently) and marks every session's K/V write, as the eager block does."""
    model = tiny_refiner.model
    block = model.transformer_blocks[0]
    forwards = _steady_forwards(tiny_refiner, 2)
    seen = {}

    def before(module, args, kwargs):
        seen["kwargs"] = dict(kwargs)

    def after(module, args, out):
        seen["out"] = out.clone()

    hooks = [block.register_forward_pre_hook(before, with_kwargs=True), block.register_forward_hook(after)]
    try:
        run_batch(model, forwards)  # two sessions in one call: the per-session loops
    finally:
        for hook in hooks:
            hook.remove()
    kwargs = seen["kwargs"]
    assert len(kwargs["kv_cache"].window.rows) == 2
    # A fresh write record over the same rows: the block writes the same K/V to the same slots again.
    window = ForwardWindow(kwargs["kv_cache"].window.rows, len(model.transformer_blocks))
    kwargs["kv_cache"] = window.get(0)
    torch._dynamo.reset()
    with fullgraph(), torch.no_grad():
        # aot_eager: the graph capture (dynamo, fullgraph) and functionalization of the window writes, without
        # inductor's C++ build (a minute on two cores); the compiled step's tests cover inductor.
        compiled = torch.compile(block, fullgraph=True, dynamic=False, backend="aot_eager")
        got = compiled(**kwargs)
    assert got.shape == seen["out"].shape
    assert (got - seen["out"]).abs().max().item() <= 1e-5
    assert window.writes._written[0] == [True, True]
