"""Loading a refiner DiT from a local diffusers folder onto a device, never touching the network."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import SanaWMLTX2RefinerTransformer3DModel

from .attention import install_processors
from .errors import ModelLoadError

log = logging.getLogger(__name__)

# Folder layouts that load into the refiner class: its own, and the LTX-2 layout the SANA-WM release ships
# (same config arguments, same parameter names).
SUPPORTED_CLASSES = ("SanaWMLTX2RefinerTransformer3DModel", "LTX2VideoTransformer3DModel")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
WEIGHTS = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"


@dataclass(frozen=True)
class ModelInfo:
    """What clients and operators need to know about the loaded refiner."""

    class_name: str
    path: str
    num_layers: int
    in_channels: int
    out_channels: int
    caption_channels: int
    inner_dim: int
    num_attention_heads: int
    attention_head_dim: int
    rope_type: str
    gated_attn: bool
    parameters: int
    dtype: str
    device: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Refiner:
    """A loaded refiner model and where it runs. The model is shared by every session and holds no session state."""

    model: SanaWMLTX2RefinerTransformer3DModel
    device: torch.device
    dtype: torch.dtype
    info: ModelInfo

    @property
    def num_layers(self) -> int:
        return self.info.num_layers


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" or device.startswith("cuda"):
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} was asked for but CUDA is not available; use 'cpu' or 'auto'")
        return torch.device(device)
    raise ModelLoadError(f"unknown device {device!r}; use 'cpu', 'cuda', 'cuda:N' or 'auto'")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def read_config_file(config_path: Path) -> dict[str, Any]:
    """A refiner's ``config.json``, parsed and checked (``check_config``); ModelLoadError saying what is wrong."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from None
    check_config(config, str(config_path))
    return config


def check_config(config: dict[str, Any], where: str) -> None:
    """Reject configurations the streaming refiner cannot run, naming the field."""
    class_name = config.get("_class_name")
    if class_name not in SUPPORTED_CLASSES:
        raise ModelLoadError(
            f"{where}: _class_name is {class_name!r}; the refiner loads folders saved as one of {SUPPORTED_CLASSES}"
        )
    if config.get("cross_attn_mod", False):
        raise ModelLoadError(
            f"{where}: cross_attn_mod=true is not supported by SanaWMLTX2RefinerTransformer3DModel "
            "(the LTX-2.3 prompt modulation); use an LTX-2 refiner checkpoint with cross_attn_mod=false"
        )
    if not config.get("use_prompt_embeddings", True):
        raise ModelLoadError(
            f"{where}: use_prompt_embeddings=false is not supported; the refiner needs the caption projection "
            "(use_prompt_embeddings=true)"
        )
    for field in ("patch_size", "patch_size_t"):
        if config.get(field, 1) != 1:
            raise ModelLoadError(f"{where}: {field}={config[field]} is not supported; LTX-2 refiners use 1")


def load_refiner(path: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto") -> Refiner:
    """Load a refiner folder (``config.json`` + ``diffusion_pytorch_model*.safetensors``) for streaming."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(
            f"model folder {str(folder)!r} does not exist; pass a local folder in diffusers layout "
            "(config.json + diffusion_pytorch_model*.safetensors). Nothing is ever downloaded; "
            "`python -m app make-checkpoint --preset tiny --out DIR` writes a test one."
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: config.json is missing; a diffusers model folder needs it")
    config = read_config_file(config_path)
    if not (folder / WEIGHTS).is_file() and not (folder / WEIGHTS_INDEX).is_file():
        found = sorted(p.name for p in folder.iterdir())
        raise ModelLoadError(
            f"{folder}: no {WEIGHTS} or {WEIGHTS_INDEX} (found {found}); save the weights as safetensors"
        )

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    try:
        model = SanaWMLTX2RefinerTransformer3DModel.from_pretrained(
            str(folder),
            local_files_only=True,
            use_safetensors=True,
            torch_dtype=torch_dtype,
            low_cpu_mem_usage=False,
        )
    except Exception as exc:  # diffusers raises many types for a broken folder; name the folder and the cause
        raise ModelLoadError(f"{folder}: could not load the refiner weights: {exc}") from exc

    model = _place(model, torch_device, torch_dtype)
    # from_pretrained may leave parameters as views into the safetensors buffer, at offsets that are not
    # 64-byte aligned; CPU GEMM kernels pick different code paths by alignment, so the same weights would give
    # different bits than a model built in memory. Give every tensor its own freshly allocated storage.
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
    model.eval().requires_grad_(False)
    install_processors(model)
    return Refiner(model=model, device=torch_device, dtype=torch_dtype, info=model_info(model, folder, config))


def from_model(model: SanaWMLTX2RefinerTransformer3DModel, device="cpu", dtype="float32") -> Refiner:
    """Wrap an in-memory model (tests, benchmarks) exactly as ``load_refiner`` would."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    config = dict(model.config)
    config.setdefault("_class_name", type(model).__name__)
    check_config(config, "in-memory model")
    model = _place(model, torch_device, torch_dtype).eval().requires_grad_(False)
    install_processors(model)
    return Refiner(model=model, device=torch_device, dtype=torch_dtype, info=model_info(model, None, config))


def _place(model, device: torch.device, dtype: torch.dtype):
    if next(model.parameters()).dtype != dtype:
        model = model.to(dtype=dtype)
    return model.to(device=device)


def model_info(model, folder: Path | None, config: dict[str, Any]) -> ModelInfo:
    cfg = model.config
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    return ModelInfo(
        class_name=str(config.get("_class_name", type(model).__name__)),
        path=str(folder) if folder is not None else "",
        num_layers=len(model.transformer_blocks),
        in_channels=int(cfg.in_channels),
        out_channels=int(cfg.out_channels or cfg.in_channels),
        caption_channels=int(cfg.caption_channels),
        inner_dim=int(cfg.num_attention_heads * cfg.attention_head_dim),
        num_attention_heads=int(cfg.num_attention_heads),
        attention_head_dim=int(cfg.attention_head_dim),
        rope_type=str(cfg.rope_type),
        gated_attn=bool(cfg.gated_attn),
        parameters=sum(p.numel() for p in model.parameters()),
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
    )
