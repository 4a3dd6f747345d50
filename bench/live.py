"""Real servers on loopback, for the benchmarks, the soak and the tests: one helper for all of them.

- ``ThreadServer``: the service (uvicorn + the app, drain included) on a thread of this process, with its own event
  loop; ``services`` gives the app's internals to a test.
- ``ServerProcess``: ``python -m app serve`` in a subprocess, configured through ``WM_REFINER_*``, its log in a
  file; SIGTERM drains it as in production.

Both wait until ``/ready`` answers 200 before they return, and every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


class ServerFailure(AssertionError):
    """A server that did not start, answer or stop in time (AssertionError: tests report it as a failure)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(base_url: str, deadline_s: float, alive=lambda: True, why=lambda: "", replica: str | None = None) -> None:
    """Until ``base_url`` answers /ready with 200. ``replica``: the ``replica_id`` of the server started for it; a
    port picked by ``free_port`` can be taken by another process before the server binds it, and that process's
    answer (another test's server) must not pass for this one's: it fails here, saying so."""
    deadline = time.monotonic() + deadline_s
    with httpx.Client(base_url=base_url, timeout=5) as http:
        while time.monotonic() < deadline:
            if not alive():
                raise ServerFailure(f"the server stopped before it was ready:\n{why()}")
            try:
                answer = http.get("/ready")
                if replica is not None and answer.headers.get("x-replica") != replica:
                    raise ServerFailure(f"{base_url} answers as replica {answer.headers.get('x-replica')!r}, not "
                                        f"{replica!r}: another process took the port before this server bound it")
                if answer.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise ServerFailure(f"the server was not ready within {deadline_s:.0f} s:\n{why()}")


class ThreadServer:
    """The service on a thread of this process, on 127.0.0.1 and a free port."""

    def __init__(self, settings, ready_timeout: float = 600.0):
        from app.cli.serve import build_server

        self.settings = settings.model_copy(update={"host": "127.0.0.1", "port": free_port()})
        self.server = build_server(self.settings)
        self.port = self.server.config.port
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.ready_timeout = ready_timeout
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="uvicorn", daemon=True)

    def _serve(self) -> None:
        try:
            self.loop.run_until_complete(self.server.serve())
        finally:
            self.loop.close()

    def on_loop(self, coroutine):
        """Start ``coroutine`` on the server's event loop; returns its concurrent future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    @property
    def services(self):
        return self.server.services

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise ServerFailure("uvicorn did not start")
        wait_ready(self.base_url, max(deadline - time.monotonic(), 1.0), self.thread.is_alive,
                   replica=self.settings.replica_id)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 120.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise ServerFailure("uvicorn did not stop")


class ServerProcess:
    """``python -m app serve`` in a subprocess. ``threads`` pins torch's intra-op threads (None: the server's
    default, every core); ``settings`` become ``WM_REFINER_*`` variables."""

    def __init__(self, port: int, cache_dir: Path, snapshot_dir: Path | None, log_path: Path,
                 threads: int | None = 1, **settings: Any):
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.ws_url = f"ws://127.0.0.1:{port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("WM_REFINER_")}
        env.update(
            WM_REFINER_PORT=str(port),
            WM_REFINER_CACHE_DIR=str(cache_dir),
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        if threads is not None:
            env["WM_REFINER_TORCH_THREADS"] = str(threads)
            env["OMP_NUM_THREADS"] = str(threads)  # no idle OpenMP workers spinning against the busy ones
        if snapshot_dir is not None:
            env["WM_REFINER_SNAPSHOT_DIR"] = str(snapshot_dir)
        for name, value in settings.items():
            env[f"WM_REFINER_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self, ready_timeout: float = 120.0) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        # Named per start, as the default is random per process, so that wait_ready knows this process's answer.
        replica = env.setdefault("WM_REFINER_REPLICA_ID", f"test-{secrets.token_hex(6)}")
        with self.log_path.open("a") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        try:
            wait_ready(self.base_url, ready_timeout, lambda: self.process.poll() is None, self.log, replica)
        except ServerFailure:
            self.kill()
            raise
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def rss_bytes(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, AssertionError):
            return None
        return None

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (the drain), then wait for the exit; the exit status."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ServerFailure(f"the server did not exit within {timeout:.0f} s of SIGTERM:\n{self.log()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-6000:]
        except OSError:
            return ""


def metric_samples(text: str, name: str) -> dict[str, float]:
    """The samples of one metric family in Prometheus text (``name{labels}`` -> value)."""
    samples = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples
