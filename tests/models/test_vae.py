"""Frames out: the LTX-2 video VAE decoded as a stream equals decoding the whole refined clip at once, as diffusers'
SanaWMLTX2Refiner does, whatever the chunking; its state saves and restores; bounded look-ahead trades exactness
for latency; bad VAE folders are named."""

from __future__ import annotations

import json
import random

import pytest
import torch

from models import ModelLoadError, RefinerSession, SessionConfig, from_model
from models.checkpoints import build_model, build_vae, write_vae_checkpoint
from models.vae import (
    StreamingDecoder,
    load_vae,
    new_video,
    push_video,
    video_from_tensors,
    video_tensor,
    video_to_tensors,
)

from tests.reference import reference_refine


@pytest.fixture(scope="module")
def refiner():
    return from_model(build_model("tiny"))


@pytest.fixture(scope="module", params=[False, True], ids=["non-causal", "causal"])
def decoder(request):
    return StreamingDecoder(build_vae("tiny-vae", decoder_causal=request.param))


def splits(frames: int, how: str, seed: int) -> list[int]:
    if how == "frame-by-frame":
        return [1] * frames
    rng, out, left = random.Random(seed), [], frames
    while left:
        out.append(min(left, rng.randint(1, 5)))
        left -= out[-1]
    return out


def stream_video(refiner, decoder, config, latents, embeds, sizes, lookahead=None):
    """Refine ``latents`` chunk by chunk and decode every unit as it comes: the video chunks, in order."""
    session = RefinerSession(refiner, config)
    video = new_video(decoder, drop=config.sink_frames, lookahead=lookahead)
    chunks, start = [], 0
    for i, size in enumerate(sizes):
        for unit in session.push(latents[:, :, start : start + size], embeds if i == 0 else None):
            video, chunk = push_video(decoder, video, unit.latents)
            chunks.append(chunk)
        start += size
    for unit in session.flush():
        video, chunk = push_video(decoder, video, unit.latents)
        chunks.append(chunk)
    video, chunk = push_video(decoder, video, None, final=True)
    chunks.append(chunk)
    chunks = [c for c in chunks if c.count]
    assert chunks[0].start == 0 and all(a.end == b.start for a, b in zip(chunks, chunks[1:])), "gap or overlap"
    return chunks


