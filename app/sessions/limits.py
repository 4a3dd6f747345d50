"""What a request may ask of this server: its tensors and its config against the limits in the settings.

The checks that need no session, run before any session work so that a refused request changes nothing: the
latents' presence, channel axis, frame count, batch and frame size, the prompt's length, a config's window and step
count. Shapes, dtypes and values are the session's own to check (``RefinerSession.check``).
"""

from __future__ import annotations

import torch

from models import SessionConfig

from app.core.codec import LATENTS, PROMPT_EMBEDS
from app.core.error_kinds import ApiError
from app.core.settings import Settings


def check_payload(
    tensors: dict[str, torch.Tensor], settings: Settings, max_frames: int, frames_setting: str,
    channels: int | None = None,
) -> torch.Tensor:
    """The request's latents, after the checks that need no session: presence, the channel axis (``channels``:
    the model's latent channels) and size limits. Shapes, dtypes and values are the session's to check
    (``RefinerSession.check``)."""
    latents = tensors.get(LATENTS)
    if latents is None:
        raise ApiError(
            "missing_input",
            f"the payload has no 'latents' tensor (found {sorted(tensors)}); send latents shaped (B, C, t, H, W)",
        )
    # Before the frame count: latents sent as (B, t, C, H, W) have the channels where the frames belong, and
    # "too many frames" would send the client looking in the wrong place.
    if channels is not None and latents.ndim == 5 and latents.shape[1] != channels:
        shape = tuple(latents.shape)
        swapped = (
            f"; axis 2 holds {channels}, so the time and channel axes look swapped: move the channels to axis 1 "
            "(numpy: latents.transpose(0, 2, 1, 3, 4), torch: latents.permute(0, 2, 1, 3, 4))"
            if latents.shape[2] == channels else ""
        )
        raise ApiError(
            "invalid_input",
            f"latents shaped {shape} have {shape[1]} channels on axis 1 but the model takes {channels}; send "
            f"(B, {channels}, t, H, W){swapped}",
        )
    if latents.ndim == 5 and latents.shape[2] > max_frames:
        raise ApiError(
            "too_many_frames",
            f"the payload holds {latents.shape[2]} frames, more than the limit of {max_frames} ({frames_setting}); "
            "split it into smaller chunks",
        )
    if latents.ndim == 5 and latents.shape[0] > settings.max_batch:
        raise ApiError(
            "invalid_input",
            f"latents have batch {latents.shape[0]}, more than the limit of {settings.max_batch} (max_batch); "
            "split the batch over several sessions",
        )
    if latents.ndim == 5 and latents.shape[3] * latents.shape[4] > settings.max_frame_tokens:
        raise ApiError(
            "invalid_input",
            f"latent frames of {latents.shape[3]}x{latents.shape[4]} = {latents.shape[3] * latents.shape[4]} "
            f"tokens exceed the limit of {settings.max_frame_tokens} (max_frame_tokens); send smaller frames",
        )
    embeds = tensors.get(PROMPT_EMBEDS)
    if embeds is not None and embeds.ndim == 3 and embeds.shape[1] > settings.max_prompt_tokens:
        raise ApiError(
            "prompt_too_long",
            f"prompt_embeds holds {embeds.shape[1]} tokens, more than the limit of {settings.max_prompt_tokens} "
            "(max_prompt_tokens); send a shorter prompt",
        )
    return latents


def check_config_limits(config: SessionConfig, settings: Settings) -> SessionConfig:
    """Refuse a valid config whose window or step count exceeds what this server allows (422, naming the
    setting), so one client cannot claim unbounded memory or compute."""
    window = config.kv_max_frames + config.block_size
    if window > settings.max_window_frames:
        raise ApiError(
            "invalid_config",
            f"kv_max_frames + block_size = {window} exceeds this server's limit of {settings.max_window_frames} "
            "(max_window_frames); ask for a smaller window",
        )
    if config.steps > settings.max_denoise_steps:
        raise ApiError(
            "invalid_config",
            f"{len(config.sigmas)} sigmas make {config.steps} forwards per block, more than this server's limit of "
            f"{settings.max_denoise_steps} (max_denoise_steps); send a shorter schedule",
        )
    return config
