"""Session behaviour: fail-closed blocks, bounded cache, input validation, prompts, flush."""

from __future__ import annotations

import pytest
import torch

from models import (
    InvalidConfigError,
    InvalidInputError,
    MissingInputError,
    RefinerSession,
    SessionConfig,
    StreamClosedError,
    from_model,
)
from models.checkpoints import build_model

from tests.reference import assert_parity, reference_refine

from .conftest import make_inputs


class InjectedFault(RuntimeError):
    pass


def fail_on_call(module: torch.nn.Module, call: int):
    """Make ``module``'s ``call``-th forward (1-based) raise, like an out-of-memory error would."""
    calls = {"n": 0}

    def hook(mod, args, kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise InjectedFault(f"injected fault on forward {call}")

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def snapshot(session: RefinerSession):
    """Everything a later block reads: counters, pending frames, generator, and the cache's live contents."""
    state = session.state
    kv = session.kv
    cache = None
    if kv is not None and kv.has_sink:
        cache = {name: [t.clone() for t in parts] for name, parts in kv.export().items()}
    return (state.frames_received, state.frames_returned, state.history_frames, state.blocks_refined,
            session.cache_bytes, None if state.pending is None else state.pending.clone(), state.rng_state.clone(),
            cache)


def assert_same(a, b):
    assert a[:5] == b[:5]
    assert (a[5] is None and b[5] is None) or torch.equal(a[5], b[5])
    assert torch.equal(a[6], b[6])
    assert (a[7] is None) == (b[7] is None)
    if a[7] is not None:
        for name in a[7]:
            assert all(torch.equal(x, y) for x, y in zip(a[7][name], b[7][name])), f"cache part {name} changed"


@pytest.mark.parametrize("failing_call", [1, 2, 4, 6, 8])
def test_failure_mid_block_changes_nothing_and_retry_is_bit_identical(failing_call):
    """The failing push holds two blocks of 3 denoising forwards + 1 commit forward each: forward 4 is the first
    block's commit, 6 and 8 fail the second block after the first one was computed."""
    latents, embeds = make_inputs(frames=10, seed=4)
    refiner = from_model(build_model("tiny"))
    uninterrupted = RefinerSession(refiner, SessionConfig())
    expected = uninterrupted.push(latents[:, :, :4], embeds) + uninterrupted.push(latents[:, :, 4:10])

    session = RefinerSession(refiner, SessionConfig())
    got = session.push(latents[:, :, :4], embeds)
    before = snapshot(session)
    handle = fail_on_call(refiner.model.transformer_blocks[1], failing_call)
    try:
        with pytest.raises(InjectedFault):
            session.push(latents[:, :, 4:10])
    finally:
        handle.remove()
    assert_same(snapshot(session), before)
    got += session.push(latents[:, :, 4:10])
    assert [(u.frame_start, u.frame_end) for u in got] == [(u.frame_start, u.frame_end) for u in expected]
    for a, b in zip(got, expected):
        assert torch.equal(a.latents, b.latents)


def test_stream_keeps_committed_blocks_and_retries_the_failed_one():
    """Block-level form (used by a WebSocket): earlier blocks stay, the failed block's frames stay pending."""
    latents, embeds = make_inputs(frames=10, seed=5)
    refiner = from_model(build_model("tiny"))
    expected = RefinerSession(refiner, SessionConfig()).push(latents, embeds)
    session = RefinerSession(refiner, SessionConfig())
    got = []
    handle = fail_on_call(refiner.model.transformer_blocks[0], 1 + 4 + 2)  # inside the second block
    try:
        with pytest.raises(InjectedFault):
            for unit in session.stream(latents, embeds):
                got.append(unit)
    finally:
        handle.remove()
    assert [u.frame_end for u in got] == [1, 4]
    assert session.state.frames_returned == 4 and session.state.pending_frames == 6
    while (unit := session.step()) is not None:
        got.append(unit)
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(got, expected)) and len(got) == len(expected)


