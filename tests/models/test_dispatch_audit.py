"""No stalls in a steady block, by construction: what the engine thread runs for one block at the released widths,
audited op by op on the ``meta`` device (shapes only, no GPU needed).

The refiner is the released architecture (diffusers' default ``SanaWMLTX2RefinerTransformer3DModel`` config: 4096
wide, 32 x 128 heads, caption 3840) with 2 layers instead of 48 to keep the test fast: every layer runs the same
code, so a stall in one is a stall in each. ``load_refiner(folder, device="meta")`` builds it from config.json
alone. Latents are 480p (832 x 480 px: 26 x 15 latents, 390 tokens a frame).

What a steady block (after the sink and one warm block) may not do, on the device (on ``meta``, the non-CPU
device stands for the GPU):

- read the device from the host: ``aten._local_scalar_dense`` (``item``, ``bool``, ``float``), ``equal``,
  ``nonzero``, ``is_nonzero``, or a device-to-host copy that is not ``non_blocking``;
- copy the project's own host data to the device without ``non_blocking``: ``torch.tensor(data, device=...)`` or
  ``torch.as_tensor`` (these do not reach the dispatcher as ops: a ``TorchFunctionMode`` sees them), a ``.to`` /
  ``copy_`` from the CPU;
- call attention with a mask when none was sent, an all-ones one, or a padding mask (the same tokens kept in every
  stream: the prompt is cut down to them when it arrives, ``models.session.check_prompt``).

The audit runs a ``TorchDispatchMode`` (ops as the device sees them) and a ``TorchFunctionMode`` (Python-level
calls: ``torch.tensor``, ``scaled_dot_product_attention``'s ``attn_mask``) together; on ``meta`` a host read would
fail, so the audit records it and answers with a placeholder, and the run goes on to count the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from models import SessionConfig, load_refiner
from models.session import RefinerSession
from models.step import run_batch
from models.transfer import to_device

ATEN = torch.ops.aten
READS = {ATEN._local_scalar_dense.default, ATEN.equal.default, ATEN.is_nonzero.default, ATEN.nonzero.default}
LAYERS = 2
LATENT_H, LATENT_W = 15, 26  # 480 x 832 px through the VAE's 32 x 32


def _device(value) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (str, torch.device)):
        return torch.device(value)
    return None


def _on_device(value) -> bool:
    device = _device(value)
    return device is not None and device.type != "cpu"


@dataclass
class Audit:
    reads: list[str] = field(default_factory=list)  # device -> host reads
    blocking_copies: list[str] = field(default_factory=list)  # host -> device copies that wait
    masked_attention: int = 0
    attention: int = 0

    def clean(self) -> bool:
        return not self.reads and not self.blocking_copies and self.masked_attention == 0


class _Ops(TorchDispatchMode):
    def __init__(self, audit: Audit):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        audit = self.audit
        if func in READS and any(_on_device(a) for a in args):
            audit.reads.append(str(func))
            placeholder = {ATEN.equal.default: True, ATEN.is_nonzero.default: True}
            if func in placeholder:
                return placeholder[func]
            if func is ATEN._local_scalar_dense.default:
                return False if args[0].dtype == torch.bool else 1
            return torch.zeros(0, args[0].ndim, dtype=torch.long, device=args[0].device)  # nonzero
        if func is ATEN._to_copy.default and args and isinstance(args[0], torch.Tensor):
            source, target = args[0].device, _device(kwargs.get("device")) or args[0].device
            blocking = not kwargs.get("non_blocking", False)
            if source.type == "cpu" and target.type != "cpu" and blocking:
                audit.blocking_copies.append(f"{func} cpu -> {target}")
            if source.type != "cpu" and target.type == "cpu" and blocking:
                audit.reads.append(f"{func} {source} -> cpu")
                if source.type == "meta":  # no data to copy: a placeholder of ones (a finite flag reads "finite")
                    return torch.ones(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if func is ATEN.copy_.default:
            target, source = args[0].device, args[1].device
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if source.type == "cpu" and target.type != "cpu" and blocking:
                audit.blocking_copies.append(f"{func} cpu -> {target}")
            if source.type != "cpu" and target.type == "cpu" and blocking:
                audit.reads.append(f"{func} {source} -> cpu")
                if source.type == "meta":
                    return args[0]
        return func(*args, **kwargs)


class _Calls(TorchFunctionMode):
    def __init__(self, audit: Audit):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and _on_device(kwargs.get("device")):
            self.audit.blocking_copies.append(f"torch.{func.__name__}(data, device={kwargs['device']})")
        if func is F.scaled_dot_product_attention:
            self.audit.attention += 1
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            if mask is not None:
                self.audit.masked_attention += 1
        return func(*args, **kwargs)


class audited:
    """``with audited() as audit:``: every op of the block, counted."""

    def __enter__(self) -> Audit:
        self.audit = Audit()
        self._modes = [_Calls(self.audit), _Ops(self.audit)]
        for mode in self._modes:
            mode.__enter__()
        return self.audit

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """The released refiner's widths at 2 layers, from config.json alone, on meta."""
    folder = tmp_path_factory.mktemp("released-2-layers")
    (folder / "config.json").write_text(json.dumps(
        {"_class_name": "SanaWMLTX2RefinerTransformer3DModel", "num_layers": LAYERS}))
    refiner = load_refiner(folder, device="meta", dtype="bfloat16")
    assert refiner.info.inner_dim == 4096 and refiner.info.caption_channels == 3840
    assert refiner.info.num_layers == LAYERS
    return refiner


