"""The capacity plan (models.plan, ``python -m app plan``) against what a session really allocates, a hand count of
FLOPs, and the released refiner's plan built without weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.core.values import parse_bytes
from models import RefinerSession, SessionConfig, from_model
from models.checkpoints import PRESETS, build_model
from models.plan import GB, Gpu, Stream, forward_flops, make_plan, meta_model

ROOT = Path(__file__).resolve().parents[2]


def _config(preset: str) -> dict:
    return {"_class_name": "SanaWMLTX2RefinerTransformer3DModel", **PRESETS[preset]}


@pytest.mark.parametrize("preset,positions,latent_hw", [("tiny", "absolute", (4, 3)), ("tiny", "rebased", (4, 3)),
                                                         ("medium", "absolute", (8, 8))])
def test_session_bytes_equal_what_a_session_allocates(preset, positions, latent_hw):
    height, width = latent_hw
    config = SessionConfig(block_size=2, kv_max_frames=6, sink_frames=1, positions=positions)
    refiner = from_model(build_model(preset))
    session = RefinerSession(refiner, config)
    embeds = torch.randn(1, 5, PRESETS[preset]["caption_channels"])
    latents = torch.randn(1, 128, 9, height, width)
    units = list(session.stream(latents, embeds))
    assert [u.kind for u in units][:2] == ["sink", "block"]

    stream = Stream(height=height * 32, width=width * 32, fps=16.0, sink_frames=1, block_size=2, kv_max_frames=6,
                    steps=config.steps, prompt_tokens=5, positions=positions)
    plan = make_plan(_config(preset), stream, torch.float32, [Gpu(GB, None)])
    kv = session.kv
    assert plan.session["kv_total"] == session.cache_bytes
    assert plan.session["kv_window"] == kv.window.nbytes
    assert plan.session["kv_sink_keys"] == kv.sink_key.nbytes
    assert plan.session["kv_rebased_history_keys"] == (0 if kv.history_key is None else kv.history_key.nbytes)
    assert (plan.session["kv_rebased_history_keys"] > 0) == (positions == "rebased")
    assert plan.session["prompt"] == session._prepared_prompt().kv.nbytes
    # The formula docs/capacity.md states: K and V over (kv_max_frames + block) frames, plus the sink's keys.
    layers, inner, tokens = PRESETS[preset]["num_layers"], refiner.info.inner_dim, height * width
    formula = 2 * layers * (6 + 2) * tokens * inner * 4 + layers * 1 * tokens * inner * 4
    if positions == "rebased":
        formula += layers * (6 - 1 + 2) * tokens * inner * 4
    assert session.cache_bytes == formula
    assert plan.weights["parameters"] == sum(p.numel() for p in refiner.model.parameters())


def test_flops_equal_a_hand_count_for_the_tiny_refiner():
    # tiny: 2 layers, D = 2 x 16 = 32, FF 4D = 128, caption and cross-attention 32, 128 latent channels, timestep
    # embedding 256 -> D -> D then 6D modulation. A block of 3 frames of 4x4 latents: n = 48 queries, the window
    # of kv_max_frames 11 + 3 = 14 frames: m = 224 keys; prompt p = 8 tokens; batch 1.
    n, m, p, d, ff, c = 48, 224, 8, 32, 128, 128
    proj_in_out = 2 * n * c * d * 2  # 786,432
    time_embedding = 2 * (256 * d + d * d + d * 6 * d)  # once per row: 30,720
    per_layer = (
        4 * 2 * n * d * d  # attn1 q, k, v, out: 393,216
        + 2 * 2 * n * m * d  # attn1 QK^T and AV: 1,376,256
        + 2 * 2 * n * d * d  # attn2 q, out over the block: 196,608 (its k, v over the prompt: once per prompt)
        + 2 * 2 * n * p * d  # attn2 QK^T and AV: 49,152
        + 2 * 2 * n * d * ff  # FF up and down: 786,432
    )
    expected = proj_in_out + time_embedding + 2 * per_layer
    assert expected == 6_420_480

    model = meta_model(_config("tiny"))
    counted = forward_flops(model, batch=1, queries=n, keys=m, prompt_tokens=p)
    assert counted["total"] == expected
    assert counted["self_attn_scores"] == 2 * 2 * 2 * n * m * d
    assert counted["feed_forward"] == 2 * 2 * 2 * n * d * ff

    plan = make_plan(_config("tiny"), Stream(height=128, width=128, block_size=3, kv_max_frames=11, prompt_tokens=8),
                     torch.float32, [Gpu(GB, 1e-6)])
    assert plan.flops_forward["total"] == expected
    assert plan.flops_block["total"] == 4 * expected  # 3 denoising forwards + 1 commit
    assert plan.block_seconds == 3 * 8 / 16.0
    assert plan.gpus[0]["sessions_by_compute"] == int(1e6 // (4 * expected / 1.5))


def test_memory_and_compute_columns():
    # 10 GB of memory, the tiny model: sessions by memory = (memory - weights - workspace - reserve) // session.
    plan = make_plan(_config("tiny"), Stream(height=128, width=128), torch.float32,
                     [Gpu(10 * GB, 1.0, "x"), Gpu(20 * GB, None, "y")], reserve_bytes=parse_bytes("1GiB"))
    x, y = plan.gpus
    free = 10 * GB - plan.weights["bytes"] - plan.workspace_bytes - 2**30
    assert x["sessions_by_memory"] == free // plan.session["total"]
    assert y["sessions_by_memory"] > x["sessions_by_memory"]
    assert x["sessions"] == min(x["sessions_by_memory"], x["sessions_by_compute"])
    assert "sessions_by_compute" not in y


@pytest.mark.parametrize("text,value", [("141GiB", 141 * 2**30), ("80GB", 80 * 10**9), ("192e9", 192 * 10**9)])
def test_sizes(text, value):
    assert parse_bytes(text) == value


def test_bad_geometry_says_what_to_send():
    with pytest.raises(Exception, match="multiple of the VAE's 32x32"):
        make_plan(_config("tiny"), Stream(height=100, width=128), torch.float32, [])


def test_the_released_refiner_is_planned_without_weights():
    """`python -m app plan --config configs/sana-wm.yaml` builds the 19 B-parameter refiner on meta: a few hundred
    MB of this process at most (the weights alone are 35 GiB in bf16)."""
    # The child reports its own peak resident size: VmHWM of its own memory map. (Not getrusage's ru_maxrss: Linux
    # carries the forking parent's resident size into it across exec, so under a big test runner it says GBs.)
    script = ("import re, sys; from pathlib import Path; from app.cli.commands import main; "
              "code = main(['plan', '--config', 'configs/sana-wm.yaml', '--json', '--tflops', '400']); "
              "print(re.search(r'VmHWM:\\s+(\\d+) kB', Path('/proc/self/status').read_text()).group(1), file=sys.stderr); "
              "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    peak_kib = int(done.stderr.strip().splitlines()[-1])
    assert peak_kib < 2 * 1024 * 1024  # < 2 GiB resident
    plan = json.loads(done.stdout)
    # Loaded: the video path (13.04 B); the checkpoint also holds the audio branch (18.88 B in all).
    assert 13.0e9 < plan["weights"]["parameters"] < 13.1e9 and plan["dtype"] == "bfloat16"
    assert 18.8e9 < plan["weights"]["checkpoint_parameters"] < 18.9e9
    assert plan["geometry"]["tokens_per_frame"] == 40 * 22 == 880
    layers, inner = 48, 4096
    window = 2 * layers * (11 + 3) * 880 * inner * 2
    assert plan["session"]["kv_window"] == window
    assert plan["session"]["kv_total"] == window + layers * 880 * inner * 2
    assert plan["block_seconds"] == 1.5
    assert [g["name"] for g in plan["gpus"]] == ["H100", "H200", "B200"]
    assert all(g["sessions_by_compute"] >= 1 for g in plan["gpus"])


def test_the_video_decoder_state_equals_a_real_decoders_over_the_same_blocks():
    """The plan streams blocks through the VAE's decoder built on meta; a real tiny VAE streaming the same blocks
    holds exactly as many bytes at its largest."""
    from models.checkpoints import build_vae
    from models.vae import StreamingDecoder

    vae = build_vae("tiny-vae")
    stream = Stream(height=4 * 32, width=3 * 32, block_size=2, kv_max_frames=6)
    plan = make_plan(_config("tiny"), stream, torch.float32, [Gpu(GB, None)], vae_config=dict(vae.config))
    decoder = StreamingDecoder(vae)
    state, largest, pushed = decoder.new_state(), 0, 0
    generator = torch.Generator().manual_seed(0)
    while pushed < decoder.lookahead + 4 * 2 + 1:
        frames = 1 if pushed == 0 else 2
        state, _ = decoder.push(state, torch.randn(1, 128, frames, 4, 3, generator=generator))
        largest, pushed = max(largest, state.nbytes), pushed + frames
    assert largest > 0 and plan.session["video_decoder_state"] == largest
    assert plan.session["total"] == plan.session["kv_total"] + plan.session["prompt"] + largest
    assert plan.weights["vae_bytes"] == sum(p.numel() for p in vae.parameters()) * 4


def test_the_compute_column_keeps_back_what_realtime_admission_keeps_back(tmp_path, capsys):
    # The column spent all of the assumed rate while a server with admission: realtime admits real-time sessions
    # only up to admission_max_load (0.9) of it: at 10.5 sessions' worth of rate it said 10 where the server holds 9.
    stream = Stream(height=128, width=128)
    per_session = make_plan(_config("tiny"), stream, torch.float32, []).flops_per_second_per_session
    gpu = Gpu(GB, 10.5 * per_session / 1e12)
    assert make_plan(_config("tiny"), stream, torch.float32, [gpu]).gpus[0]["sessions_by_compute"] == 10
    assert make_plan(_config("tiny"), stream, torch.float32, [gpu], max_load=0.9).gpus[0]["sessions_by_compute"] == 9
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        make_plan(_config("tiny"), stream, torch.float32, [gpu], max_load=1.5)
    # The command takes the settings' share when they admit by real-time load, all of the rate otherwise.
    from app.cli.commands import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_config("tiny")))
    cases = (("realtime", [], 0.8), ("none", [], 1.0), ("realtime", ["--max-load", "0.5"], 0.5))
    for admission, flags, expected in cases:
        settings = tmp_path / f"{admission}.yaml"
        settings.write_text(f"model: {model}\nadmission: {admission}\nadmission_max_load: 0.8\n")
        assert main(["plan", "--config", str(settings), "--json", "--tflops", "1", "--height", "128", "--width", "128",
                     *flags]) == 0
        assert json.loads(capsys.readouterr().out)["max_load"] == expected


def test_plan_takes_a_model_folder_besides_the_settings_as_serve_does(tmp_path, capsys):
    # `serve --config configs/sana-wm.yaml --model DIR` is how operations.md serves weights kept elsewhere; `plan`
    # refused the same pair ("argument --model: not allowed with argument --config").
    from app.cli.commands import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_config("tiny")))
    settings = tmp_path / "settings.yaml"
    settings.write_text("model: /nowhere/sana-wm-refiner\nwarmup_height: 8\nwarmup_width: 6\ndtype: float32\n"
                        "default_block_size: 2\n")
    assert main(["plan", "--config", str(settings), "--model", str(model), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["source"] == f"{model} (settings from {settings})"
    assert plan["weights"]["parameters"] == sum(p.numel() for p in meta_model(_config("tiny")).parameters())
    assert (plan["stream"]["height"], plan["stream"]["width"], plan["stream"]["block_size"]) == (256, 192, 2)
    assert plan["dtype"] == "float32"
    # Neither: one line saying what to give.
    assert main(["plan"]) == 2
    assert "plan needs --model DIR (a refiner folder), --config FILE" in capsys.readouterr().err
