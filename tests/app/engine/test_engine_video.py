"""The engine's decode steps: a session with video gets each committed unit back with its pixel frames, decoded
between model calls (its next block does not wait for the decode), also when later work fails, and the video is
the whole-clip decode of the refined latents."""

from __future__ import annotations

import pytest
import torch

from app.engine.worker import Work
from models.checkpoints import build_vae
from app.outputs.kinds import Outputs
from app.outputs.catalog import build_stages
from models.vae import StreamingDecoder
from tests.faults import failing_forwards

from tests.app.conftest import expected_clip, make_clip
from tests.app.engine.test_engine import Recorder, run_with_engine, target


@pytest.fixture(scope="module")
def decoder():
    return StreamingDecoder(build_vae("tiny-vae"))


def whole_clip_video(decoder, latents: torch.Tensor, drop: int) -> torch.Tensor:
    """The refined clip decoded at once (B, 3, F, H, W) in [-1, 1], the first ``drop`` pixel frames dropped."""
    with torch.no_grad():
        return decoder.vae.decode(decoder.denormalize(latents), return_dict=False)[0][:, :, drop:]


def video_target(refiner, decoder, name, **config):
    engine_session = target(refiner, name, **config)
    engine_session.stages = build_stages(decoder=decoder).for_session(Outputs(("latents", "video")),
                                                                      engine_session.session.config)
    return engine_session


def test_decode_steps_run_between_model_calls_and_units_carry_their_frames(refiner, decoder):
    latents, embeds, mask = make_clip(frames=11, seed=11)
    expected = expected_clip(refiner, latents, embeds, mask)
    events: list[str] = []

    async def scenario(engine):
        recorder = Recorder(refiner.model)
        original = engine.output_step

        def output_step():
            events.append(f"decode {len(recorder.calls)}")
            original()

        engine.output_step = output_step
        try:
            video = recorder.name(video_target(refiner, decoder, "video"))
            plain = recorder.name(target(refiner, "plain"))
            units = []
            jobs = [engine.submit(Work(video, latents, embeds, mask, flush=True, on_unit=units.append)),
                    engine.submit(Work(plain, latents, embeds, mask, flush=True))]
            results = [await job for job in jobs]
        finally:
            recorder.close()
        return units, results, recorder.calls

    units, results, calls = run_with_engine(refiner, scenario)
    # Every unit of the video session came back with its frames, in order, after its decode.
    assert [u.frame_end for u in units] == [1, 4, 7, 10, 11] and all(u.payloads["video"] is not None for u in units)
    assert [u.frame_end for u in results[0].units] == [1, 4, 7, 10, 11]
    assert torch.equal(torch.cat([u.latents for u in units], dim=2), expected)
    assert torch.equal(torch.cat([u.latents for u in results[1].units], dim=2), expected)
    frames = torch.cat([u.payloads["video"].frames for u in units if u.payloads["video"].frames is not None], dim=2)
    starts = [u.payloads["video"].start for u in units]
    assert starts == sorted(starts) and starts[0] == 0
    assert frames.shape[2] == 8 * 10 + 1 - 1 == results[0].positions["video"]
    assert (frames - whole_clip_video(decoder, expected, 1)).abs().max().item() <= 1e-4
    # Decode steps were interleaved with the model calls (not one after the whole clip), and the two sessions
    # kept sharing model calls meanwhile.
    positions = [int(e.split()[1]) for e in events]
    assert len(positions) == 5 and positions[0] < len(calls) // 2
    assert sum(1 for call in calls if sorted(call) == ["plain", "video"]) >= 6


def test_a_failing_stream_message_still_delivers_its_committed_units_with_video(refiner, decoder):
    """Non-atomic work whose third block fails: the two blocks it committed go out with their pixel frames; the
    next message (the flush) retries the block and finishes the video, equal to the whole-clip decode."""
    latents, embeds, mask = make_clip(frames=8, seed=12)
    expected = expected_clip(refiner, latents, embeds, mask)

    async def scenario(engine):
        stream = video_target(refiner, decoder, "stream")
        units = []
        with failing_forwards(refiner.model, stream.session, when=lambda n: n == 7):  # inside block [4, 7)
            with pytest.raises(RuntimeError):
                await engine.submit(Work(stream, latents, embeds, mask, on_unit=units.append))
        assert [u.frame_end for u in units] == [1, 4] and all(u.payloads["video"] is not None for u in units)
        await engine.submit(Work(stream, None, flush=True, on_unit=units.append))
        return units

    units = run_with_engine(refiner, scenario)
    assert [u.frame_end for u in units] == [1, 4, 7, 8]
    assert torch.equal(torch.cat([u.latents for u in units], dim=2), expected)
    frames = torch.cat([u.payloads["video"].frames for u in units if u.payloads["video"].frames is not None], dim=2)
    assert (frames - whole_clip_video(decoder, expected, 1)).abs().max().item() <= 1e-4
