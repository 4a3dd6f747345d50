"""Loading a refiner DiT from a local diffusers folder onto a device, never touching the network.

Loaded as a GPU server needs it: the model is built on the ``meta`` device from ``config.json`` (no random
initialisation of 19 B parameters on the host), cut to the video path (``keep_video_path``: the audio stream and
the audio/video cross-attention never run in the refiner, 5.8 B parameters of the released checkpoint), and each
video tensor is read from the safetensors files straight into its final storage on the device in the serving
dtype (``read_weights``), then assigned to the model (``load_state_dict(assign=True)``): no copy of the weights
is made besides the one that puts them where they run. ``device="meta"`` stops after the first step: the refiner
from ``config.json`` alone, shapes without storage, which a ``RefinerSession`` runs on (the dispatch audit,
capacity plans).
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from diffusers import SanaWMLTX2RefinerTransformer3DModel

from .attention import install_processors
from .errors import ModelLoadError

log = logging.getLogger(__name__)

# Folder layouts that load into the refiner class: its own, and the LTX-2 layout the SANA-WM release ships
# (same config arguments, same parameter names).
SUPPORTED_CLASSES = ("SanaWMLTX2RefinerTransformer3DModel", "LTX2VideoTransformer3DModel")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}  # the short names
WEIGHTS = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"

# What the refiner's forward runs: diffusers' ``SanaWMLTX2RefinerTransformer3DModel.forward`` reads these top-level
# modules and parameters (``rope`` builds the tables; it has no weights) and, in every block,
# ``SanaWMLTX2RefinerTransformerBlock.forward`` these. Everything else -- the audio stream (``audio_*``), the
# audio/video cross-attention (``audio_to_video_attn``, ``video_to_audio_attn``, ``av_cross_attn_*``, the ``*_a2v_*``
# tables) and the keyframe embedding -- diffusers keeps only so checkpoints round-trip; ``check_config`` refuses the
# options (``cross_attn_mod``) under which a block would read more.
VIDEO_MODULES = frozenset(
    {"proj_in", "time_embed", "caption_projection", "transformer_blocks", "scale_shift_table", "norm_out", "proj_out",
     "rope"}
)
VIDEO_BLOCK_MODULES = frozenset({"norm1", "attn1", "norm2", "attn2", "norm3", "ff", "scale_shift_table"})

# safetensors' dtype names.
_FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}
# CPU GEMM kernels pick code paths by the address of their operands: the same weights at an address that is not
# a multiple of 64 bytes give different bits (tests/models/test_loading.py).
_CPU_ALIGNMENT = 64


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
    """The torch device for a setting. A CUDA device always carries its index (``cuda`` and ``auto`` become
    ``cuda:N``, N the current device): tensors report ``cuda:0``, and ``torch.device("cuda") != "cuda:0"``, so a
    device without one would make every "is this tensor already there?" comparison answer no."""
    if isinstance(device, torch.device):
        return _indexed(device)
    if device == "auto":
        return _indexed(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if device == "meta":  # shapes only: the refiner from config.json alone (audits, plans)
        return torch.device("meta")
    if device == "cpu" or device.startswith("cuda"):
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} was asked for but CUDA is not available: {cuda_missing()}")
        return _indexed(torch.device(device))
    raise ModelLoadError(f"unknown device {device!r}; use 'cpu', 'cuda', 'cuda:N', 'auto' or 'meta' (shapes only)")


def cuda_missing() -> str:
    """Why ``torch.cuda.is_available()`` is False, and what to do: a CPU-only build of torch (what the ``[cpu]``
    extra installs) cannot see a GPU whatever the machine has; a CUDA build that sees none points at the driver or
    the GPUs this process may use."""
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build; on a GPU machine install a CUDA build of "
                "torch (2.11 or newer) and the project without the [cpu] extra, which pins the CPU build "
                "(`pip install -e .` keeps the machine's own torch), or use 'cpu' or 'auto'")
    return (f"this torch ({torch.__version__}, CUDA {torch.version.cuda}) sees no GPU; check the driver "
            "(nvidia-smi), CUDA_VISIBLE_DEVICES and, in a container, its GPU access (docker run --gpus, a "
            "Kubernetes nvidia.com/gpu limit), or use 'cpu' or 'auto'")


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} (or {sorted(DTYPE_ALIASES)}), "
                             "or 'auto'")
    return DTYPES[name]


VAE_CLASS = "AutoencoderKLLTX2Video"


def pipeline_hint(folder: Path, classes: Iterable[str]) -> str:
    """When ``folder`` is a whole diffusers pipeline release (``model_index.json``, one subfolder per component)
    rather than the component folder a loader wants: "; ... pass its 'transformer' subfolder, PATH" naming the
    subfolder that holds one of ``classes`` (the refiner, or the VAE), else "". For the error a loader raises when
    ``folder`` has no config.json, which is what pointing at a downloaded release gives."""
    try:
        index = json.loads((Path(folder) / "model_index.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(index, dict):
        return ""
    wanted = set(classes)
    for name, entry in index.items():
        if isinstance(entry, list) and len(entry) == 2 and entry[1] in wanted and (Path(folder) / name).is_dir():
            return (f"; {str(folder)!r} is a diffusers pipeline folder (model_index.json): pass its {name!r} "
                    f"subfolder, {str(Path(folder) / name)!r}")
    return ""


def read_config_file(config_path: Path) -> dict[str, Any]:
    """A refiner's ``config.json``, parsed and checked (``check_config``); ModelLoadError saying what is wrong."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON ({exc}); pass the config.json the refiner was saved "
                             "with (save_pretrained writes it)") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} holds a JSON {type(config).__name__}, not the mapping of fields "
                             "save_pretrained writes")
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
    """Load a refiner folder (``config.json`` + ``diffusion_pytorch_model*.safetensors``) for streaming: its video
    path only, each weight read once, straight onto ``device`` in ``dtype``. ``device="meta"``: built from
    ``config.json`` alone (no weights read, none needed), shapes only."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(
            f"model folder {str(folder)!r} does not exist; pass a local folder in diffusers layout "
            "(config.json + diffusion_pytorch_model*.safetensors). Nothing is ever downloaded; "
            "`python -m app make-checkpoint --preset tiny --out DIR` writes a test one."
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: config.json is missing; a diffusers model folder needs it"
                             f"{pipeline_hint(folder, SUPPORTED_CLASSES)}")
    config = read_config_file(config_path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    model = build_video_model(config, str(config_path))
    if torch_device.type == "meta":
        model = torch.nn.Module.to(model, dtype=torch_dtype)  # (ModelMixin.to warns about fp32 modules it has none of)
    else:
        if not (folder / WEIGHTS).is_file() and not (folder / WEIGHTS_INDEX).is_file():
            found = sorted(p.name for p in folder.iterdir())
            raise ModelLoadError(
                f"{folder}: no {WEIGHTS} or {WEIGHTS_INDEX} (found {found}); save the weights as safetensors"
            )
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        try:
            weights = read_weights(weight_files(folder), expected, torch_device, torch_dtype)
        except ModelLoadError:
            raise
        except Exception as exc:  # a truncated file, a broken header: name the folder and the cause
            raise ModelLoadError(f"{folder}: could not load the refiner weights: {exc}") from exc
        model.load_state_dict(weights, strict=True, assign=True)
    model.eval().requires_grad_(False)
    install_processors(model)
    return Refiner(model=model, device=torch_device, dtype=torch_dtype, info=model_info(model, folder, config))


def build_video_model(config: dict[str, Any], where: str) -> SanaWMLTX2RefinerTransformer3DModel:
    """The refiner of ``config`` on the ``meta`` device (no storage, no initialisation), cut to its video path."""
    arguments = {k: v for k, v in config.items() if not k.startswith("_")}
    try:
        with torch.device("meta"):
            model = SanaWMLTX2RefinerTransformer3DModel.from_config(arguments)
    except Exception as exc:  # diffusers and the model's __init__ raise many types for a field it cannot use
        raise ModelLoadError(f"{where} does not build a refiner ({type(exc).__name__}: {exc}); fix the field it "
                             "names, or pass the config.json saved with the weights") from None
    return keep_video_path(model)


def keep_video_path(model: SanaWMLTX2RefinerTransformer3DModel) -> SanaWMLTX2RefinerTransformer3DModel:
    """Remove, in place, every module and parameter the refiner's forward never runs (``VIDEO_MODULES``,
    ``VIDEO_BLOCK_MODULES``); diffusers' forward still runs on what is left. Returns ``model``."""
    _keep_only(model, VIDEO_MODULES)
    for block in model.transformer_blocks:
        _keep_only(block, VIDEO_BLOCK_MODULES)
    return model


