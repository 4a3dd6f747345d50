"""Deterministic random refiner checkpoints for tests and benchmarks, written as real diffusers folders.

``tiny`` keeps the full test suite fast on two CPU cores; ``medium`` (~20 M parameters) is big enough for
the benchmark's GEMMs to mean something. Both keep the real latent width (128 channels) so any stage-1
latent fits, and set every architectural switch the parity tests vary (RoPE type, gated attention) through
``overrides``. Their widths are multiples of 32, as every real refiner's are: CPU kernels compute the last
few elements of a tensor whose size is not a multiple of the vector width on a scalar path that rounds
differently, and a model narrower than that would make bit-exact tests depend on batch sizes that no real
deployment sees (``models.determinism``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import SanaWMLTX2RefinerTransformer3DModel

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        in_channels=128,
        out_channels=128,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        caption_channels=32,
        num_layers=2,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
    ),
    "medium": dict(
        in_channels=128,
        out_channels=128,
        num_attention_heads=6,
        attention_head_dim=64,
        cross_attention_dim=384,
        caption_channels=128,
        num_layers=8,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
    ),
}


# Small random LTX-2 video VAEs (AutoencoderKLLTX2Video) with the refiner's 128 latent channels. ``tiny-vae`` keeps
# the decoder one resnet per stage deep; ``released-depth-vae`` has the released decoder's depth (5 resnets per
# stage: what decides how far a pixel frame looks ahead) at test widths.
_TINY_VAE: dict[str, Any] = dict(
    latent_channels=128,
    block_out_channels=(16, 32, 64, 64),
    decoder_block_out_channels=(16, 32, 64),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
    decoder_causal=False,
)
VAE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-vae": _TINY_VAE,
    "released-depth-vae": {**_TINY_VAE, "decoder_layers_per_block": (5, 5, 5, 5)},
}


def build_vae(preset: str = "tiny-vae", seed: int = 0, **overrides: Any):
    """A randomly initialised LTX-2 video VAE, identical for the same ``(preset, seed, overrides)``; its weights
    are perturbed like ``build_model``'s so that its decoder mixes frames."""
    from diffusers import AutoencoderKLLTX2Video

    if preset not in VAE_PRESETS:
        raise ValueError(f"unknown VAE preset {preset!r}; choose one of {sorted(VAE_PRESETS)}")
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        vae = AutoencoderKLLTX2Video(**{**VAE_PRESETS[preset], **overrides})
        with torch.no_grad():
            for param in vae.parameters():
                if param.ndim >= 1:
                    param.add_(torch.randn_like(param) * 0.02)
    finally:
        torch.random.set_rng_state(state)
    return vae.eval()


def write_vae_checkpoint(out_dir: str | Path, preset: str = "tiny-vae", seed: int = 0, **overrides: Any) -> Path:
    """Write a random VAE folder (``config.json`` + safetensors) that ``models.vae.load_vae`` reads."""
    out = Path(out_dir)
    build_vae(preset, seed, **overrides).save_pretrained(out, safe_serialization=True)
    return out


def build_model(preset: str = "tiny", seed: int = 0, **overrides: Any) -> SanaWMLTX2RefinerTransformer3DModel:
    """A randomly initialised refiner, identical for the same ``(preset, seed, overrides)``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    config = {**PRESETS[preset], **overrides}
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = SanaWMLTX2RefinerTransformer3DModel(**config)
        # Default init leaves the output projections and gates near their trained-from-zero values; scale every
        # parameter up a little so the random model actually mixes its inputs and parity tests can fail.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.ndim >= 1 and "scale_shift_table" not in name:
                    param.add_(torch.randn_like(param) * 0.02)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()


def write_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    class_name: str | None = None,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random refiner folder (``config.json`` + safetensors) that ``load_refiner`` reads.

    ``class_name="LTX2VideoTransformer3DModel"`` writes the layout the SANA-WM release ships; ``max_shard_size``
    (e.g. ``"200KB"``) writes a sharded checkpoint with an index file.
    """
    out = Path(out_dir)
    model = build_model(preset, seed=seed, **overrides)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    if class_name is not None:
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        config["_class_name"] = class_name
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return out
