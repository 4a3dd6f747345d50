"""diffusers' reference refiner, the parity tests' ground truth (tests only: importing it needs transformers)."""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler


def reference_refine(model, latents, prompt_embeds, prompt_mask=None, *, seed=42, fps=16.0, sink=1, block=3,
                     kv_max=11, sigmas=None, vae=None, generator_device="cpu"):
    """diffusers' ``SanaWMLTX2Refiner.__call__`` with its text encoder replaced by fixed embeddings. With ``vae``
    it decodes as the pipeline does and returns its video: row 0, (F, 3, H, W) in [0, 1] (``output_type="pt"``).
    ``generator_device``: where the noise is drawn; a session draws on its refiner's device (a CUDA generator's
    Philox stream differs from the CPU's), so a comparison with a CUDA session passes ``"cuda"``."""
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
        generator=torch.Generator(generator_device).manual_seed(seed),
        output_type="latent" if vae is None else "pt",
    )


# refiner.md's parity contract: within 1e-5 (max abs) of the reference in float32 on a CPU. Bit-exactness with the
# reference is not ours to promise: diffusers computes the timestep embedding once per token (a GEMM of M = B*N rows)
# where the service computes it one row at a time, and BLAS kernels round by M differently on different CPUs
# (bit-exact on Intel Xeons with AVX-512/AMX, ~5e-7 on an AMD EPYC with AVX2).
PARITY_TOLERANCE = 1e-5
REBASED_TOLERANCE = 1e-4  # rebased positions, which the reference does not have: a different RoPE rounding


def assert_parity(got: torch.Tensor, expected: torch.Tensor, what: str = "", tolerance: float = PARITY_TOLERANCE) -> float:
    """Assert ``got`` matches the reference within ``tolerance``; prints and returns the max abs difference."""
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(expected.shape)}"
    diff = (got.double() - expected.double()).abs().max().item()
    print(f"parity {what or ''}: max abs diff vs diffusers' reference {diff:.3g} (bit-exact: {torch.equal(got, expected)})")
    assert diff <= tolerance, f"{what}: max abs diff vs the reference {diff:.3g} > {tolerance}"
    return diff
