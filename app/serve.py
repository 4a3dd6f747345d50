"""``python -m app serve``: settings from YAML + environment + flags, the embedded tiny refiner when no model
is given, and uvicorn with a drain before it closes connections."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import uvicorn

from models.errors import ModelLoadError
from models.loading import resolve_device

from .guards import BodyBudget, GuardedHttpToolsProtocol
from .main import create_app
from .services import Services, ensure_embedded_model
from .settings import Settings, load_settings
from .ws_protocol import GuardedWebSocketProtocol

log = logging.getLogger("app")


class DrainingServer(uvicorn.Server):
    """uvicorn closes every WebSocket with 1012 as soon as its shutdown starts; drain first, so in-flight
    blocks finish and streams are closed by the app with a code and a reason the client can act on."""

    def __init__(self, config: uvicorn.Config, services: Services):
        super().__init__(config)
        self.services = services

    async def shutdown(self, sockets=None) -> None:
        try:
            await self.services.drain()
        except Exception:  # a failed drain must not stop the server from shutting down
            log.exception("drain failed")
        await super().shutdown(sockets)


def build_server(settings: Settings, **uvicorn_options) -> DrainingServer:
    app = create_app(settings)
    guarded = BodyBudget(app, settings.max_inflight_body_bytes, settings.max_body_bytes, settings.retry_after_s)
    # What a client may hold before a route sees its request: head size, time to send head and body (app.guards).
    http = GuardedHttpToolsProtocol.configure(settings.max_header_bytes, settings.request_header_timeout_s,
                                              settings.request_body_timeout_s)
    uvicorn_options.setdefault("http", http)
    # Refused handshakes answered and logged as such, invalid UTF-8 closed quietly with 1007 (app.ws_protocol).
    uvicorn_options.setdefault("ws", GuardedWebSocketProtocol)
    config = uvicorn.Config(
        guarded,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # uvicorn refuses an oversized message itself (close 1009) before buffering all of it.
        ws_max_size=settings.max_ws_message_bytes,
        # Tensors barely compress, and deflating megabytes of video per unit costs more CPU than it saves.
        ws_per_message_deflate=False,
        timeout_graceful_shutdown=settings.drain_timeout_s + 5,
        lifespan="on",
        **uvicorn_options,
    )
    return DrainingServer(config, app.state.services)


def settings_from_args(args: argparse.Namespace) -> Settings:
    flags = {name: getattr(args, name, None) for name in ("model", "vae", "host", "port", "device", "dtype", "api_key")}
    return load_settings(getattr(args, "config", None), **flags)


def preflight(settings: Settings) -> None:
    """What can be checked before uvicorn starts, so that a wrong flag is one clear line (app.cli prints it) and a
    non-zero exit, not a start-up traceback: the device, and that the model and VAE folders hold a config.json."""
    resolve_device(settings.device)
    for name, value, what in (("model", settings.model, "a local refiner folder in diffusers layout, or no --model "
                               "to serve the embedded tiny refiner"),
                              ("vae", settings.vae, "a local AutoencoderKLLTX2Video folder in diffusers layout "
                               "(`python -m app make-checkpoint --preset tiny-vae --out DIR` writes a test one), "
                               "or no --vae")):
        if not value:
            continue
        folder = Path(value).expanduser()
        if not folder.is_dir():
            raise ModelLoadError(f"{name} folder {value!r} does not exist; pass {what}")
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{name} folder {value!r} has no config.json; pass {what}")


def serve_command(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    preflight(settings)
    if not settings.model:
        folder = ensure_embedded_model(settings.embedded_model_dir)
        log.info("no --model given: serving the embedded tiny refiner from %s", folder)
    server = build_server(settings)
    asyncio.run(server.serve())
    # uvicorn reports a failed start-up (e.g. the model did not load) by not starting, not by raising.
    return 0 if server.started else 1