def _keep_only(module: torch.nn.Module, names: frozenset[str]) -> None:
    for table in (module._modules, module._parameters, module._buffers):
        for name in [n for n in table if n not in names]:
            del table[name]


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the single file, or the shards its index names."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    index_path = folder / WEIGHTS_INDEX
    try:
        index = json.loads(index_path.read_text())
        return [folder / name for name in sorted(set(index["weight_map"].values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index_path} is not a safetensors index ({type(exc).__name__}: {exc}); it maps each "
                             "parameter to its file under 'weight_map'") from None


def read_weights(files: Iterable[Path], expected: dict[str, tuple[int, ...]], device: torch.device,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors named in ``expected`` (name -> shape) from safetensors ``files``, on ``device`` in ``dtype``;
    every other tensor of the files (the audio branch) is never read. ModelLoadError naming a tensor that is
    missing or of another shape.

    On a CPU each tensor is read from the file into fresh memory of its own (``_read_cpu``), which is 64-byte
    aligned; on an accelerator safetensors' own reader puts it on the device, where it is cast."""
    found: dict[str, torch.Tensor] = {}
    for file in files:
        if device.type == "cpu":
            found.update(_read_cpu(file, expected, dtype))
            continue
        from safetensors import safe_open

        with safe_open(str(file), framework="pt", device=str(device)) as weights:
            for name in weights.keys():
                if name in expected:
                    _check_shape(name, tuple(weights.get_slice(name).get_shape()), expected[name], file)
                    found[name] = weights.get_tensor(name).to(dtype)
    missing = sorted(set(expected) - set(found))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"the weights lack {', '.join(missing[:3])}{more}, which config.json's refiner needs; "
                             "pass the folder save_pretrained wrote with this config.json")
    return found


def _read_cpu(file: Path, expected: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The ``expected`` tensors of one safetensors file, each read with one ``readinto`` into a tensor of its own
    (``torch.empty``: 64-byte aligned, what bit-stable CPU GEMMs need), cast if the file holds another dtype.
    Neither ``safe_open`` nor ``load_file`` would do: their tensors are views into the file's memory map at the
    file's offsets (8 bytes + a header of any length), mostly not aligned, and copying them to aligned memory is a
    second pass over every byte."""
    with open(file, "rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_size))
        data_start = 8 + header_size
        out: dict[str, torch.Tensor] = {}
        entries = sorted(((name, entry) for name, entry in header.items() if name in expected),
                         key=lambda item: item[1]["data_offsets"][0])  # in file order: one forward sweep
        for name, entry in entries:
            shape = tuple(entry["shape"])
            _check_shape(name, shape, expected[name], file)
            file_dtype = _FILE_DTYPES.get(entry["dtype"])
            if file_dtype is None:
                raise ModelLoadError(f"{file}: {name} has dtype {entry['dtype']}, which the refiner cannot load")
            begin, end = entry["data_offsets"]
            raw = torch.empty(end - begin, dtype=torch.uint8)
            handle.seek(data_start + begin)
            if handle.readinto(raw.numpy()) != end - begin:
                raise ModelLoadError(f"{file}: truncated: {name} ends past the end of the file")
            tensor = raw.view(file_dtype).view(shape) if end > begin else torch.empty(shape, dtype=file_dtype)
            out[name] = tensor if file_dtype == dtype else tensor.to(dtype)
    return out


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...], file: Path) -> None:
    if shape != expected:
        raise ModelLoadError(f"{file}: {name} is {list(shape)} on disk but {list(expected)} by config.json; pass "
                             "the config.json saved with these weights")


def from_model(model: SanaWMLTX2RefinerTransformer3DModel, device="cpu", dtype="float32") -> Refiner:
    """Wrap an in-memory model (tests, benchmarks) exactly as ``load_refiner`` would: cut to its video path (in
    place: the audio modules are removed from ``model``), on ``device`` in ``dtype``."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    config = dict(model.config)
    config.setdefault("_class_name", type(model).__name__)
    check_config(config, "in-memory model")
    model = _place(keep_video_path(model), torch_device, torch_dtype).eval().requires_grad_(False)
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
        parameters=sum(p.numel() for p in model.parameters()),  # what is loaded: the video path
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
    )
