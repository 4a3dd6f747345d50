"""Output stages alone (app.outputs.stage), without an engine: the latents and video stages through one interface, their
rollback point, their snapshot round trip, their wire format, and a failing stage that changes nothing."""

from __future__ import annotations

import pytest
import torch

from app.outputs.kinds import HostUnit, Outputs, payload
from app.outputs.catalog import build_stages, describe
from app.outputs.stage import OutputFailure, OutputStage, SessionStages, StageUnavailable
from models import SessionConfig
from models.checkpoints import build_vae
from models.session import Unit
from models.vae import StreamingDecoder, new_video, push_video

CONFIG = SessionConfig(block_size=3)


@pytest.fixture(scope="module")
def stages():
    return build_stages(decoder=StreamingDecoder(build_vae("tiny-vae")))


def units(frames=(1, 4, 7)) -> list[Unit]:
    generator = torch.Generator().manual_seed(5)
    latents = torch.randn(1, 128, frames[-1], 2, 2, generator=generator)
    bounds = list(zip((0, *frames[:-1]), frames))
    return [Unit("sink" if start == 0 else "block", latents[:, :, start:end], start, end) for start, end in bounds]


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def test_video_is_unavailable_without_a_vae_and_says_why():
    plain = build_stages()
    assert list(plain.by_kind) == ["latents"]
    with pytest.raises(StageUnavailable, match="no VAE"):
        plain.for_session(Outputs(("latents", "video")), CONFIG)


def test_the_video_stage_decodes_as_the_vae_stream_does_and_carries_its_payload_beside_the_unit(stages):
    session = stages.for_session(Outputs(("latents", "video")), CONFIG)
    assert session.kinds == ("latents", "video") and session.deferred and not session.done
    decoder = stages["video"].decoder
    video, chunks = new_video(decoder, drop=CONFIG.sink_frames), []
    for unit in units():
        out = session.push(unit, final=False)
        video, chunk = push_video(decoder, video, unit.latents)
        chunks.append(chunk)
        assert out.latents is unit.latents and out.payloads["latents"] is unit.latents
        assert same(out.payloads["video"].frames, chunk.frames) and out.payloads["video"].start == chunk.start
        assert out.key == (unit.frame_end, 0, chunk.end) == session.key_at(unit.frame_end)
    tail = session.finish(torch.zeros(1, 128, 0, 2, 2), at=7, started_at=0.0)
    video, last = push_video(decoder, video, None, final=True)
    assert tail.kind == "tail" and tail.frame_start == tail.frame_end == 7 and "latents" not in tail.payloads
    assert same(tail.payloads["video"].frames, last.frames) and session.done
    assert session.positions() == {"latents": 0, "video": last.end}
    assert describe(session) == {"video_state_bytes": video.nbytes, "video_frames_returned": last.end}


def test_a_latents_only_session_reports_no_video_and_needs_no_output_steps(stages):
    session = stages.for_session(Outputs(), CONFIG)
    assert session.done and not session.deferred and session.nbytes == 0
    assert describe(session) == {"video_state_bytes": 0, "video_frames_returned": 0}


def test_the_rollback_point_puts_back_the_states_from_before(stages):
    session = stages.for_session(Outputs(("video",)), CONFIG)
    first, second = units()[:2]
    session.push(first, final=False)
    point = session.checkpoint()

    def pushed() -> int:  # latent frames the decoder took
        return session.states["video"].state.latents_in

    again = session.push(second, final=False)
    assert pushed() == 4
    session.restore(point)
    assert pushed() == 1 and session.states == point
    redo = session.push(second, final=False)
    assert same(redo.payloads["video"].frames, again.payloads["video"].frames)


def test_states_round_trip_through_tensors_as_a_snapshot_holds_them(stages):
    outputs = Outputs(("latents", "video"))
    session = stages.for_session(outputs, CONFIG)
    first, second, third = units()
    session.push(first, final=False)
    session.push(second, final=False)
    tensors, fields = session.to_tensors("app")
    assert set(fields) == {"latents", "video"} and fields["latents"] is None
    assert tensors and all(name.startswith("app.video.") for name in tensors)  # the names snapshots always used
    restored = stages.from_tensors(outputs, tensors, fields, "app")
    assert restored.positions() == session.positions() and restored.nbytes == session.nbytes
    live, back = session.push(third, final=True), restored.push(third, final=True)
    assert same(live.payloads["video"].frames, back.payloads["video"].frames)
    with pytest.raises(ValueError, match="no decoder state"):
        stages.from_tensors(outputs, tensors, {**fields, "video": None}, "app")


def test_a_failing_stage_changes_no_state(stages):
    class Broken(OutputStage):
        kind, action = "broken", "breaking"

        def push(self, state, unit, final):
            raise RuntimeError("injected")

    video = stages["video"]
    session = SessionStages((video, Broken()), {"video": video.new_state(Outputs(("video",)), CONFIG),
                                                "broken": None})
    before = session.checkpoint()
    with pytest.raises(OutputFailure) as failure:
        session.push(units()[0], final=False)
    assert failure.value.stage.kind == "broken" and isinstance(failure.value.cause, RuntimeError)
    assert session.states == before, "the video stage's new state was not kept"


def test_the_wire_format_of_both_kinds_is_the_stages(stages):
    outputs = Outputs(("latents", "video"), video_format="float32")
    session = stages.for_session(outputs, CONFIG)
    outs = [session.push(unit, final=False) for unit in units()]
    hosts = [HostUnit(o.kind, o.frame_start, o.frame_end, tuple(o.latents.shape),
                      {kind: stages[kind].to_host(p)() for kind, p in o.payloads.items()}) for o in outs]
    tensors, metadata = payload(hosts, outputs, stages, latent_shape=hosts[0].latent_shape, frame_at=0, positions={},
                                response_dtype="float32")
    assert list(tensors) == ["latents", "video"]
    assert torch.equal(tensors["latents"], torch.cat([u.latents for u in units()], dim=2))
    frames = sum(h.payloads["video"].end - h.payloads["video"].start for h in hosts)
    assert tensors["video"].shape[:3] == (1, frames, 3) and tensors["video"].dtype == torch.float32
    assert (metadata["frame_start"], metadata["frame_end"]) == (0, 7)
    assert (metadata["video_frame_start"], metadata["video_frame_end"]) == (0, frames)
    empty, meta = payload([], outputs, stages, latent_shape=(1, 128, 0, 2, 2), frame_at=7, positions={"video": 9},
                          response_dtype="float32")
    scale = stages["video"].decoder.spatial_compression
    assert empty["latents"].shape == (1, 128, 0, 2, 2) and empty["video"].shape == (1, 0, 3, 2 * scale, 2 * scale)
    assert (meta["frame_start"], meta["video_frame_start"], meta["video_frame_end"]) == (7, 9, 9)
