"""Loading refiner folders: layouts, bit-stable weights, and clear errors (never a network lookup)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from models import ModelLoadError, RefinerSession, SessionConfig, from_model, load_refiner
from models.checkpoints import build_model, write_checkpoint
from models.loading import resolve_device, resolve_dtype

from .conftest import make_inputs


def refine(refiner, latents, embeds):
    units = RefinerSession(refiner, SessionConfig()).push(latents, embeds, flush=True)
    return torch.cat([u.latents for u in units], dim=2)


def test_loaded_weights_are_bit_stable(tiny_dir):
    """Loaded twice, and against the same weights built in memory: identical bits, aligned storage."""
    latents, embeds = make_inputs(frames=7, seed=9)
    first, second = load_refiner(tiny_dir, device="cpu", dtype="float32"), load_refiner(tiny_dir, "cpu", "float32")
    in_memory = from_model(build_model("tiny"))
    expected = refine(in_memory, latents, embeds)
    assert torch.equal(refine(first, latents, embeds), expected)
    assert torch.equal(refine(second, latents, embeds), expected)
    assert all(p.data_ptr() % 64 == 0 for p in first.model.parameters())


@pytest.mark.parametrize("layout", ["ltx2-class-name", "sharded"])
def test_release_layouts_load(layout, tmp_path):
    kwargs = {"class_name": "LTX2VideoTransformer3DModel"} if layout == "ltx2-class-name" else {"max_shard_size": "60KB"}
    folder = write_checkpoint(tmp_path / layout, preset="tiny", **kwargs)
    if layout == "sharded":
        assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    refiner = load_refiner(folder, device="cpu", dtype="float32")
    latents, embeds = make_inputs(frames=5, seed=10)
    assert torch.equal(refine(refiner, latents, embeds), refine(from_model(build_model("tiny")), latents, embeds))
    assert refiner.info.num_layers == 2 and refiner.info.caption_channels == 32


def test_dtypes_load(tiny_dir):
    for dtype, torch_dtype in [("bfloat16", torch.bfloat16), ("float64", torch.float64), ("auto", torch.float32)]:
        refiner = load_refiner(tiny_dir, device="cpu", dtype=dtype)
        assert refiner.dtype == torch_dtype and next(refiner.model.parameters()).dtype == torch_dtype
        latents, embeds = make_inputs(frames=4)
        out = refine(refiner, latents, embeds)
        assert out.dtype == torch_dtype and torch.isfinite(out.float()).all()


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "breakage, fragment",
    [
        ("missing-folder", "does not exist"),
        ("no-config", "config.json is missing"),
        ("no-weights", "no diffusion_pytorch_model.safetensors"),
        ("cross-attn-mod", "cross_attn_mod"),
        ("no-prompt-embeddings", "use_prompt_embeddings"),
        ("other-class", "_class_name"),
        ("patch-size", "patch_size=2"),
        ("truncated-weights", "could not load"),
    ],
)
def test_bad_folders_fail_clearly(breakage, fragment, tiny_dir, tmp_path):
    folder = tmp_path / "model"
    if breakage != "missing-folder":
        shutil.copytree(tiny_dir, folder)
    weights = folder / "diffusion_pytorch_model.safetensors"
    if breakage == "no-config":
        (folder / "config.json").unlink()
    elif breakage == "no-weights":
        weights.unlink()
    elif breakage == "cross-attn-mod":
        edit_config(folder, cross_attn_mod=True)
    elif breakage == "no-prompt-embeddings":
        edit_config(folder, use_prompt_embeddings=False)
    elif breakage == "other-class":
        edit_config(folder, _class_name="UNet2DConditionModel")
    elif breakage == "patch-size":
        edit_config(folder, patch_size=2)
    elif breakage == "truncated-weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=fragment):
        load_refiner(folder, device="cpu", dtype="float32")


def test_hub_ids_are_not_looked_up(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ModelLoadError, match="Nothing is ever downloaded"):
        load_refiner("Efficient-Large-Model/SANA-WM-refiner", device="cpu")


def test_device_and_dtype_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    for bad in ("tpu", "gpu0"):
        with pytest.raises(ModelLoadError, match="unknown device"):
            resolve_device(bad)
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("float8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available") as caught:
            resolve_device("cuda")
        # It says why and what to do: a CPU-only torch (the [cpu] extra's) is to be replaced, not served on a CPU.
        if torch.version.cuda is None:
            assert f"this torch ({torch.__version__}) is a CPU-only build" in str(caught.value)
            assert "without the [cpu] extra" in str(caught.value)
        else:
            assert "sees no GPU; check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES" in str(caught.value)


def test_a_cuda_device_always_carries_its_index(monkeypatch):
    """Tensors on a GPU report ``cuda:N``, and ``torch.device("cuda") != torch.device("cuda:0")``: a device resolved
    without its index would make every "already on the target?" check (models/move.py) answer no. The CUDA calls
    are stood in for (no GPU here); what is tested is the resolution."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device("meta") == torch.device("meta")


