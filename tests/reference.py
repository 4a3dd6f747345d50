"""diffusers' reference refiner, the parity tests' ground truth (tests only: importing it needs transformers)."""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler


def reference_refine(model, latents, prompt_embeds, prompt_mask=None, *, seed=42, fps=16.0, sink=1, block=3,
                     kv_max=11, sigmas=None, vae=None):
    """diffusers' ``SanaWMLTX2Refiner.__call__`` with its text encoder replaced by fixed embeddings. With ``vae``
    it decodes as the pipeline does and returns its video: row 0, (F, 3, H, W) in [0, 1] (``output_type="pt"``)."""
    from diffusers.pipelines.sana_wm.refiner import STAGE_2_DISTILLED_SIGMA_VALUES, SanaWMLTX2Refiner

    pipe = SanaWMLTX2Refiner(
        transformer=model,
        connectors=None,
        tokenizer=None,
        text_encoder=None,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        vae=vae,
    )
    pipe.set_progress_bar_config(disable=True)
    batch, length = prompt_embeds.shape[:2]
    mask = torch.ones(batch, length) if prompt_mask is None else prompt_mask
    pipe._encode_prompt = lambda prompt, device, dtype: (prompt_embeds.to(device, dtype), mask.to(device))
    return pipe(
        latents,
        "unused: the prompt embeddings are fixed",
        fps=fps,
        sink_size=sink,
        block_size=block,
        kv_max_frames=kv_max,
        sigmas=tuple(sigmas) if sigmas is not None else STAGE_2_DISTILLED_SIGMA_VALUES,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="latent" if vae is None else "pt",
    )
