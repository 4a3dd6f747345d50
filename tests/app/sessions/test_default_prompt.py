"""A server-configured default prompt (api.md: "unless the server is configured with a default prompt
embedding"): used when the first chunk carries none, broadcast over a batch, refused at start-up when bad."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from models import ModelLoadError

from tests.app.conftest import OCTET, expected_clip, make_clip, payload, read_latents, reference_refine, running_app


def test_default_prompt_is_used_when_the_first_chunk_has_none(make_settings, refiner, checkpoint_dir, tmp_path):
    latents, embeds, mask = make_clip(frames=7, seed=21)
    save_file({"prompt_embeds": embeds, "prompt_attention_mask": mask}, tmp_path / "prompt.safetensors")
    with running_app(make_settings(default_prompt=tmp_path / "prompt.safetensors")) as client:
        assert client.get("/v1/info").json()["default_prompt"] is True
        session = client.post("/v1/sessions", json={}).json()["session_id"]
        parts = []
        for start, end in [(0, 3), (3, 7)]:
            response = client.post(f"/v1/sessions/{session}/chunks", content=payload(latents[:, :, start:end]),
                                   headers=OCTET)
            assert response.status_code == 200, response.text
            parts.append(read_latents(response.content)[0])
        response = client.post(f"/v1/sessions/{session}/chunks?flush=true", content=payload(latents[:, :, 7:]),
                               headers=OCTET)
        parts.append(read_latents(response.content)[0])
        streamed = torch.cat(parts, dim=2)
        assert (streamed - reference_refine(checkpoint_dir, latents, embeds, mask)).abs().max().item() <= 1e-5

        one_shot = client.post("/v1/refine", content=payload(latents), headers=OCTET)
        assert one_shot.status_code == 200 and torch.equal(read_latents(one_shot.content)[0], streamed)

        # A batch of two streams shares the default prompt, exactly as if it had been sent for each.
        batch = torch.cat([latents, latents.flip(2)], dim=0)
        response = client.post("/v1/refine", content=payload(batch), headers=OCTET)
        assert response.status_code == 200, response.text
        expected = expected_clip(refiner, batch, embeds.expand(2, -1, -1), mask.expand(2, -1))
        assert torch.equal(read_latents(response.content)[0], expected)


def test_without_a_default_the_first_chunk_needs_a_prompt(client):
    latents, _, _ = make_clip(frames=4)
    assert client.get("/v1/info").json()["default_prompt"] is False
    session = client.post("/v1/sessions", json={}).json()["session_id"]
    response = client.post(f"/v1/sessions/{session}/chunks", content=payload(latents), headers=OCTET)
    assert response.status_code == 400 and "prompt_embeds" in response.json()["error"]["message"]


@pytest.mark.parametrize("content, fragment", [
    (None, "not a readable safetensors file"),
    ({"embeds": torch.randn(1, 4, 32)}, "no 'prompt_embeds'"),
    ({"prompt_embeds": torch.randn(1, 4, 16)}, "prompt_embeds must be shaped"),
])
def test_bad_default_prompt_stops_start_up(make_settings, tmp_path, content, fragment):
    path = tmp_path / "prompt.safetensors"
    if content is None:
        path.write_bytes(b"garbage")
    else:
        save_file(content, path)
    with pytest.raises(ModelLoadError, match=fragment):
        with running_app(make_settings(default_prompt=path)):
            pass