def _chunk(refiner, frames: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, refiner.info.in_channels, frames, LATENT_H, LATENT_W, generator=generator)


def _prompt(refiner, length: int, mask: str):
    embeds = torch.randn(1, length, refiner.info.caption_channels)
    if mask == "none":
        return embeds, None
    ones = torch.ones(1, length, dtype=torch.int64)
    if mask == "padded":
        ones[:, : length // 4] = 0  # left padding, as the Gemma tokenizer pads
    return embeds, ones


CONFIG = dict(block_size=3, kv_max_frames=7)  # history 6 frames: the third block on drops the oldest ones


class Driver:
    """What the engine thread does for one block of each session: the chunk's check and append, plan, start, the
    forwards (batched with ``run_batch``), advance, commit."""

    def __init__(self, sessions: list[RefinerSession]):
        self.sessions = sessions

    def block(self, chunks: list[torch.Tensor], prompts: list[tuple] | None = None):
        runs = []
        for index, (session, latents) in enumerate(zip(self.sessions, chunks)):
            embeds, mask = prompts[index] if prompts else (None, None)
            session.append(session.check(latents, embeds, mask, finite_checked=True))
            runs.append(session.start(session.plan()))
        while True:
            forwards = [session.next_forward(run) for session, run in zip(self.sessions, runs)]
            if all(f is None for f in forwards):
                break
            velocities = run_batch(self.sessions[0].refiner.model, forwards)
            for session, run, velocity in zip(self.sessions, runs, velocities):
                session.advance(run, velocity)
        return [session.commit(run) for session, run in zip(self.sessions, runs)]


def _warm(refiner, count: int, positions: str, mask: str) -> Driver:
    """``count`` sessions with their sink and one block behind them (the prompt arrives with the sink)."""
    sessions = [RefinerSession(refiner, SessionConfig(positions=positions, seed=i, **CONFIG)) for i in range(count)]
    driver = Driver(sessions)
    prompts = [_prompt(refiner, 20 + 7 * i, mask) for i in range(count)]
    driver.block([_chunk(refiner, 1, i) for i in range(count)], prompts)  # the sink
    driver.block([_chunk(refiner, 3, 10 + i) for i in range(count)])  # the warm block
    return driver


@pytest.mark.parametrize("mask", ["none", "all-ones", "padded"])
@pytest.mark.parametrize("positions", ["absolute", "rebased"])
@pytest.mark.parametrize("sessions", [1, 3], ids=["one-session", "batch-of-3"])
def test_a_steady_block_never_stalls(released, sessions, positions, mask):
    driver = _warm(released, sessions, positions, mask)
    forwards = SessionConfig(**CONFIG).steps + 1
    for block in range(3):  # the history fills, then drops its oldest frames every block
        with audited() as audit:
            units = driver.block([_chunk(released, 3, 20 + 3 * block + i) for i in range(sessions)])
        assert audit.reads == [], f"block {block}: device -> host reads {audit.reads}"
        assert audit.blocking_copies == [], f"block {block}: blocking host -> device copies {audit.blocking_copies}"
        assert audit.masked_attention == 0
        # The audit saw the forwards: self- and cross-attention per layer, session and forward.
        assert audit.attention == 2 * LAYERS * sessions * forwards
        # The finite flag went with each unit, unread.
        assert all(u.kind == "block" and u.check is not None and u.check.summary.device.type == "meta" for u in units)


def test_a_padding_mask_cuts_the_prompt_and_a_ragged_one_stays_a_mask(released):
    """A padding mask (the same tokens kept in every stream) reaches attention as no mask at all: the prompt's K/V
    hold the kept tokens only. Streams padded differently need a mask (one length per prompt): attention gets it."""
    session = RefinerSession(released, SessionConfig(**CONFIG))
    embeds, mask = _prompt(released, 12, "padded")
    Driver([session]).block([_chunk(released, 1, 0)], [(embeds, mask)])
    assert session.state.prompt.mask is None and session.state.prompt.embeds.shape[1] == 12 - 12 // 4

    session = RefinerSession(released, SessionConfig(**CONFIG))
    embeds = torch.randn(2, 12, released.info.caption_channels)
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[0, :3], mask[1, :5] = 0, 0
    driver = Driver([session])
    driver.block([torch.cat([_chunk(released, 1, 0), _chunk(released, 1, 1)])], [(embeds, mask)])
    with audited() as audit:
        driver.block([torch.cat([_chunk(released, 3, 2), _chunk(released, 3, 3)])])
    assert session.state.prompt.mask is not None and session.state.prompt.embeds.shape[1] == 12
    assert audit.masked_attention == LAYERS * (SessionConfig(**CONFIG).steps + 1)


def test_the_audit_catches_each_kind_of_stall():
    """Negative controls: each stall the audit exists for, done once on purpose, is counted once."""
    device = torch.device("meta")
    x = torch.empty(4, 8, device=device)
    q = torch.empty(1, 2, 5, 8, device=device)
    cases = {
        "item": lambda: x.sum().item(),
        "bool": lambda: bool(torch.isfinite(x).all()),
        "torch.tensor": lambda: torch.tensor([1.0, 2.0], device=device),
        "pageable .to": lambda: torch.ones(3).to(device),
        "copy_ from cpu": lambda: x[0].copy_(torch.ones(8)),
        "masked attention": lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 5, 5,
                                                                                                  device=device)),
    }
    expected = {"item": "reads", "bool": "reads", "torch.tensor": "blocking_copies", "pageable .to": "blocking_copies",
                "copy_ from cpu": "blocking_copies", "masked attention": "masked_attention"}
    for name, stall in cases.items():
        with audited() as audit:
            stall()
        counted = {"reads": len(audit.reads), "blocking_copies": len(audit.blocking_copies),
                   "masked_attention": audit.masked_attention}
        assert counted[expected[name]] == 1 and sum(counted.values()) == 1, (name, counted)
    # What the model code does instead is clean.
    with audited() as audit:
        to_device(torch.ones(3), device, torch.float32)
        torch.isfinite(x).all()
        F.scaled_dot_product_attention(q, q, q)
    assert audit.clean() and audit.attention == 1