def test_cache_is_allocated_once_and_stays_bounded():
    """The window buffers are allocated with the sink and never again: 200 blocks later the session holds the
    same storage, and the live cache (sink + history) is exactly the formula once the window is full."""
    refiner = from_model(build_model("tiny"))
    config = SessionConfig()
    latents, embeds = make_inputs(frames=config.sink_frames + 200 * config.block_size, height=2, width=2, seed=6)
    session = RefinerSession(refiner, config)
    session.push(latents[:, :, :1], embeds)
    buffers = session.kv.window.untyped_storage().data_ptr()
    allocated, live = [], []
    for block in range(200):
        start = 1 + block * config.block_size
        session.push(latents[:, :, start : start + config.block_size])
        allocated.append(session.cache_bytes)
        live.append(session.kv.live_bytes)
        assert session.kv.window.untyped_storage().data_ptr() == buffers, "the window was reallocated"
    info, tokens, element = refiner.info, 2 * 2, 4
    window = info.num_layers * 2 * (config.kv_max_frames + config.block_size) * tokens * info.inner_dim * element
    sink_keys = info.num_layers * config.sink_frames * tokens * info.inner_dim * element
    assert set(allocated) == {window + sink_keys}
    formula = 2 * info.num_layers * config.kv_max_frames * tokens * info.inner_dim * element
    window_full = (config.kv_max_frames - config.sink_frames) // config.block_size + 1
    assert live[: window_full - 1] == sorted(live[: window_full - 1]) and live[0] < formula
    assert set(live[window_full:]) == {formula}
    assert session.state.history_frames == config.kv_max_frames - config.sink_frames
    assert session.state.pending is None


def test_new_prompt_applies_to_blocks_refined_after_it():
    refiner = from_model(build_model("tiny"))
    latents, embeds = make_inputs(frames=7, seed=7)
    other = torch.randn_like(embeds)
    session = RefinerSession(refiner, SessionConfig())
    first = session.push(latents[:, :, :4], embeds)
    second = session.push(latents[:, :, 4:7], other)
    same_prompt = RefinerSession(refiner, SessionConfig()).push(latents, embeds)
    assert torch.equal(first[1].latents, same_prompt[1].latents)
    assert not torch.equal(second[0].latents, same_prompt[2].latents)


def test_flush_semantics():
    refiner = from_model(build_model("tiny"))
    latents, embeds = make_inputs(frames=6, seed=8)
    only_sink = RefinerSession(refiner, SessionConfig(sink_frames=2))
    units = only_sink.push(latents[:, :, :2], embeds, flush=True)
    assert [(u.kind, u.frame_start, u.frame_end) for u in units] == [("sink", 0, 2)]
    too_short = RefinerSession(refiner, SessionConfig(sink_frames=2))
    units = too_short.push(latents[:, :, :1], embeds, flush=True)
    assert [(u.kind, u.frame_end) for u in units] == [("sink", 1)] and torch.equal(units[0].latents, latents[:, :, :1])
    session = RefinerSession(refiner, SessionConfig())
    units = session.push(latents[:, :, :5], embeds)
    final = session.flush()
    assert [(u.frame_start, u.frame_end) for u in final] == [(4, 5)]
    with pytest.raises(StreamClosedError):
        session.push(latents[:, :, 5:6])
    expected = reference_refine(build_model("tiny"), latents[:, :, :5], embeds)
    assert_parity(torch.cat([u.latents for u in units + final], dim=2), expected, "flushed short tail")



@pytest.mark.parametrize("fps", [0.001, 1000.0])
def test_the_fps_bounds_refine_like_the_reference(fps):
    """Every fps the config accepts refines finitely and within parity: below 0.001 the float32 RoPE time positions
    overflow (every block NaN, reported as if the input were at fault), so the config refuses it."""
    refiner = from_model(build_model("tiny"))
    latents, embeds = make_inputs(frames=7)
    session = RefinerSession(refiner, SessionConfig(fps=fps))
    units = session.push(latents, embeds, flush=True)
    got = torch.cat([u.latents for u in units], dim=2)
    assert torch.isfinite(got).all()
    assert_parity(got, reference_refine(build_model("tiny"), latents, embeds, fps=fps), f"fps={fps}")
    with pytest.raises(InvalidConfigError, match=r"fps must be in \[0.001, 1000\]"):
        SessionConfig(fps=fps * (1 - 1e-9) if fps < 1 else fps * (1 + 1e-9))