def test_only_the_video_path_is_loaded(tiny_dir, tmp_path):
    """The audio branch is never read: a folder without it loads the same refiner, and the loaded model has none."""
    from safetensors.torch import load_file, save_file

    from models.loading import VIDEO_BLOCK_MODULES, VIDEO_MODULES

    full = load_file(str(tiny_dir / "diffusion_pytorch_model.safetensors"))
    refiner = load_refiner(tiny_dir, device="cpu", dtype="float32")
    loaded = dict(refiner.model.named_parameters())
    assert loaded and set(loaded) < set(full)
    for name in loaded:
        parts = name.split(".")
        assert parts[0] in VIDEO_MODULES and (parts[0] != "transformer_blocks" or parts[2] in VIDEO_BLOCK_MODULES)
    assert not any("audio" in name or "av_cross" in name or "a2v" in name for name in loaded)
    assert refiner.info.parameters == sum(p.numel() for p in loaded.values())
    assert all(torch.equal(p, full[name]) for name, p in loaded.items())

    video_only = tmp_path / "video-only"
    shutil.copytree(tiny_dir, video_only)
    save_file({name: full[name] for name in loaded}, str(video_only / "diffusion_pytorch_model.safetensors"))
    latents, embeds = make_inputs(frames=5, seed=11)
    assert torch.equal(refine(load_refiner(video_only, "cpu", "float32"), latents, embeds),
                       refine(refiner, latents, embeds))


def test_meta_needs_config_json_alone(tiny_dir, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_dir / "config.json", folder / "config.json")
    refiner = load_refiner(folder, device="meta", dtype="bfloat16")
    assert refiner.device.type == "meta" and refiner.info.device == "meta"
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in refiner.model.parameters())
    assert refiner.info.parameters == load_refiner(tiny_dir, "cpu", "float32").info.parameters
    units = RefinerSession(refiner, SessionConfig(block_size=2)).push(*make_inputs(frames=5))  # shapes only
    assert [(u.frame_start, u.frame_end) for u in units] == [(0, 1), (1, 3), (3, 5)]
    assert all(u.latents.device.type == "meta" for u in units)


@pytest.mark.parametrize("breakage, fragment", [("missing", "the weights lack transformer_blocks.0.attn1"),
                                                ("shape", "on disk but")])
def test_weights_that_do_not_fit_the_config_fail_clearly(breakage, fragment, tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / breakage
    shutil.copytree(tiny_dir, folder)
    path = folder / "diffusion_pytorch_model.safetensors"
    weights = load_file(str(path))
    name = "transformer_blocks.0.attn1.to_q.weight"
    if breakage == "missing":
        del weights[name]
    else:
        weights[name] = torch.zeros(3, 3)
    save_file(weights, str(path))
    with pytest.raises(ModelLoadError, match=fragment):
        load_refiner(folder, device="cpu", dtype="float32")


def test_a_whole_pipeline_release_names_the_subfolder_to_pass(tiny_dir, tmp_path, capsys):
    """A downloaded diffusers release is a pipeline folder (model_index.json, one subfolder per component): pointed
    at it, the loaders, `plan` and `serve`'s checks name the subfolder holding the refiner (or the VAE) instead of
    only saying config.json is missing."""
    from app.cli.serve import preflight
    from app.core.settings import Settings
    from models.checkpoints import write_vae_checkpoint
    from models.plan import read_config
    from models.vae import load_vae

    release = tmp_path / "sana-wm-release"
    shutil.copytree(tiny_dir, release / "transformer")
    write_vae_checkpoint(release / "vae", preset="tiny-vae")
    (release / "model_index.json").write_text(json.dumps({
        "_class_name": "SanaWMLTX2Refiner", "transformer": ["diffusers", "SanaWMLTX2RefinerTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLLTX2Video"], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}))
    refiner_hint = f"pass its 'transformer' subfolder, {str(release / 'transformer')!r}"
    vae_hint = f"pass its 'vae' subfolder, {str(release / 'vae')!r}"
    for load, hint in ((lambda: load_refiner(release, "cpu"), refiner_hint),
                       (lambda: read_config(release), refiner_hint),
                       (lambda: preflight(Settings(model=str(release), device="cpu")), refiner_hint),
                       (lambda: preflight(Settings(vae=str(release), device="cpu")), vae_hint),
                       (lambda: load_vae(release, torch.device("cpu"), torch.float32), vae_hint)):
        with pytest.raises(ModelLoadError, match="diffusers pipeline folder") as caught:
            load()
        assert str(caught.value).endswith(hint), caught.value
    # `plan --vae` pointed at the release names the subfolder too (it said only "no config.json there").
    from app.cli.commands import main

    assert main(["plan", "--model", str(release / "transformer"), "--vae", str(release)]) == 2
    assert capsys.readouterr().err.rstrip().endswith(vae_hint)
    # And so does `plan --config` whose settings name the release (it planned diffusers' default architecture, or
    # latents only, as if the folders were not on this machine).
    for setting, hint in (("model", refiner_hint), ("vae", vae_hint)):
        settings = tmp_path / f"{setting}.yaml"
        settings.write_text(f"model: {release / 'transformer'}\n{setting}: {release}\n")
        assert main(["plan", "--config", str(settings)]) == 2
        assert capsys.readouterr().err.rstrip().endswith(hint)
    # The subfolders named load; a folder that is no release gets no hint.
    load_refiner(release / "transformer", "cpu")
    with pytest.raises(ModelLoadError) as caught:
        load_refiner(tmp_path, "cpu")
    assert "pipeline folder" not in str(caught.value)