@pytest.mark.parametrize(
    "sink, block, frames, how",
    [(1, 3, 10, "frame-by-frame"), (1, 3, 11, "random"), (2, 2, 9, "random"), (1, 1, 6, "frame-by-frame"),
     (2, 4, 11, "random")],
)
def test_streamed_video_equals_the_reference_pipeline(refiner, decoder, sink, block, frames, how):
    generator = torch.Generator().manual_seed(frames + block)
    latents = torch.randn(1, 128, frames, 2, 3, generator=generator)
    embeds = torch.randn(1, 5, 32, generator=generator)
    config = SessionConfig(sink_frames=sink, block_size=block, kv_max_frames=sink + block + 3)
    chunks = stream_video(refiner, decoder, config, latents, embeds, splits(frames, how, seed=frames))
    expected = reference_refine(build_model("tiny"), latents, embeds, sink=sink, block=block, kv_max=config.kv_max_frames,
                                vae=decoder.vae)  # (F, 3, H, W) in [0, 1]
    frames_out = torch.cat([c.frames for c in chunks], dim=2)
    assert frames_out.shape[2] == decoder.pixel_frames(frames) - sink == expected.shape[0]
    got = video_tensor(frames_out, "float32", 1, 0, 0)[0]
    assert (got - expected).abs().max().item() <= 1e-4
    as_bytes = video_tensor(frames_out, "uint8", 1, 0, 0)[0]
    expected_bytes = (expected * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert (as_bytes.int() - expected_bytes.int()).abs().max().item() <= 1


def test_a_deep_decoder_emits_frames_mid_stream_once_their_lookahead_is_there():
    """The released decoder depth (5 resnets per stage) looks 22 latent frames ahead: pushed one latent frame at
    a time, each pixel frame comes out exactly that late, and the frames equal the whole-clip decode."""
    decoder = StreamingDecoder(build_vae("released-depth-vae"))
    assert decoder.lookahead == 22
    latents = torch.randn(1, 128, 30, 2, 2, generator=torch.Generator().manual_seed(3))
    video, chunks, emitted_after = new_video(decoder, drop=0), [], []
    for index in range(30):
        video, chunk = push_video(decoder, video, latents[:, :, index : index + 1])
        chunks.append(chunk)
        emitted_after.append(video.emitted)
    video, chunk = push_video(decoder, video, None, final=True)
    chunks.append(chunk)
    # After k latent frames, every pixel frame of the first k - 22 is out, and the stream is no further ahead
    # than the pixel frames those k latent frames can make.
    for pushed, emitted in enumerate(emitted_after, start=1):
        assert decoder.pixel_frames(max(pushed - 22, 0)) <= emitted < decoder.pixel_frames(pushed)
    assert emitted_after[21] < decoder.pixel_frames(1) <= emitted_after[22], "the first frame waits exactly 22"
    assert emitted_after[-1] >= decoder.pixel_frames(8), "frames come out mid-stream, not at the end"
    with torch.no_grad():
        whole = decoder.vae.decode(decoder.denormalize(latents), return_dict=False)[0]
    streamed = torch.cat([c.frames for c in chunks if c.count], dim=2)
    assert (streamed - whole).abs().max().item() <= 1e-4


def test_bounded_lookahead_is_exact_from_the_decoders_own_and_earlier_below_it(decoder):
    latents = torch.randn(1, 128, 12, 2, 3, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = decoder.vae.decode(decoder.denormalize(latents), return_dict=False)[0][:, :, 1:]
    for lookahead in (0, 2, decoder.lookahead, decoder.lookahead + 2):
        video, chunks, first_out = new_video(decoder, drop=1, lookahead=lookahead), [], None
        for index in range(12):
            video, chunk = push_video(decoder, video, latents[:, :, index : index + 1])
            chunks.append(chunk)
            if chunk.count and first_out is None:
                first_out = index
        video, chunk = push_video(decoder, video, None, final=True)
        got = torch.cat([c.frames for c in chunks + [chunk] if c.count], dim=2)
        assert got.shape == whole.shape
        error = (got - whole).abs().max().item()
        if lookahead >= decoder.lookahead:
            assert error <= 1e-4, lookahead
        elif not decoder.causal:
            assert error > 1e-3, "a shorter look-ahead cannot be exact for a non-causal decoder"
        # Latent frame 0 decodes to one pixel frame, dropped here (drop=1): the first video frames are latent
        # frame 1's, due once N more latent frames are in, whatever the decoder itself would wait for.
        assert first_out == (lookahead + 1 if lookahead + 1 < 12 else None), (lookahead, first_out)


def test_the_state_saves_and_restores_bit_identically(decoder):
    latents = torch.randn(1, 128, 10, 2, 3, generator=torch.Generator().manual_seed(6))
    for lookahead in (None, 1):
        video = new_video(decoder, drop=2, lookahead=lookahead)
        video, _ = push_video(decoder, video, latents[:, :, :4])
        tensors, fields = video_to_tensors(video)
        restored = video_from_tensors(decoder, tensors, json.loads(json.dumps(fields)))
        assert restored.nbytes == video.nbytes
        outputs = []
        for start in (video, restored):
            chunk_a = push_video(decoder, start, latents[:, :, 4:])
            chunk_b = push_video(decoder, chunk_a[0], None, final=True)
            outputs.append([c.frames for c in (chunk_a[1], chunk_b[1]) if c.count])
        assert all(torch.equal(a, b) for a, b in zip(*outputs)) and len(outputs[0]) == len(outputs[1])


def test_load_vae_and_its_errors(tmp_path):
    folder = write_vae_checkpoint(tmp_path / "vae")
    vae = load_vae(folder, torch.device("cpu"), torch.float32, latent_channels=128)
    info = StreamingDecoder(vae).info
    assert (info.latent_channels, info.spatial_compression, info.temporal_compression) == (128, 32, 8)
    with pytest.raises(ModelLoadError, match="latent_channels=128 but the refiner produces 64"):
        load_vae(folder, torch.device("cpu"), torch.float32, latent_channels=64)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_vae(tmp_path / "nothing", torch.device("cpu"), torch.float32)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(ModelLoadError, match="AutoencoderKLLTX2Video"):
        load_vae(tmp_path / "other", torch.device("cpu"), torch.float32)


def test_decoders_the_reference_cannot_run_are_refused():
    with pytest.raises(ModelLoadError, match="timestep_conditioning"):
        StreamingDecoder(build_vae("tiny-vae", timestep_conditioning=True))
    with pytest.raises(ModelLoadError, match="injects noise"):
        StreamingDecoder(build_vae("tiny-vae", decoder_inject_noise=True))
