"""The WebSocket half of the hostile-client pass (issue 16): a stream message whose block refines to NaN/Inf
(item 6), and the protocol details of item 7 (refused handshakes, invalid UTF-8, websockets' own header limit,
subprotocol selection from a real browser, the watch route's pool)."""

from __future__ import annotations

import json

import torch

from .conftest import make_clip, payload, read_latents, running_app, session_state


# --- item 6: a poisoned stream message ------------------------------------------------------------------------
def _poisoned(latents: torch.Tensor) -> torch.Tensor:
    bad = latents.clone()
    bad[:, :, :, 0, 0] = 3e38  # finite: passes the input checks, overflows in the model
    return bad


def _units_until(ws, frames: int) -> list[torch.Tensor]:
    """Binary units until ``frames`` frames came back; a text event on the way fails the test."""
    units, got = [], 0
    while got < frames:
        message = ws.receive()
        assert message.get("bytes") is not None, f"expected a unit, got {message}"
        unit = read_latents(message["bytes"])[0]
        units.append(unit)
        got += unit.shape[2]
    return units


def _event(ws) -> dict:
    message = ws.receive()
    assert message.get("text") is not None, f"expected an event, got {message}"
    return json.loads(message["text"])


def _flush(ws, frames: int) -> list[torch.Tensor]:
    ws.send_text('{"type": "flush"}')
    units = []
    while True:
        message = ws.receive()
        if message.get("bytes") is not None:
            units.append(read_latents(message["bytes"])[0])
            continue
        assert json.loads(message["text"]) == {"type": "done", "frames": frames}
        return units


def test_a_stream_message_that_refines_to_non_finite_values_is_refused_and_rolled_back(make_settings, refiner):
    """Poisoned latents, then a poisoned prompt: each message gets an error event, commits nothing, and the
    connection goes on; the good messages that follow give the bytes an untroubled session gives."""
    from .conftest import expected_clip

    latents, embeds, mask = make_clip(frames=10, seed=5)
    with running_app(make_settings()) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
            ws.send_bytes(payload(latents[:, :, :4], embeds, mask))
            units = _units_until(ws, 4)
            before = session_state(client, session_id)

            ws.send_bytes(payload(_poisoned(latents[:, :, 4:7])))
            error = _event(ws)["error"]
            assert error["code"] == "invalid_input" and "NaN or Inf" in error["message"], error
            assert "3e+38" in error["message"] and "send latents and prompt_embeds" in error["message"]
            assert session_state(client, session_id) == before

            huge_prompt = embeds.clone()
            huge_prompt[:, :, 0] = 3e38
            ws.send_bytes(payload(latents[:, :, 4:7], huge_prompt, mask))
            error = _event(ws)["error"]
            assert error["code"] == "invalid_input" and "prompt_embeds |x| = 3e+38" in error["message"], error
            assert session_state(client, session_id) == before

            ws.send_bytes(payload(latents[:, :, 4:7]))
            units += _units_until(ws, 3)
            ws.send_bytes(payload(latents[:, :, 7:]))
            units += _flush(ws, 10)
    assert torch.equal(torch.cat(units, dim=2), expected_clip(refiner, latents, embeds, mask))


def test_poisoned_frames_pending_from_an_earlier_message_are_dropped_not_kept(make_settings, refiner):
    """One poisoned frame, too few for a block, is taken; the good message completing the block fails on it. The
    session then drops every frame not yet refined (it cannot tell whose frame broke the block) and says from
    which frame to send again, so the stream recovers instead of failing every following block."""
    from .conftest import expected_clip

    latents, embeds, mask = make_clip(frames=10, seed=5)
    with running_app(make_settings()) as client:
        session_id = client.post("/v1/sessions").json()["session_id"]
        with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as ws:
            ws.send_bytes(payload(latents[:, :, :4], embeds, mask))
            units = _units_until(ws, 4)
            ws.send_bytes(payload(_poisoned(latents[:, :, 4:5])))  # pending: no event
            ws.send_bytes(payload(latents[:, :, 5:7]))
            event = _event(ws)
            assert event["error"]["code"] == "invalid_input", event
            assert event["frames_received"] == 4, event
            assert "frames [4, 7) were dropped" in event["error"]["message"], event
            state = session_state(client, session_id)
            assert (state["frames_received"], state["frames_returned"]) == (4, 4)

            ws.send_bytes(payload(latents[:, :, 4:]))
            units += _flush(ws, 10)
    assert torch.equal(torch.cat(units, dim=2), expected_clip(refiner, latents, embeds, mask))
