"""Fixtures for the service: a tiny refiner folder, apps in-process and behind a real uvicorn on loopback,
payload helpers, and diffusers' reference pipeline."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from app.api.factory import create_app
from app.core.codec import decode_response
from app.core.settings import Settings
from bench.live import ThreadServer
from models import SessionConfig, load_refiner, refine_clip
from models.checkpoints import write_checkpoint
from tests.reference import reference_refine as reference_pipeline

# Every wait in these tests polls until a deadline; the deadline only bounds a broken run.
DEADLINE_S = 60.0
OCTET = {"content-type": "application/octet-stream"}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-refiner"), preset="tiny")


@pytest.fixture(scope="session")
def refiner(checkpoint_dir):
    """A refiner of our own for expected values; the apps load theirs on their engine threads."""
    return load_refiner(checkpoint_dir, device="cpu", dtype="float32")


@pytest.fixture
def make_settings(checkpoint_dir, tmp_path):
    def make(**overrides) -> Settings:
        values = dict(model=str(checkpoint_dir), device="cpu", dtype="float32", cache_dir=tmp_path / "cache")
        values.update(overrides)
        return Settings(**values)

    return make


def metric_value(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus text exposition (``/metrics``)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_until(predicate, what: str, timeout: float = DEADLINE_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


class EngineHold:
    """Occupies the engine thread until released, so work submitted meanwhile provably waits in its queue."""

    def __init__(self):
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> None:
        self.started.set()
        self.release.wait(DEADLINE_S)

    def wait_started(self) -> None:
        assert self.started.wait(DEADLINE_S), "the engine never picked up the hold"


def wait_ready(client) -> None:
    wait_until(lambda: client.get("/ready").status_code == 200, "/ready to answer 200")


@contextlib.contextmanager
def running_app(settings: Settings, **kwargs) -> Iterator[TestClient]:
    """The app in-process (lifespan included), ready."""
    with TestClient(create_app(settings, **kwargs)) as client:
        wait_ready(client)
        yield client


@pytest.fixture
def client(make_settings):
    with running_app(make_settings()) as client:
        yield client


# --- a real server on loopback ---------------------------------------------------------------------------------
# The benchmarks' and the soak's helper: uvicorn + the app on a thread of this process, ready when returned.
LiveServer = ThreadServer


@pytest.fixture
def live_server(make_settings):
    with LiveServer(make_settings()) as server:
        yield server


# --- behind a reverse proxy ------------------------------------------------------------------------------------
# docs/api.md "Behind a reverse proxy": the server mounted under a path prefix, as a site serves it beside others.
NGINX = "/usr/sbin/nginx"
NGINX_CONF = """user {user};
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
  map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
  server {{
    listen 127.0.0.1:{port};
{locations}
    location / {{ return 404; }}  # the rest of the site is another app's: nothing of this server's is at the root
  }}
}}
"""
NGINX_LOCATION = """    location {prefix} {{
      proxy_pass http://127.0.0.1:{upstream}/;
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header Host $http_host;
      proxy_redirect http://$http_host/ {prefix};
      client_max_body_size 64m;
    }}"""


@contextlib.contextmanager
def nginx_prefix(upstream_port: int, workdir: Path, prefix: str = "/refiner/") -> Iterator[str]:
    """Debian's nginx on a free loopback port, serving the server on ``upstream_port`` under ``prefix`` (the
    docs' configuration: WebSocket upgrade passed on, the client's Host kept, the server's redirects brought back
    under the prefix); yields the prefix's URL, without its trailing slash. The server itself knows nothing of the
    prefix."""
    with nginx_prefixes({prefix: upstream_port}, workdir) as urls:
        yield urls[prefix]


@contextlib.contextmanager
def nginx_prefixes(upstreams: dict[str, int], workdir: Path) -> Iterator[dict[str, str]]:
    """``nginx_prefix`` for several servers on one origin, each under its prefix (``upstreams``: prefix -> port), as
    a site serves several apps; yields each prefix's URL."""
    import getpass
    import subprocess

    import httpx

    from bench.live import free_port

    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    locations = "\n".join(NGINX_LOCATION.format(prefix=prefix, upstream=upstream)
                           for prefix, upstream in upstreams.items())
    # user: the one running the tests (root in CI, whose workers would otherwise be nobody, locked out of workdir).
    conf.write_text(NGINX_CONF.format(user=getpass.getuser(), dir=workdir, port=port, locations=locations))
    process = subprocess.Popen([NGINX, "-p", str(workdir), "-c", str(conf), "-g", "daemon off;"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    urls = {prefix: f"http://127.0.0.1:{port}{prefix.rstrip('/')}" for prefix in upstreams}

    def answers() -> bool:
        assert process.poll() is None, (workdir / "error.log").read_text()
        try:
            return all(httpx.get(f"{url}/health", timeout=5).status_code == 200 for url in urls.values())
        except httpx.TransportError:
            return False

    try:
        wait_until(answers, "nginx in front of the servers")
        yield urls
    finally:
        process.terminate()
        process.wait(DEADLINE_S)


# --- payloads ----------------------------------------------------------------------------------------------
def make_clip(frames: int = 11, height: int = 4, width: int = 4, prompt_len: int = 6, seed: int = 0, mask=True):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 128, frames, height, width, generator=generator)  # (B, C, T, H, W)
    embeds = torch.randn(1, prompt_len, 32, generator=generator)  # (B, L, D)
    attention = None
    if mask:
        attention = torch.ones(1, prompt_len, dtype=torch.int64)
        attention[:, -2:] = 0  # padding tokens, so a mask that is ignored changes the result
    return latents, embeds, attention


def payload(latents=None, embeds=None, mask=None, **extra) -> bytes:
    tensors = {}
    if latents is not None:
        tensors["latents"] = latents.contiguous()
    if embeds is not None:
        tensors["prompt_embeds"] = embeds.contiguous()
    if mask is not None:
        tensors["prompt_attention_mask"] = mask.contiguous()
    tensors.update(extra)
    return save(tensors)


def read_latents(data: bytes) -> tuple[torch.Tensor, dict[str, str]]:
    tensors, metadata = decode_response(data)
    return tensors["latents"], metadata


def expected_clip(refiner, latents, embeds, mask=None, **config) -> torch.Tensor:
    return refine_clip(refiner, latents, embeds, mask, SessionConfig(**config))


def reference_refine(checkpoint_dir, latents, embeds, mask=None, *, seed=42, fps=16.0, sink_frames=1,
                     block_size=3, kv_max_frames=11) -> torch.Tensor:
    """diffusers' ``SanaWMLTX2Refiner.__call__`` on its own model instance loaded from ``checkpoint_dir``."""
    from diffusers import SanaWMLTX2RefinerTransformer3DModel

    model = SanaWMLTX2RefinerTransformer3DModel.from_pretrained(str(checkpoint_dir), low_cpu_mem_usage=False)
    return reference_pipeline(model, latents, embeds, mask, seed=seed, fps=fps, sink=sink_frames, block=block_size,
                              kv_max=kv_max_frames)


def session_state(client, session_id: str) -> dict:
    """The session's state without its timestamps (which every request moves)."""
    response = client.get(f"/v1/sessions/{session_id}")
    assert response.status_code == 200, response.text
    state = response.json()
    state.pop("last_active_at")
    return state


def raw_websocket(host: str, port: int, path: str, *, options: tuple[tuple[int, int], ...] = ()):
    """A WebSocket opened by hand (the sans-I/O protocol of websockets over a plain socket), for a client that
    misbehaves as no library lets one: never reads, floods pings. ``options``: (name, value) of ``SOL_SOCKET``
    options set before it connects. Returns (the socket, the protocol)."""
    import socket

    from websockets.client import ClientProtocol
    from websockets.uri import parse_uri

    client = ClientProtocol(parse_uri(f"ws://{host}:{port}{path}"))
    sock = socket.socket()
    for name, value in options:
        sock.setsockopt(socket.SOL_SOCKET, name, value)
    sock.settimeout(DEADLINE_S)
    sock.connect((host, port))
    client.send_request(client.connect())
    sock.sendall(b"".join(client.data_to_send()))
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 101"), head[:200]
    client.receive_data(head)  # the 101 opens the client's side
    return sock, client
