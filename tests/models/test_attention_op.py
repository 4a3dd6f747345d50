"""The attention kernel as a custom op (models.attention_op): a registered op that torch.library's checks accept,
with the eager kernel's bits, and a whole transformer block (two sessions' window attention, their prompts'
cross-attention, K/V written into the windows) compiled by torch.compile with fullgraph=True on the CPU; then the
engine's whole step (``models.step.forward_body``, as ``run_batch`` calls it) compiled the same way, and what its
graph specialises on (why the serving compiled step does not use it: ``models.compiled``)."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from models import RefinerSession, SessionConfig
from models.attention import ForwardWindow, _attend
from models.attention import fullgraph
from models.attention_op import attend
from models.step import forward_body, run_batch

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
    assert len(kwargs["kv_cache"].rows) == 2
    # A fresh write record over the same rows: the block writes the same K/V to the same slots again.
    window = ForwardWindow(kwargs["kv_cache"].rows, len(model.transformer_blocks))
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


def _forwards(refiner, seeds, prompt_len=7, history_blocks=4):
    """One denoising forward per seed, of a session that refined ``history_blocks`` blocks (4 fill its history)."""
    forwards = []
    for seed in seeds:
        latents, embeds = make_inputs(frames=16, height=4, width=4, prompt_len=prompt_len, seed=seed)
        session = RefinerSession(refiner, SessionConfig(seed=seed))
        end = 1 + 3 * history_blocks
        session.push(latents[:, :, :end], embeds)
        session.append(session.check(latents[:, :, end : end + 3]))
        forwards.append(session.next_forward(session.start(session.plan())))
    return forwards


def test_the_engines_step_compiles_whole_and_its_graph_specialises_on_the_mix(tiny_refiner):
    """``forward_body`` as the engine's ``run_batch`` calls it (every layer, two sessions' attention inside) under
    ``fullgraph()``: torch.compile(fullgraph=True) raises on any graph break, and the compiled step matches the
    eager one. The counter then shows why the serving step keeps its pieces: the same mix of sessions reuses the
    graph, but another session count, another prompt length or another history length each compile a new one (the
    per-session loop's shapes and slots become guards), on the engine thread, while serving."""
    model = tiny_refiner.model
    counter = CompileCounterWithBackend("aot_eager")  # graph capture and functionalization, no C++ build
    torch._dynamo.reset()
    mixes = [
        ("two sessions", _forwards(tiny_refiner, [0, 1]), 1),
        ("two other sessions, same shapes", _forwards(tiny_refiner, [2, 3]), 1),
        ("one session", _forwards(tiny_refiner, [4]), 2),
        ("another prompt length", _forwards(tiny_refiner, [5, 6], prompt_len=9), 3),
        ("a history still growing", _forwards(tiny_refiner, [7, 8], history_blocks=2), 4),
    ]
    try:
        with fullgraph(), torch.no_grad():
            body = torch.compile(forward_body, fullgraph=True, dynamic=False, backend=counter)
            for what, forwards, graphs in mixes:
                eager = run_batch(model, forwards)
                compiled = run_batch(model, forwards, body=body)  # the write record is verified inside, too
                assert counter.frame_count == graphs, what
                for a, b in zip(eager, compiled, strict=True):
                    assert (a - b).abs().max().item() <= 1e-5, what
    finally:
        torch._dynamo.reset()
