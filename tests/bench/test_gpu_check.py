"""``bash bench/gpu_check.sh --smoke OUT``: the GPU check's own script and measurement code run on the CPU with the
tiny preset, so neither can rot between GPU loans. Asserts every section produced its figures, each named with a
unit, and that no section failed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from bench.gpu import STEP_MODES, recommend

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("startup", "blocks", "memory", "realtime", "parity", "decode", "park", "attention", "step_modes")
# A figure's name ends with its unit; a few are words or lists (what ran) rather than quantities.
UNIT = re.compile(r"_(s|ms|bytes|fps|count|ratio|sessions)$")
WORDS = {"latent_height_width", "compared", "ops", "kernels", "flash_ran", "fps", "max_abs", "reference_rms",
         "geometry", "recommended_mode", "compile_step", "compile_mode", "skipped", "mode_errors",
         "recommended_compile_buckets", "compile_buckets"}


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-check")
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--smoke", str(out)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, (result.stdout[-3000:], (out / "bench.txt").read_text()[-3000:])
    assert (out / "summary.md").read_text().startswith("# GPU check (smoke")
    return out


@pytest.fixture(scope="module")
def summary(smoke_out) -> dict:
    return json.loads((smoke_out / "summary.json").read_text())


def test_the_served_check_loads_from_disk_serves_over_http_and_drains(smoke_out):
    """``bench/gpu_serve.py`` as the smoke runs it: a server started from a checkpoint written to disk, ready, the
    quickstart's three paths identical, a stream's blocks timed by the server, /metrics, the drain; its log kept."""
    served = json.loads((smoke_out / "serve.json").read_text())
    assert served["errors"] == {}, served["errors"]
    assert served["checkpoint"]["bytes"] > 0 and served["startup"]["ready_s"] > 0
    assert served["startup"]["engine"]["step"]["mode"] == "eager" and served["startup"]["warmup_s"] is not None
    assert served["quickstart"]["exit_status"] == 0
    latencies = served["stream"]["block_latency_s"]
    assert len(latencies) == 3 and all(value > 0 for value in latencies)
    assert served["metrics"]["refiner_samples_count"] > 100
    assert served["metrics"]["compile_failed"] == {"refiner_compile_failed": 0.0}
    assert served["drain"]["exit_status"] in (0, -15)  # drained: uvicorn's exit, or SIGTERM's own after the drain
    assert "compiled_startup" not in served  # --no-compiled-startup in the smoke: a minute of compiling on a CPU
    log = (smoke_out / "serve-log.txt").read_text()
    assert log.startswith("===== the server") and "warm-up done" in log


def _figures(figures: dict, prefix=""):
    for key, value in figures.items():
        if isinstance(value, dict):
            yield from _figures(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", key, value


def test_every_section_ran_without_error(summary):
    assert summary["errors"] == {}
    assert set(summary["sections"]) == set(SECTIONS)
    assert summary["mode"] == "smoke" and summary["machine"]["cpu"]
    # The step modes ran in a process of their own (as on the loan) and added to the first one's summary.
    assert {"startup_s", "startup_again_s", "step_modes_s", "total_s", "total_again_s"} <= set(summary["seconds"])


def test_every_figure_is_named_with_its_unit(summary):
    for section, figures in summary["sections"].items():
        for path, key, _ in _figures(figures):
            assert UNIT.search(key) or key in WORDS, f"{section}.{path}: no unit in its name"
    assert all(key.endswith("_s") for key in summary["seconds"])


def test_the_figures_are_the_ones_asked_for(summary):
    s = summary["sections"]
    assert 0 < s["startup"]["build_s"] <= s["startup"]["ready_s"]
    blocks = s["blocks"]["tiny"]
    for count in (1, 2):
        for mode in ("batched", "solo"):
            assert blocks[f"{mode}_{count}_sessions_block_s"] > 0
    assert s["memory"]["tiny_session_bytes"] > 0
    assert s["realtime"]["block_playback_s"] == 1.5  # 3 latent frames x 8 pixel frames at 16 fps
    assert s["realtime"]["tiny_measured_sessions"] >= 0
    # bf16 against fp32 with the same weights: close, not equal.
    assert 0 < s["parity"]["relative_rms_ratio"] < 0.05
    assert s["decode"]["frames_per_second_fps"] > 0 and s["decode"]["pixel_frames_count"] > 0
    assert s["park"]["session_bytes"] > 0 and s["park"]["park_ms"] >= 0 and s["park"]["lock_host_ms"] >= 0
    assert any("attention" in op for op in s["attention"]["ops"])
    modes = s["step_modes"]
    assert modes["geometry"] == "tiny" and modes["mode_errors"] == []
    for mode in ("eager", "compiled"):
        assert modes[mode]["batched_2_sessions_block_s"] > 0  # the smoke measures 2 sessions batched (the GPU: 1, 4)
    compiled = modes["compiled"]
    assert compiled["graphs_compiled_count"] > 0 and compiled["compile_s"] > 0  # it really compiled
    assert modes["eager"]["graphs_compiled_count"] == 0
    assert compiled["speedup_2_sessions_ratio"] == pytest.approx(
        modes["eager"]["batched_2_sessions_block_s"] / compiled["batched_2_sessions_block_s"])
    # On the CPU no CUDA graphs: graphed is skipped, with the reason, not measured under another name.
    graphed = modes["graphed"]
    assert graphed["batched_2_sessions_block_s"] is None and graphed["speedup_2_sessions_ratio"] is None
    assert len(modes["skipped"]) == 1 and modes["skipped"][0].startswith("graphed: CUDA graphs need a CUDA device")
    assert modes["recommended_mode"] == recommend(modes, (2,)) != "graphed"
    # What padding costs (compile_buckets): 1 row exact against 1 row padded to 2 (the GPU: 3 rows and 3 as 4).
    padding = modes["padding"]
    assert (padding["rows_count"], padding["padded_to_count"]) == (1, 2)
    assert padding["padded_over_exact_ratio"] == pytest.approx(padding["padded_block_s"] / padding["exact_block_s"])
    assert padding["recommended_compile_buckets"] == ("every" if padding["padded_over_exact_ratio"] >= 1.05
                                                      else "powers")
    settings = STEP_MODES[modes["recommended_mode"]]
    if settings["compile_step"]:
        settings = {**settings, "compile_buckets": padding["recommended_compile_buckets"]}
    assert modes["recommended_settings"] == settings


def _modes(**blocks):
    """Step-mode figures from ``mode=(1-session s, 4-session s)`` (None: not measured)."""
    return {mode: {"batched_1_sessions_block_s": None if t is None else t[0],
                   "batched_4_sessions_block_s": None if t is None else t[1]} for mode, t in blocks.items()}


def test_the_recommended_mode_steps_up_only_for_a_margin_at_every_count():
    counts = (1, 4)
    # Launch-bound: graphs pay at both counts.
    assert recommend(_modes(eager=(0.5, 1.6), compiled=(0.4, 1.4), graphed=(0.3, 1.3)), counts) == "graphed"
    # Graphs within 5% of compiled: the simpler mode.
    assert recommend(_modes(eager=(0.5, 1.6), compiled=(0.4, 1.4), graphed=(0.39, 1.35)), counts) == "compiled"
    # Faster at one count, slower at the other (the peers' 2-3% loss): eager.
    assert recommend(_modes(eager=(0.5, 1.6), compiled=(0.3, 1.65), graphed=(0.3, 1.62)), counts) == "eager"
    # Graphs beat eager by the margin although compiled does not: graphed.
    assert recommend(_modes(eager=(0.5, 1.6), compiled=(0.49, 1.6), graphed=(0.3, 1.0)), counts) == "graphed"
    # A mode with a figure missing (skipped, failed) is never recommended; nor anything without eager's figures.
    assert recommend(_modes(eager=(0.5, 1.6), compiled=(0.2, None), graphed=None), counts) == "eager"
    assert recommend(_modes(eager=None, compiled=(0.2, 0.8), graphed=(0.1, 0.4)), counts) == "eager"


def _check(tmp_path, *args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(["bash", "bench/gpu_check.sh", *args, str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)


def test_a_module_the_check_needs_that_does_not_import_stops_it_in_seconds(tmp_path):
    # The GPU machine brings its own Python and packages; a wheel missing from --wheels must cost seconds, not the
    # loan: the check imports everything first and names what failed. Stand-ins that shadow two real packages:
    shadow = tmp_path / "shadow"
    (shadow / "fastapi").mkdir(parents=True)
    (shadow / "fastapi" / "__init__.py").write_text("raise ImportError('no fastapi on this machine')\n")
    (shadow / "diffusers").mkdir()
    (shadow / "diffusers" / "__init__.py").write_text("__version__ = '0.30.0'\n")
    result = _check(tmp_path, "--smoke", env_extra={"PYTHONPATH": str(shadow)})
    assert result.returncode == 1, result.stdout[-2000:]
    assert "fastapi: ImportError: no fastapi on this machine" in result.stdout
    assert "no SanaWMLTX2RefinerTransformer3DModel" in result.stdout
    assert "a module the check needs does not import" in result.stdout
    assert not (tmp_path / "out" / "bench.txt").exists()  # nothing long started


def test_a_wheels_folder_without_its_list_is_refused_before_pip_runs(tmp_path):
    (tmp_path / "wheels").mkdir()
    result = _check(tmp_path, "--wheels", str(tmp_path / "wheels"), "--smoke")
    assert result.returncode == 1
    assert "has no requirements.txt (fill it with bench/gpu_wheels.sh)" in result.stdout
    assert not (tmp_path / "out" / "install.txt").exists()


def test_a_step_with_no_time_left_before_the_deadline_is_skipped_and_named(tmp_path):
    # The loan's run must end inside the device's timeout whatever each step takes (their own bounds add up to more):
    # past --deadline-s no step starts, each is named, and the run says it failed.
    result = _check(tmp_path, "--smoke", "--deadline-s", "1")
    assert result.returncode == 1, result.stdout[-2000:]
    bench = (tmp_path / "out" / "bench.txt").read_text()
    for step in ("bench gpu", "bench gpu step_modes"):
        assert f"== {step}: skipped, " in bench and "before the script's deadline (--deadline-s 1)" in bench
    assert not (tmp_path / "out" / "summary.json").exists()  # nothing was measured


def _wheel(folder: Path, name: str, version: str, init: str) -> None:
    """A minimal pure-Python wheel holding one package ``name`` whose ``__init__`` is ``init``."""
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", init)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def test_when_pip_refuses_the_wheels_only_what_the_machine_lacks_goes_on_the_path(tmp_path):
    # The fallback when pip's resolver refuses the folder's pins beside the machine's packages: a wheel of a project
    # the machine already has must not shadow the machine's copy (a rehearsal under the GPU image's packages met the
    # folder's huggingface-hub 2.x shadowing the image's 1.x, which its transformers refuses: diffusers failed to
    # import and the check stopped). Here the folder's packaging would break diffusers' import if it were used.
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("wmr-not-in-the-folder==1.0\n")  # the resolver fails on it
    _wheel(wheels, "packaging", "0.0.1", "raise ImportError('the folder shadowed this machine')\n")
    _wheel(wheels, "wmr_lacking", "1.0", "")
    result = _check(tmp_path, "--install-only", "--wheels", str(wheels))
    install = (tmp_path / "out" / "install.txt").read_text()
    assert result.returncode == 0, (result.stdout[-2000:], install[-2000:])
    assert "what the machine lacks goes on PYTHONPATH" in result.stdout
    assert "kept this machine's packaging" in install
    assert f"on PYTHONPATH from {wheels}: wmr_lacking-1.0-py3-none-any.whl" in result.stdout
    assert "imports: all present" in result.stdout
    assert not (tmp_path / "out" / "bench.txt").exists()  # --install-only: nothing measured


def test_a_run_killed_during_the_step_modes_keeps_the_modes_it_measured(monkeypatch):
    """summary.json is written after each mode, not only after the section: a kill in a mode's compile (the loan's
    end, a compiler crash) keeps the modes before it and a recommendation from them. Graphed is measured before
    compiled (on a CPU it is skipped, with its reason)."""
    import copy

    import torch

    from bench import gpu

    ctx = gpu.Context(gpu.SMOKE, torch.device("cpu"), torch.float32)
    ctx.refiner = gpu.random_refiner(gpu.SMOKE["config"], ctx.device, ctx.dtype)
    saved = []
    ctx.save = lambda name, figures: saved.append((name, copy.deepcopy(figures)))
    measured = []
    real = gpu._measure_mode

    def measure(ctx, sessions, mode, counts, blocks):
        measured.append(mode)
        if mode == "compiled":
            raise KeyboardInterrupt  # what a kill looks like to the section: nothing it catches
        return real(ctx, sessions, mode, counts, blocks)

    monkeypatch.setattr(gpu, "_measure_mode", measure)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        gpu.section_step_modes(ctx)
    assert measured == ["eager", "compiled"] and gpu.MEASURE_ORDER == ("eager", "graphed", "compiled")
    name, last = saved[-1]
    assert name == "step_modes" and last["partial"] and "compiled" not in last
    assert last["eager"]["batched_2_sessions_block_s"] > 0 and last["graphed"]["batched_2_sessions_block_s"] is None
    assert last["recommended_mode"] == "eager" and last["recommended_settings"] == {"compile_step": False}
    assert last["skipped"] == ["graphed: CUDA graphs need a CUDA device (on a CPU reduce-overhead compiles as "
                               "compiled does)"]


def test_the_random_vae_has_its_configs_normalisation_not_garbage():
    """``to_empty`` leaves buffers uninitialised; the VAE's latent mean and std get the constructor's values."""
    import torch

    from bench.gpu import random_vae
    from models.checkpoints import VAE_PRESETS

    vae = random_vae(VAE_PRESETS["tiny-vae"], torch.device("cpu"), torch.float32)
    buffers = dict(vae.named_buffers())
    assert set(buffers) == {"latents_mean", "latents_std"}
    assert torch.equal(buffers["latents_mean"], torch.zeros(128)) and torch.equal(buffers["latents_std"], torch.ones(128))
