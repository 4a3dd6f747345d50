"""The client's bookkeeping without a server: what a stream resends after a reconnect, how units that straddle
what the caller has are trimmed, the payload codec, the retry waits."""

from __future__ import annotations

import struct

import numpy as np

import pytest
import torch
from safetensors.torch import load

from wm_refiner_client import Chunk, ProtocolError, RetryPolicy, Unit
from wm_refiner_client.resume import ChunkSource, UnitTracker, frames_before_flush
from wm_refiner_client.units import decode, encode

from .conftest import clip

LATENTS, PROMPT, MASK = clip(10)


def payload_frames(payload: bytes) -> tuple[int, bool]:
    tensors = load(payload)
    return int(tensors["latents"].shape[2]), "prompt_embeds" in tensors


def test_the_first_message_carries_the_prompt_and_a_rewind_resends_exactly_the_rest():
    source = ChunkSource(PROMPT, MASK)
    sent = [source.add(LATENTS[:, :, a:b]) for a, b in ((0, 4), (4, 7), (7, 10))]
    assert [payload_frames(p) for p in sent] == [(4, True), (3, False), (3, False)]
    source.rewind(4)  # the server got the first message only
    resent = [source.next_resend(), source.next_resend(), source.next_resend()]
    assert [payload_frames(p) for p in resent[:2]] == [(3, False), (3, False)] and resent[2] is None
    assert np.array_equal(load(resent[0])["latents"].numpy(), LATENTS[:, :, 4:7])
    source.rewind(0)  # nothing arrived: the first message again, with its prompt
    assert payload_frames(source.next_resend()) == (4, True)
    source.rewind(5)  # inside a message (never from the server, but handled): the rest of it, no prompt
    first = source.next_resend()
    assert payload_frames(first) == (2, False)
    assert np.array_equal(load(first)["latents"].numpy(), LATENTS[:, :, 5:7])


def test_a_prompt_switch_is_resent_with_its_frames_and_confirmed_frames_are_dropped():
    other = clip(seed=3)[1]
    source = ChunkSource()
    source.add(Chunk(LATENTS[:, :, :4], PROMPT, MASK))
    source.add({"latents": LATENTS[:, :, 4:8], "prompt": other})
    source.confirm(4)
    assert source.kept_frames == 4
    source.rewind(4)
    resent = load(source.next_resend())
    assert torch.equal(resent["prompt_embeds"], torch.from_numpy(other))
    with pytest.raises(ProtocolError):
        source.rewind(2)  # before frames already confirmed: the server lost what it had returned
    with pytest.raises(ProtocolError):
        source.rewind(9)  # more than was sent: someone else is sending to the session
    assert source.add(LATENTS[:, :, :0]) is None  # an empty chunk sends nothing
    with pytest.raises(ValueError):
        source.add(LATENTS[0])  # (C, t, H, W): the batch axis is missing


def unit(start, end, video=None):
    latents = np.arange(end - start, dtype=np.float32).reshape(1, 1, end - start, 1, 1) + start
    fields = {}
    if video is not None:
        v0, v1 = video
        fields = dict(video=np.arange(v1 - v0, dtype=np.uint8).reshape(1, v1 - v0, 1, 1, 1) + v0,
                      video_frame_start=v0, video_frame_end=v1)
    return Unit(start, end, latents, **fields)


def test_units_resent_after_a_reconnect_are_trimmed_to_what_the_caller_lacks():
    tracker = UnitTracker()
    assert tracker.accept(unit(0, 1, (0, 0))).frames == 1
    assert tracker.accept(unit(1, 4, (0, 9))).video_frames == 9
    assert tracker.accept(unit(1, 4, (0, 9))) is None  # a whole duplicate
    straddling = tracker.accept(unit(2, 7, (5, 33)))  # latent frames 2, 3 and pixel frames 5..8 already held
    assert (straddling.frame_start, straddling.frame_end) == (4, 7)
    assert straddling.latents[0, 0, :, 0, 0].tolist() == [4, 5, 6]
    assert (straddling.video_frame_start, straddling.video_frames) == (9, 24) and straddling.video[0, 0, 0, 0, 0] == 9
    tail = tracker.accept(unit(7, 7, (33, 40)))  # a flush's video tail: no latent frames, new pixel frames
    assert tail is not None and tail.video_frames == 7
    with pytest.raises(ProtocolError):
        tracker.accept(unit(8, 10))  # frame 7 would be skipped
    assert (tracker.frames, tracker.video_frames) == (7, 40)


def test_the_flush_waits_for_the_full_blocks():
    config = {"sink_frames": 1, "block_size": 3}
    assert [frames_before_flush(n, config) for n in (0, 1, 3, 4, 6, 7, 10, 11)] == [0, 1, 1, 4, 4, 7, 10, 10]
    assert frames_before_flush(10, {}) == 0  # unknown config: nothing to wait for


def test_payloads_take_numpy_torch_and_bfloat16():
    as_numpy = encode({"latents": LATENTS, "prompt_embeds": PROMPT, "prompt_attention_mask": None})
    mixed = encode({"latents": torch.from_numpy(LATENTS), "prompt_embeds": PROMPT})
    assert as_numpy == mixed  # the same bytes whichever library the arrays come from
    assert set(decode(as_numpy)) == {"latents", "prompt_embeds"}
    bf16 = encode({"latents": torch.from_numpy(LATENTS).to(torch.bfloat16)})
    assert decode(bf16, "pt")["latents"].dtype == torch.bfloat16
    # numpy has no bfloat16: a bfloat16 response (response_dtype: model) comes back as float32, the same values.
    widened = decode(bf16, "np")["latents"]
    assert widened.dtype == np.float32 and widened.shape == LATENTS.shape
    assert np.array_equal(widened, torch.from_numpy(LATENTS).to(torch.bfloat16).float().numpy())
    # Bytes that are no safetensors file are one ValueError on the numpy path, whatever the bfloat16 fallback
    # makes of them (too short for a header, not JSON, JSON that is no object).
    for junk in (b"", b"\x01", b"not safetensors at all", struct.pack("<Q", 2) + b"[]", struct.pack("<Q", 1) + b"5"):
        with pytest.raises(ValueError, match="cannot be read as numpy"):
            decode(junk, "np")


def test_retry_waits_grow_are_capped_and_honour_retry_after():
    policy = RetryPolicy(attempts=5, backoff_s=0.5, max_backoff_s=3.0, max_retry_after_s=10.0)
    assert [policy.delay(n, jitter=1.0) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.delay(1, jitter=0.5) == 0.25
    assert policy.delay(1, retry_after=4.0, jitter=1.0) == 4.0
    assert policy.delay(1, retry_after=60.0, jitter=1.0) == 10.0
    assert all(0.25 <= policy.delay(1) <= 0.5 for _ in range(50))
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