BAD_CHUNKS = [
    ("rank", lambda lat, emb: (lat[0], emb), InvalidInputError, "rank 5"),
    ("channels", lambda lat, emb: (lat[:, :64], emb), InvalidInputError, "channels"),
    ("dtype", lambda lat, emb: (lat.to(torch.int32), emb), InvalidInputError, "dtype"),
    ("float64", lambda lat, emb: (lat.double(), emb), InvalidInputError, "float32, float16, bfloat16"),
    ("nan", lambda lat, emb: (lat.clone().index_fill_(2, torch.tensor([1]), float("nan")), emb), InvalidInputError,
     "NaN"),
    ("inf-prompt", lambda lat, emb: (lat, emb.clone().fill_(float("inf"))), InvalidInputError, "prompt_embeds"),
    ("prompt-width", lambda lat, emb: (lat, emb[:, :, :16]), InvalidInputError, "prompt_embeds"),
    ("prompt-batch", lambda lat, emb: (lat, emb.repeat(2, 1, 1)), InvalidInputError, "B=1"),
    ("no-prompt", lambda lat, emb: (lat, None), MissingInputError, "prompt_embeds"),
    ("no-latents", lambda lat, emb: (None, emb), MissingInputError, "latents"),
]


@pytest.mark.parametrize("case", BAD_CHUNKS, ids=[c[0] for c in BAD_CHUNKS])
def test_bad_first_chunk_is_rejected_and_changes_nothing(case, tiny_refiner):
    _, mutate, error, fragment = case
    latents, embeds = make_inputs(frames=4)
    session = RefinerSession(tiny_refiner, SessionConfig())
    with pytest.raises(error, match=fragment):
        session.push(*mutate(latents, embeds))
    assert session.state.frames_received == 0 and session.state.geometry is None
    assert len(session.push(latents, embeds)) == 2


def test_later_chunk_must_match_geometry(tiny_refiner):
    latents, embeds = make_inputs(frames=4)
    session = RefinerSession(tiny_refiner, SessionConfig())
    session.push(latents, embeds)
    before = snapshot(session)
    for bad in (torch.randn(1, 128, 2, 5, 3), torch.randn(2, 128, 2, 4, 3)):
        with pytest.raises(InvalidInputError, match="do not match"):
            session.push(bad)
    mask = torch.ones(1, 3)
    with pytest.raises(InvalidInputError, match="prompt_attention_mask"):
        session.push(latents[:, :, :1], embeds, mask)
    assert_same(snapshot(session), before)


@pytest.mark.parametrize(
    "fields, fragment",
    [
        (dict(kv_max_frames=3), "kv_max_frames must be >= sink_frames \\+ block_size = 4"),
        (dict(sink_frames=0), "sink_frames must be >= 1"),
        (dict(block_size=-2), "block_size must be >= 1"),
        (dict(sigmas=(0.9,)), "at least 2"),
        (dict(sigmas=(0.5, 0.7, 0.0)), "strictly decreasing"),
        (dict(sigmas=(0.9, 0.5)), "end in 0.0"),
        (dict(sigmas=(1.5, 0.0)), "within \\[0, 1\\]"),
        (dict(positions="relative"), "'absolute' or 'rebased'"),
        (dict(fps=0), "fps"),
        (dict(seed=-1), "seed"),
        (dict(block_size=2.5), "integer"),
        (dict(sink_frames=10**9, kv_max_frames=10**9 + 3), "sink_frames"),
    ],
)
def test_invalid_config(fields, fragment):
    with pytest.raises(InvalidConfigError, match=fragment):
        SessionConfig(**fields)


def test_config_from_dict_rejects_unknown_fields():
    assert SessionConfig.from_dict({"block_size": 2, "sigmas": [0.5, 0.0]}).sigmas == (0.5, 0.0)
    with pytest.raises(InvalidConfigError, match="blocksize"):
        SessionConfig.from_dict({"blocksize": 2})


