"""The README's first command, ``python -m app serve``, really starts a server that answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from bench.live import free_port

from tests.app.conftest import wait_until

ROOT = Path(__file__).resolve().parents[3]


def test_python_m_app_serve_with_defaults_builds_the_tiny_refiner_and_answers(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_REFINER_")}
    env.update(
        WM_REFINER_PORT=str(port),
        WM_REFINER_CACHE_DIR=str(tmp_path / "cache"),
        OMP_NUM_THREADS="1",  # a busy 2-core CI box: no spinning OpenMP workers
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    log = tmp_path / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        base = f"http://127.0.0.1:{port}"

        def answers(path):
            try:
                return httpx.get(base + path, timeout=5).status_code == 200
            except httpx.HTTPError:
                assert process.poll() is None, f"the server exited: {log.read_text()}"
                return False

        wait_until(lambda: answers("/health"), "/health", timeout=120)
        wait_until(lambda: answers("/ready"), "/ready", timeout=120)
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        info = httpx.get(base + "/v1/info").json()
        assert info["model"]["device"] == "cpu" and info["model"]["layers"] == 2
        assert (tmp_path / "cache" / "tiny" / "config.json").is_file()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    # uvicorn shuts down gracefully, then re-raises the signal it caught, so the process ends "by SIGTERM".
    assert code in (0, -signal.SIGTERM), log.read_text()
    assert "Application shutdown complete" in log.read_text()


def test_start_up_failures_are_one_clear_line_and_a_non_zero_exit(tmp_path):
    """A wrong device, an empty model folder or a snapshot_dir that cannot be written: one line naming the problem
    and what to pass instead, exit status 2, no traceback, and no drain (nothing was served)."""
    import torch

    empty = tmp_path / "empty-model"
    empty.mkdir()
    cases = [(["--model", str(empty)], "has no config.json"), (["--vae", str(tmp_path / "nope")], "does not exist"),
             (["--dtype", "half"], "unknown dtype 'half'; use one of ['bfloat16', 'float16'")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "CUDA is not available"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_REFINER_")}
    env.update(WM_REFINER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    (tmp_path / "a-file").write_text("")  # a snapshot_dir under a file cannot be made (even by root, as CI runs)
    snapshots_under_a_file = {"WM_REFINER_SNAPSHOT_DIR": str(tmp_path / "a-file" / "snapshots")}
    cases = [(flags, reason, {}) for flags, reason in cases]
    cases.append(([], "snapshot_dir " + snapshots_under_a_file["WM_REFINER_SNAPSHOT_DIR"] + " cannot be written to",
                  snapshots_under_a_file))
    for flags, reason, extra_env in cases:
        done = subprocess.run([sys.executable, "-m", "app", "serve", "--port", str(free_port()), *flags], cwd=ROOT,
                              env={**env, **extra_env}, capture_output=True, text=True, timeout=120)
        output = done.stdout + done.stderr
        assert done.returncode == 2, (flags, output)
        assert output.strip().count("\n") == 0 and output.startswith("error: ") and reason in output, (flags, output)
        assert "Traceback" not in output and "drain" not in output


def test_settings_given_wrong_are_one_line_naming_the_setting_and_where_it_came_from(tmp_path):
    """A YAML typo, an environment variable that does not parse, one that needs JSON: ``error: ...`` on one line
    (docs/operations.md), naming the file or the variable and what to give instead, not pydantic's report."""
    typo = tmp_path / "typo.yaml"
    typo.write_text("max_sesions: 4\n")
    cases = [
        (["--config", str(typo)], {}, f"error: max_sesions in {typo}: no such setting (did you mean max_sessions?)"),
        ([], {"WM_REFINER_MAX_SESSIONS": "lots"}, "error: $WM_REFINER_MAX_SESSIONS='lots': Input should be a valid integer"),
        ([], {"WM_REFINER_DEFAULT_SIGMAS": "0.9,0.5,0.0"}, "error: $WM_REFINER_DEFAULT_SIGMAS='0.9,0.5,0.0' cannot be "
                                                           "read: from the environment this setting takes JSON"),
    ]
    for flags, extra, start in cases:
        done = subprocess.run([sys.executable, "-m", "app", "serve", "--port", str(free_port()), *flags], cwd=ROOT,
                              env={**_serve_env(tmp_path), **extra}, capture_output=True, text=True, timeout=120)
        output = done.stdout + done.stderr
        assert done.returncode == 2 and output.strip().count("\n") == 0 and output.startswith(start), (flags, output)