def test_the_audit_catches_a_stall_put_back_into_the_session(released, monkeypatch):
    """The session's own hot path, with two of the old stalls put back, fails the audit: the finite flag read at
    commit, and RoPE positions copied from a host list."""
    import models.rope as rope
    from models.session import RefinerSession as Session

    driver = _warm(released, 1, "absolute", "none")
    commit = Session.commit

    def reading_commit(self, run):
        unit = commit(self, run)
        unit.verify()  # the old commit read the flag on the engine thread
        return unit

    monkeypatch.setattr(Session, "commit", reading_commit)
    monkeypatch.setattr(rope, "frame_positions_tensor",
                        lambda positions, dtype, device: torch.tensor(list(positions), dtype=dtype, device=device))
    with audited() as audit:
        driver.block([_chunk(released, 3, 5)])
    assert len(audit.reads) == 1  # the finite flag
    assert len(audit.blocking_copies) == 2  # the sink's and the block's positions (no history table: absolute)


def test_the_prompt_k_v_are_computed_once_per_prompt(released):
    """Cross-attention K/V depend on the prompt alone: a steady block runs no attn2 key/value projection; a new
    prompt runs each layer's once."""
    calls = []
    hooks = [projection.register_forward_hook(lambda *_: calls.append(1))
             for block in released.model.transformer_blocks for projection in (block.attn2.to_k, block.attn2.to_v)]
    try:
        driver = _warm(released, 1, "absolute", "none")
        assert len(calls) == 2 * LAYERS  # the sink's prompt, once
        driver.block([_chunk(released, 3, 7)])
        assert len(calls) == 2 * LAYERS
        session = driver.sessions[0]
        session.append(session.check(_chunk(released, 3, 8), *_prompt(released, 9, "none")))  # a new prompt
        run = session.start(session.plan())
        while (forward := session.next_forward(run)) is not None:
            session.advance(run, run_batch(released.model, [forward])[0])
        session.commit(run)
        assert len(calls) == 4 * LAYERS
    finally:
        for hook in hooks:
            hook.remove()