@pytest.mark.parametrize("where", ["latents", "prompt"])
def test_a_chunk_that_refines_to_non_finite_values_is_refused_and_the_session_is_unchanged(where):
    from models import RefinerSession, SessionConfig, from_model
    from models.checkpoints import build_model
    from models.errors import NonFiniteOutputError

    refiner = from_model(build_model("tiny"))
    config = SessionConfig(block_size=2, kv_max_frames=5)
    latents, embeds = make_inputs(frames=9, seed=3)
    uninterrupted = RefinerSession(refiner, config).push(latents, embeds, flush=True)

    session = RefinerSession(refiner, config)
    first = session.push(latents[:, :, :3], embeds)  # sink and one block
    before = session.state
    poisoned_latents, poisoned_embeds = latents[:, :, 3:6].clone(), embeds.clone()
    if where == "latents":
        poisoned_latents[:, :, :, 0, 0] = 3e38  # finite, and near float32's limit
    else:
        poisoned_embeds[:, 0, 0] = 3e38
    with pytest.raises(NonFiniteOutputError, match="NaN or Inf.*send latents and prompt_embeds"):
        session.push(poisoned_latents, poisoned_embeds)
    after = session.state
    assert (after.frames_received, after.frames_returned, after.history_frames, after.blocks_refined) == (
        before.frames_received, before.frames_returned, before.history_frames, before.blocks_refined)
    rest = session.push(latents[:, :, 3:], flush=True)  # a retry with sane input continues as if nothing happened
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(first + rest, uninterrupted))


def test_a_prompt_too_large_that_came_before_its_block_is_named_and_a_new_prompt_with_the_frames_recovers():
    """A prompt switch with too few frames to finish a block is taken (nothing is refined yet); the block that
    then refines to Inf fails, and so would every retry of its frames alone, the prompt being still in effect: the
    error says so, and the same frames sent again with a sane prompt continue the session."""
    from models import RefinerSession, SessionConfig, from_model
    from models.checkpoints import build_model
    from models.errors import NonFiniteOutputError

    refiner = from_model(build_model("tiny"))
    config = SessionConfig(block_size=2, kv_max_frames=5)
    latents, embeds = make_inputs(frames=7, seed=4)
    session = RefinerSession(refiner, config)
    session.push(latents[:, :, :3], embeds)  # sink and one block
    assert session.push(latents[:, :, 3:4], torch.full_like(embeds, 3e38)) == []  # half a block: nothing to refine
    for _ in range(2):  # the retry of the frames alone fails the same way: the prompt is still in effect
        with pytest.raises(NonFiniteOutputError, match="prompt_embeds in effect may have come with an earlier chunk"):
            session.push(latents[:, :, 4:5])
    units = session.push(latents[:, :, 4:5], embeds)
    assert [(u.frame_start, u.frame_end) for u in units] == [(3, 5)]
    assert torch.isfinite(units[0].latents).all()


@pytest.mark.parametrize("deferred", [False, True], ids=["read_at_commit", "read_late"])
def test_push_undoes_a_chunk_whose_second_block_is_poisoned_with_a_full_history(deferred):
    """All or nothing when the chunk's first block committed and pushed history out, on both paths of the finite
    check: read at commit (a CPU), and read after the commit (``defer_finite_check``, an accelerator's path, where
    the step's own checkpoint sits inside the chunk's and both saved the frames pushed out)."""
    from models import RefinerSession, SessionConfig, from_model
    from models.checkpoints import build_model
    from models.errors import NonFiniteOutputError

    refiner = from_model(build_model("tiny"))
    config = SessionConfig(block_size=2, kv_max_frames=7)  # 6 history frames: full after the first push
    latents, embeds = make_inputs(frames=13, seed=5)
    uninterrupted = RefinerSession(refiner, config).push(latents, embeds, flush=True)
    session = RefinerSession(refiner, config)
    session.defer_finite_check = deferred
    first = session.push(latents[:, :, :7], embeds)  # the sink and three blocks
    before = session.state, [t.clone() for parts in session.kv.export().values() for t in parts]
    poisoned = latents[:, :, 7:11].clone()
    poisoned[:, :, 2:, 0, 0] = 3e38  # the chunk's second block only
    with pytest.raises(NonFiniteOutputError, match="frames \\[9, 11\\)"):
        session.push(poisoned)
    assert session.state == before[0]
    after = [t for parts in session.kv.export().values() for t in parts]
    assert all(torch.equal(a, b) for a, b in zip(before[1], after, strict=True))
    rest = session.push(latents[:, :, 7:], flush=True)
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(first + rest, uninterrupted, strict=True))


