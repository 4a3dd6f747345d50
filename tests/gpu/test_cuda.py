"""Checks that need a CUDA device (``-m gpu``; ``bench/gpu_check.sh`` runs them with the benchmarks). Skipped
where there is none; the CPU suite covers the same contracts in float32.

Tolerances are stated for bfloat16 (8 significand bits: one unit in the last place is 2^-7 relative, 0.0156 at
the latents' magnitude of 2 to 4): the refiner's output against diffusers' reference may differ by a few units
in the last place, because the two drive cuBLAS with differently shaped GEMMs (per-row time embedding, the
window in place instead of concatenated) and cuBLAS picks kernels by shape.
"""

from __future__ import annotations

import random

import pytest
import torch

from models import RefinerSession, SessionConfig, from_model, refine_clip, run_batch
from models.checkpoints import build_model
from models.compiled import CompiledStep, warmup_forwards

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16_MAX_ABS = 0.0625  # four units in the last place at magnitude 2..4
BF16_REL_RMS = 1e-2  # ||ours - reference|| / ||reference||


def clip(frames=13, height=8, width=8, prompt_len=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 128, frames, height, width, generator=generator)
    embeds = torch.randn(1, prompt_len, 128, generator=generator)
    return latents, embeds


def close_enough(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    got, want = got.float().cpu(), want.float().cpu()
    return (got - want).abs().max().item(), ((got - want).norm() / want.norm()).item()


@pytest.fixture(scope="module")
def medium():
    return from_model(build_model("medium"), device="cuda", dtype="bfloat16")


def test_bf16_parity_with_the_reference_refiner(medium):
    from tests.reference import reference_refine

    """The session draws its noise on its own device (``models.session``: a CUDA generator on a GPU), so the reference
    draws with a CUDA generator of the same seed too: the same Philox stream, the same noise in bf16."""
    latents, embeds = clip()
    reference_model = build_model("medium").to(device="cuda", dtype=torch.bfloat16)
    expected = reference_refine(reference_model, latents.cuda(), embeds.cuda(), generator_device="cuda")
    got = refine_clip(medium, latents, embeds)
    max_abs, rel = close_enough(got, expected)
    print(f"bf16 vs reference: max abs {max_abs:.4g}, relative rms {rel:.3g}, bit-exact {torch.equal(got, expected)}")
    assert max_abs <= BF16_MAX_ABS and rel <= BF16_REL_RMS


def steady_forwards(refiner, count: int):
    forwards = []
    for seed in range(count):
        latents, embeds = clip(frames=16, prompt_len=8 + seed, seed=seed)
        session = RefinerSession(refiner, SessionConfig(seed=seed, positions="rebased" if seed % 2 else "absolute"))
        session.push(latents[:, :, :13], embeds)
        session.append(session.check(latents[:, :, 13:]))
        forwards.append(session.next_forward(session.start(session.plan())))
    return forwards


def test_batched_rows_against_solo_rows(medium):
    """Reported: whether rows are bit-identical alone and batched on this GPU (cuBLAS picks kernels by shape);
    asserted: they agree within the bf16 tolerance."""
    forwards = steady_forwards(medium, 8)
    alone = [run_batch(medium.model, [forward])[0] for forward in forwards]
    for size in (2, 4, 8):
        order = random.Random(size).sample(range(8), size)
        stacked = run_batch(medium.model, [forwards[i] for i in order])
        worst = max(close_enough(v, alone[i])[0] for i, v in zip(order, stacked))
        identical = all(torch.equal(v, alone[i]) for i, v in zip(order, stacked))
        print(f"batch of {size}: bit-identical to solo {identical}, max abs {worst:.4g}")
        assert worst <= BF16_MAX_ABS


def test_a_block_never_waits_for_the_gpu(medium):
    """No host synchronisation between a block's start and its commit: sigmas are Python floats, inputs go
    through pinned memory, the window is written in place. The chunk is checked (its NaN scan syncs, by design:
    the service scans before submitting) and a first block of the same shape runs before the watch starts, so
    only what every steady block does is watched; every sync is listed with where it came from."""
    import warnings

    latents, embeds = clip(frames=19)
    session = RefinerSession(medium, SessionConfig())
    session.push(latents[:, :, :13], embeds)
    session.push(latents[:, :, 13:16])  # a steady block of this shape, unwatched
    chunk = session.check(latents[:, :, 16:])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session.append(chunk)
            run = session.start(session.plan())
            while (forward := session.next_forward(run)) is not None:
                session.advance(run, run_batch(medium.model, [forward])[0])
            session.commit(run)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
    assert not syncs, "host syncs inside a block:\n" + "\n".join(syncs)


def test_host_copy_from_another_device_than_the_current_one():
    """HostCopy's event goes on the tensor's device's stream: with the tensor on cuda:1 and cuda:0 current, the host
    copy is complete once ``wait`` returns."""
    from models.transfer import HostCopy

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    with torch.cuda.device(0):
        big = torch.randn(64, 1024, 1024, device="cuda:1")
        big.mul_(2)  # queued work the copy must wait for
        got = HostCopy(big).wait()
    assert torch.equal(got, big.cpu())


def test_exact_size_pinned_buffers_bypass_the_caching_host_allocator(monkeypatch):
    """A buffer of a session's size is page-locked exactly (cudaHostRegister), not rounded up to a power of two, and
    unlocked on a thread of its own once freed (not on the thread that drops it, the engine's)."""
    import threading

    import models.transfer as transfer
    from models.transfer import EXACT_PIN_BYTES, pinned_empty

    unlocked_on = []
    real_unregister = transfer._unregister
    monkeypatch.setattr(transfer, "_unregister", lambda base, pointer: unlocked_on.append(
        threading.current_thread().name) or real_unregister(base, pointer))

    nbytes = EXACT_PIN_BYTES + 4096  # just past a power of two: the caching allocator would take twice as much
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    buffer = pinned_empty((nbytes // 4,), torch.float32)
    assert buffer.is_pinned() and buffer.nbytes == nbytes
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    device = torch.randn(nbytes // 4, device="cuda")
    buffer.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffer, device.cpu())
    del buffer  # unregistered with it, on the unlocking thread
    transfer._unlocker.submit(lambda: None).result(timeout=30)
    assert len(unlocked_on) == 1 and unlocked_on[0].startswith("wm-unpin"), unlocked_on


def test_park_and_page_in_on_a_side_stream_keep_the_session_bit_exact(medium):
    """A session parked to host memory and paged in (copies on a side stream, its next forward waiting for them
    on the device) refines its next block exactly as its twin that never left the GPU."""
    from app.engine.worker import EngineSession, wait_for
    from models.move import move_session

    latents, embeds = clip(frames=19)
    twins = [RefinerSession(medium, SessionConfig()) for _ in range(2)]
    for session in twins:
        session.push(latents[:, :, :16], embeds)
    moved = EngineSession(twins[1])
    ready = move_session(twins[1], torch.device("cpu"))
    moved.ready = move_session(twins[1], torch.device("cuda"), after=ready)
    wait_for(moved)  # what the engine does before the session's next model call
    units = [session.push(latents[:, :, 16:]) for session in twins]
    assert torch.equal(units[0][-1].latents, units[1][-1].latents)


def test_a_park_staged_on_another_thread_keeps_the_session_bit_exact(medium):
    """What ``app.sessions.parking`` does: the host buffers locked on a worker thread (``stage_host``), the copies
    queued into them, the page-in back; the session refines its next block exactly as its twin that stayed."""
    import threading

    from app.engine.worker import EngineSession, wait_for
    from models.move import move_session, stage_host

    latents, embeds = clip(frames=19)
    twins = [RefinerSession(medium, SessionConfig()) for _ in range(2)]
    for session in twins:
        session.push(latents[:, :, :16], embeds)
    staged = {}
    worker = threading.Thread(target=lambda: staged.update(stage_host(twins[1], torch.device("cpu"))))
    worker.start()
    worker.join(60)
    assert staged and all(buffer.is_pinned() for buffer in staged.values())
    window = twins[1].kv.window
    moved = EngineSession(twins[1])
    ready = move_session(twins[1], torch.device("cpu"), host=staged)
    assert twins[1].kv.window is staged[id(window)]
    moved.ready = move_session(twins[1], torch.device("cuda"), after=ready)
    wait_for(moved)
    units = [session.push(latents[:, :, 16:]) for session in twins]
    assert torch.equal(units[0][-1].latents, units[1][-1].latents)


def test_an_adopted_session_built_on_the_host_comes_to_the_gpu_bit_exact(medium):
    """What an adoption does (``app.sessions.store``): the file's session built in host memory on a worker thread,
    its KV cache page-locked (``host_session``), then sent to the GPU on a side stream by the engine thread without
    a host wait; it refines its next block exactly as the session it was saved from."""
    import threading

    from app.engine.worker import EngineSession, wait_for
    from app.persistence.records import host_session
    from models.move import move_session
    from models.snapshot import session_to_tensors

    latents, embeds = clip(frames=19)
    original = RefinerSession(medium, SessionConfig())
    original.push(latents[:, :, :16], embeds)
    tensors, metadata = session_to_tensors(original)  # on the host, as a file reads them
    built = {}
    worker = threading.Thread(target=lambda: built.update(host=host_session(medium, tensors, metadata)))
    worker.start()
    worker.join(60)
    session, staged = built["host"]
    assert session.kv.window.device.type == "cpu" and session.kv.window.is_pinned()
    adopted = EngineSession(session)
    adopted.ready = move_session(session, medium.device, host=staged)
    assert session.kv.window.device == medium.device and adopted.ready is not None
    wait_for(adopted)  # what the engine does before the session's next model call
    units = [s.push(latents[:, :, 16:]) for s in (original, session)]
    assert torch.equal(units[0][-1].latents, units[1][-1].latents)


def test_a_checkpoint_copies_a_gpu_session_to_the_host_once(medium):
    """A session's tensors owned on the host (``session_to_tensors(own=True)``, what a crash checkpoint falls back
    to when no pinned memory can be locked): the move to the host is the one copy, with no clone on the host after
    it (that was a 720p session's 9.6 GiB copied twice on the engine thread), and nothing shares memory with the
    session on the device."""
    from models.snapshot import session_to_tensors
    from tests.models.test_snapshot import _CopiedBytes

    latents, embeds = clip(frames=16)
    session = RefinerSession(medium, SessionConfig())
    session.push(latents, embeds)
    with _CopiedBytes() as copied:
        owned, _ = session_to_tensors(session, own=True)
    assert all(t.device.type == "cpu" for t in owned.values())
    assert copied.bytes == sum(t.numel() * t.element_size() for t in owned.values())


def test_a_checkpoint_queues_its_copies_and_the_session_refines_on(medium):
    """What a crash checkpoint does on CUDA (``app.sessions.checkpoints``): its exact-size pinned host buffers locked
    on a worker thread (``stage_copy``), then on the engine thread ``copy_session`` only queues the copies into them
    on a side stream: no synchronising call (sync debug mode), no device-to-host copy that blocks (each goes into
    pinned memory with ``non_blocking``, into the staged buffer of its tensor). The session refines on meanwhile, its
    next forward waiting for the copies on the device as the engine makes it (``wait_for``), and its commits shift
    the history in place over what was copied; once the event passed, the copy is the session as it was, bit for
    bit, and the session's blocks are its twin's that was never checkpointed."""
    import threading
    import warnings

    from torch.utils._python_dispatch import TorchDispatchMode

    from app.engine.worker import EngineSession, wait_for
    from models.snapshot import copy_session, session_to_tensors, stage_copy

    class DeviceToHost(TorchDispatchMode):
        """Every copy from a CUDA tensor to the host: (op, into pinned memory, non_blocking asked for)."""

        def __init__(self):
            super().__init__()
            self.copies = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten.copy_.default and args[0].device.type == "cpu" and args[1].is_cuda:
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                self.copies.append(("copy_", args[0].is_pinned(), bool(non_blocking)))
            elif (func is torch.ops.aten._to_copy.default and args[0].is_cuda
                  and torch.device(kwargs.get("device") or args[0].device).type == "cpu"):
                self.copies.append(("_to_copy", False, bool(kwargs.get("non_blocking", False))))
            return func(*args, **kwargs)

    latents, embeds = clip(frames=13)
    config = SessionConfig(block_size=2, kv_max_frames=4)  # a full history of 3 frames: each commit shifts it
    twins = [RefinerSession(medium, config) for _ in range(2)]
    for session in twins:
        session.push(latents[:, :, :9], embeds)
    session = twins[1]
    before, _ = session_to_tensors(session, own=True)  # the reference, read the blocking way
    staged = {}
    worker = threading.Thread(target=lambda: staged.update(stage_copy(session)))
    worker.start()
    worker.join(60)
    assert staged and all(buffer.is_pinned() for buffer in staged.values())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, DeviceToHost() as audit:
            warnings.simplefilter("always")
            copied, _, ready = copy_session(session, host=staged)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
    assert not syncs, "host syncs while a checkpoint's copies were queued:\n" + "\n".join(syncs)
    assert len(audit.copies) == len(staged), audit.copies
    assert all(op == "copy_" and pinned and non_blocking for op, pinned, non_blocking in audit.copies), audit.copies
    assert all(copied[name].data_ptr() == buffer.data_ptr() for name, buffer in staged.items())
    assert ready is not None and copied.keys() == before.keys()

    engine_session = EngineSession(session)
    engine_session.ready = ready  # what the checkpoint leaves for the session's next work
    wait_for(engine_session)  # what the engine does before the session's next model call
    units = [twin.push(latents[:, :, 9:]) for twin in twins]  # two blocks, each commit shifting the history
    ready.synchronize()  # what the checkpoint's writer does before it reads the bytes
    assert all(torch.equal(copied[name], want) for name, want in before.items())
    after, _ = session_to_tensors(session)
    assert any(not torch.equal(after[name], before[name]) for name in before if name.startswith("history."))
    assert torch.equal(units[0][-1].latents, units[1][-1].latents)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_checkpoint_right_after_a_page_in_copies_the_paged_in_session(medium, pinned):
    """A checkpoint can come before any forward waited for a page-in (a message that only added pending frames):
    its copies wait for the page-in's event (``after``), so they read the session as it was paged in, and their
    event, which the engine then waits for in the page-in's place, covers both. Without pinned buffers
    (``stage_copy`` refused: ``HostMemoryError``) it copies into plain memory on the compute stream, which had not
    waited for the page-in's side stream (its copies would read a cache still being brought in): ``after`` is
    waited for first there too."""
    from models.move import move_session
    from models.snapshot import copy_session, session_to_tensors, stage_copy

    latents, embeds = clip(frames=9)
    session = RefinerSession(medium, SessionConfig(block_size=2, kv_max_frames=4))
    session.push(latents, embeds)
    before, _ = session_to_tensors(session, own=True)
    parked = move_session(session, torch.device("cpu"))
    paged_in = move_session(session, medium.device, after=parked)  # not waited for: the copies may be in flight
    copied, _, ready = copy_session(session, host=stage_copy(session) if pinned else None, after=paged_in)
    if pinned:
        ready.synchronize()
    else:
        assert ready is None
    assert all(torch.equal(copied[name], want) for name, want in before.items())


def test_kv_memory_is_allocated_once(medium):
    latents, embeds = clip(frames=1 + 3 * 12)
    session = RefinerSession(medium, SessionConfig())
    session.push(latents[:, :, :1], embeds)
    allocated = []
    for block in range(12):
        session.push(latents[:, :, 1 + 3 * block : 4 + 3 * block])
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert len(set(allocated[5:])) == 1, allocated


@pytest.mark.parametrize("atomic", [True, False], ids=["http_chunk", "stream_message"])
def test_a_late_non_finite_verdict_is_undone_on_cuda(atomic):
    """The engine's late verdict where it is late for real (``tests/app/outputs/test_delivery_finite.py`` runs the same
    scenario on the CPU with the deferral forced): a block poisoned with NaN is committed, its verdict read after
    the commit, the block undone; same error as a commit that reads the flag, session bit for bit as before it,
    the retry within float32 rounding of an untroubled session (cuBLAS may pick other kernels across runs)."""
    from tests.app.outputs.test_delivery_finite import _assert_same, _run_poisoned

    late = _run_poisoned(deferred=None, atomic=atomic, device="cuda")  # CUDA's default: deferred
    at_commit = _run_poisoned(deferred=False, atomic=atomic, device="cuda")
    assert late["error"] == at_commit["error"] and "NaN or Inf" in late["error"]
    _assert_same(late["before"], late["after"])
    assert (late["units"] - late["expected"]).abs().max().item() <= 1e-5
    if not atomic:
        assert (7, True) in late["handed"] and [u.frame_start for u in late["failed"].withdrawn] == [7]


def test_compiled_step_with_cuda_graphs(medium, monkeypatch):
    """Compiled with CUDA graphs: within the bf16 tolerance of eager, nothing compiled after the warm-up, and CUDA
    graphs really recorded. Reported, not asserted: how many were recorded after the warm-up (CUDA-graph trees
    record a piece on a later call than its first, by rules of their own; the warm-up's several forward kinds per
    shape should be those calls, so that no client's call pays for a recording: the GPU run says whether they are).
    Last in this file, and run alone by ``bench/gpu_check.sh``: it compiles, the slowest test here by far."""
    from torch._inductor import cudagraph_trees

    recorded = []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function

    def counting(manager, *args, **kwargs):
        recorded.append(1)
        return record(manager, *args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counting)
    torch._dynamo.reset()
    # One bucket, the 3 rows below run at (the service's warm-up compiles every bucket: tests/models/test_compiled.py
    # on the CPU): 3 shapes to compile and record instead of 12, so this test fits the loan's time.
    step = CompiledStep(medium.model, max_rows=3, mode="reduce-overhead", sizes=(3,))
    step.warm_up(warmup_forwards(medium, SessionConfig(), 8, 8, 16))
    compiled, during_warm_up = torch._dynamo.utils.counters["stats"]["unique_graphs"], len(recorded)
    forwards = steady_forwards(medium, 3)
    eager = run_batch(medium.model, forwards)
    got = step(medium.model, forwards)
    step(medium.model, forwards)
    print(f"CUDA graphs recorded: {during_warm_up} during the warm-up, {len(recorded) - during_warm_up} after")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled, "compiled again after warm-up"
    assert step.uncompiled_calls == 0, "the warmed shape ran eagerly"
    assert during_warm_up > 0, "no CUDA graph was recorded: the graphed mode ran without graphs"
    worst = max(close_enough(a, b)[0] for a, b in zip(got, eager))
    print(f"compiled (reduce-overhead) vs eager: max abs {worst:.4g}")
    assert worst <= BF16_MAX_ABS
