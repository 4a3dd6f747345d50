"""The README's first command, ``python -m app serve``, really starts a server that answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from bench.live import free_port

from .conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]


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
    """A wrong device or an empty model folder: one line naming the problem and what to pass instead, exit status
    2, no traceback, and no drain (nothing was served)."""
    import torch

    empty = tmp_path / "empty-model"
    empty.mkdir()
    cases = [(["--model", str(empty)], "has no config.json"), (["--vae", str(tmp_path / "nope")], "does not exist")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "CUDA is not available"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_REFINER_")}
    env.update(WM_REFINER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    for flags, reason in cases:
        done = subprocess.run([sys.executable, "-m", "app", "serve", "--port", str(free_port()), *flags], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)
        output = done.stdout + done.stderr
        assert done.returncode == 2, (flags, output)
        assert output.strip().count("\n") == 0 and output.startswith("error: ") and reason in output, (flags, output)
        assert "Traceback" not in output and "drain" not in output