def test_a_poisoned_sink_is_not_kept():
    from models import RefinerSession, SessionConfig, from_model
    from models.checkpoints import build_model
    from models.errors import NonFiniteOutputError

    refiner = from_model(build_model("tiny"))
    latents, embeds = make_inputs(frames=4, seed=4)
    session = RefinerSession(refiner, SessionConfig(block_size=3))
    poisoned = latents.clone()
    poisoned[:, :, 0] = 3e38
    with pytest.raises(NonFiniteOutputError, match="sink"):
        session.push(poisoned, embeds)
    assert not session.state.has_sink and session.state.frames_received == 0
    units = session.push(latents, embeds, flush=True)
    assert all(bool(torch.isfinite(u.latents).all()) for u in units)


def test_a_float32_twin_of_a_bfloat16_run_draws_its_noise():
    # bench.gpu's bf16-vs-fp32 parity compares arithmetic only if both runs see the same noise; from one seed a CPU
    # draws other bfloat16 than float32 values past a size that depends on the torch release (torch 2.11: past the
    # 15th value; the parity figure then read 1.27 where 0.01 is arithmetic). noise_dtype makes the twin draw bf16's.
    import copy

    model = build_model("tiny")
    high = from_model(model)
    low = from_model(copy.deepcopy(model).to(torch.bfloat16), dtype="bfloat16")
    config = SessionConfig()
    latents, embeds = make_inputs(frames=config.sink_frames + config.block_size, height=8, width=8)
    latents = latents.to(torch.bfloat16).float()  # frames both runs hold exactly

    def first_block(refiner, noise_dtype=None):
        session = RefinerSession(refiner, config)
        session.noise_dtype = noise_dtype
        session.push(latents[:, :, : config.sink_frames], embeds)  # the sink, refined at once
        session.append(session.check(latents[:, :, config.sink_frames :].to(refiner.dtype)))
        return session.start(session.plan()).x

    low_x, twin_x = first_block(low), first_block(high, torch.bfloat16)
    assert low_x.dtype == torch.bfloat16 and twin_x.dtype == torch.float32
    assert torch.equal(twin_x.to(torch.bfloat16), low_x)  # the same noise; only bf16's rounding of x differs
    generator = torch.Generator().manual_seed(config.seed)
    bf16 = torch.randn(low_x.shape, generator=generator, dtype=torch.bfloat16).float()
    generator = torch.Generator().manual_seed(config.seed)
    fp32 = torch.randn(low_x.shape, generator=generator)
    if not torch.allclose(bf16, fp32, atol=0.01):  # where this torch draws apart, the default does not match
        assert not torch.equal(first_block(high).to(torch.bfloat16), low_x)


@pytest.mark.parametrize("deferred", [False, True], ids=["cpu-check", "deferred-check"])
def test_a_forward_frees_its_window_and_rope_tables_without_the_cyclic_collector(tiny_refiner, monkeypatch, deferred):
    """Every forward's cache view (``models.attention.ForwardWindow``, its rows and their RoPE tables) is freed by
    reference counting as soon as the forward is done. Its layers once held the window back (a cycle): on an H200
    the device memory grew by a block's tables each block until a collection ran (tests/gpu/test_cuda.py)."""
    import gc
    import weakref

    import models.step as step_module

    made = []
    real = step_module.build_window

    def recording(forwards, num_layers):
        window = real(forwards, num_layers)
        made.append((weakref.ref(window), [weakref.ref(t) for row in window.rows for t in row.tables]))
        return window

    monkeypatch.setattr(step_module, "build_window", recording)
    latents, embeds = make_inputs(frames=10)
    session = RefinerSession(tiny_refiner, SessionConfig())
    session.defer_finite_check = deferred
    collecting = gc.isenabled()
    gc.disable()
    try:
        units = session.push(latents, embeds)
        assert len(units) == 4 and len(made) == 1 + 3 * (session.config.steps + 1)  # the sink, 3 blocks
        alive = [i for i, (window, tables) in enumerate(made) if window() is not None or any(t() for t in tables)]
        assert not alive, f"forwards {alive} of {len(made)} still held after the push"
    finally:
        if collecting:
            gc.enable()