def _serve_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_REFINER_")}
    env.update(WM_REFINER_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def test_a_model_folder_whose_config_does_not_fit_its_weights_is_one_line_and_exit_2(tmp_path):
    """Issue 16 item 10: a config.json that does not build the saved refiner (a field changed, mistyped, not JSON)
    is named before anything is loaded: no traceback, exit 2, the field or the cause in the line."""
    import json

    from models.checkpoints import write_checkpoint

    folder = write_checkpoint(tmp_path / "model", preset="tiny")
    config = json.loads((folder / "config.json").read_text())
    cases = [
        ({**config, "num_attention_heads": 3}, "does not match the weights beside it"),  # shapes: [32] vs [48]
        ({**config, "num_layers": "two"}, "does not build a refiner"),
        ("{not json", "is not valid JSON"),
    ]
    for written, reason in cases:
        (folder / "config.json").write_text(written if isinstance(written, str) else json.dumps(written))
        done = subprocess.run([sys.executable, "-m", "app", "serve", "--port", str(free_port()), "--model", str(folder),
                               "--device", "cpu"], cwd=ROOT, env=_serve_env(tmp_path), capture_output=True, text=True,
                              timeout=180)
        output = done.stdout + done.stderr
        assert done.returncode == 2, (reason, output)
        assert output.strip().count("\n") == 0 and output.startswith("error: ") and reason in output, (reason, output)
        assert "config.json" in output and "Traceback" not in output and "startup" not in output


def test_a_busy_port_is_refused_before_the_model_is_built_or_loaded(tmp_path):
    """Issue 16 item 10: the port is taken before the embedded refiner is built, loaded and warmed up, so a busy
    one costs a one-line error (exit 2), not a load first; nothing was built in the cache."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "app", "serve", "--port", str(port), "--device", "cpu"],
                              cwd=ROOT, env=_serve_env(tmp_path), capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert output.strip().count("\n") == 0, output
    assert output.startswith(f"error: port {port} on 127.0.0.1") and "already in use" in output and "--port" in output
    assert not (tmp_path / "cache" / "tiny").exists(), "the embedded refiner was built before the port was checked"


def test_the_embedded_default_keeps_sessions_across_a_restart(tmp_path):
    """Issue 16 item 10: `python -m app serve` with no settings saves its sessions on SIGTERM (under
    cache_dir/snapshots) and the next start continues them, bit-identical to a clip refined in one go."""
    import numpy as np

    from bench.live import ServerProcess
    from wm_refiner_client import Client

    from tests.client.conftest import clip

    latents, prompt, mask = clip(9)
    port, cache = free_port(), tmp_path / "cache"

    def server() -> ServerProcess:
        return ServerProcess(port, cache, None, tmp_path / "server.log").start()

    first = server()
    try:
        with Client(first.base_url) as client:
            session = client.session("kept-across-restart")
            head = session.send(latents[:, :, :5], prompt, mask)  # the sink, [1, 4); frame 4 pending
        assert first.terminate() in (0, -signal.SIGTERM), first.log()
    finally:
        first.kill()
    assert (cache / "snapshots" / "kept-across-restart.session.safetensors").is_file()
    second = server()
    try:
        with Client(second.base_url) as client:
            session = client.get_session("kept-across-restart")
            assert session.state().frames_received == 5
            tail = session.send(latents[:, :, 5:], flush=True)
            expected = client.refine(latents, prompt, mask).latents
        assert np.array_equal(np.concatenate([head.latents, tail.latents], axis=2), expected)
    finally:
        second.terminate()


def test_a_start_up_file_that_fails_to_load_is_an_error_line_not_a_traceback(tmp_path, checkpoint_dir):
    """What only the load itself finds (here a default prompt that is not safetensors) ends the start-up with
    the loader's one-line message and exit 2, without uvicorn's traceback."""
    prompt = tmp_path / "prompt.safetensors"
    prompt.write_bytes(b"not safetensors")
    env = {**_serve_env(tmp_path), "WM_REFINER_DEFAULT_PROMPT": str(prompt), "WM_REFINER_WARMUP": "false"}
    done = subprocess.run([sys.executable, "-m", "app", "serve", "--port", str(free_port()), "--model",
                           str(checkpoint_dir), "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output and "startup failed" not in output, output
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: default_prompt") and "not a readable safetensors file" in last, output


def test_the_embedded_snapshots_on_a_case_insensitive_volume_are_a_warning_not_a_refusal(tmp_path, monkeypatch, caplog):
    """A laptop's cache on a case-insensitive volume (macOS, Windows): `python -m app serve` with no settings used to
    stop (exit 2) over a snapshot_dir the user never set; it serves without saving sessions, saying so. A
    snapshot_dir the operator gave is still refused."""
    import logging

    import pytest

    import app.persistence.records as records
    from app.cli.serve import StartUpError, embedded_defaults, preflight
    from app.core.settings import Settings

    def case_insensitive(folder):
        raise OSError(f"snapshot_dir {folder} is on a case-insensitive file system: ...")

    monkeypatch.setattr(records, "check_snapshot_folder", case_insensitive)
    with caplog.at_level(logging.WARNING, logger="app"):
        settings = embedded_defaults(Settings(cache_dir=tmp_path / "cache"))
    assert settings.snapshot_dir is None
    preflight(settings)  # nothing left to refuse
    assert "sessions are not saved across restarts: snapshot_dir" in caplog.text
    assert "case-insensitive" in caplog.text and "embedded_snapshots: false" in caplog.text
    given = Settings(cache_dir=tmp_path / "cache", snapshot_dir=tmp_path / "mine")
    assert embedded_defaults(given) is given
    with pytest.raises(StartUpError, match="case-insensitive"):
        preflight(given)
    # On a file system that can hold sessions the embedded default keeps them, as before.
    monkeypatch.undo()
    assert embedded_defaults(Settings(cache_dir=tmp_path / "cache")).snapshot_dir == tmp_path / "cache" / "snapshots"
