"""``python -m app serve``: settings from YAML + environment + flags, the embedded tiny refiner when no model
is given, and uvicorn with a drain before it closes connections.

Start-up order: everything that can be wrong with what the operator gave (the device, the model and VAE folders,
their config against their weights' shapes, the port) is checked before the model is loaded and warmed up, so a
mistake is one line on stderr and exit status 2 within a second, not a traceback after the load."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import socket
from pathlib import Path

import uvicorn

from models.errors import ModelLoadError
from models.loading import (SUPPORTED_CLASSES, VAE_CLASS, WEIGHTS, WEIGHTS_INDEX, pipeline_hint, read_config_file,
                            resolve_device, resolve_dtype)

from app.api.factory import create_app
from app.api.guards import BodyBudget, GuardedHttpToolsProtocol
from app.api.uvicorn_websocket import GuardedWebSocketProtocol
from app.core.settings import ENV_PREFIX, Settings, load_settings
from app.runtime.services import Services, ensure_embedded_model

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
    guarded = BodyBudget(app, settings.max_inflight_body_bytes, settings.max_body_bytes, settings.retry_after_s,
                         gauge=app.state.services.metrics.request_body_bytes_in_flight)
    # What a client may hold before a route sees its request: head size, time to send head and body (app.api.guards).
    http = GuardedHttpToolsProtocol.configure(settings.max_header_bytes, settings.request_header_timeout_s,
                                              settings.request_body_timeout_s)
    uvicorn_options.setdefault("http", http)
    # Refused handshakes answered and logged as such, invalid UTF-8 closed quietly with 1007, a client that does
    # not read is not read either (app.api.uvicorn_websocket).
    # Messages still arriving count against max_inflight_body_bytes with the bodies (one budget), and have the time a
    # body has to arrive.
    uvicorn_options.setdefault("ws", GuardedWebSocketProtocol.configure(
        settings.ws_max_write_buffer_bytes, guarded, settings.request_body_timeout_s))
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
        # X-Forwarded-For only from the proxies named (a router with `option forwardfor`); none by default.
        proxy_headers=settings.forwarded_allow_ips is not None,
        forwarded_allow_ips=settings.forwarded_allow_ips or "",
        **uvicorn_options,
    )
    return DrainingServer(config, app.state.services)


def settings_from_args(args: argparse.Namespace) -> Settings:
    flags = {name: getattr(args, name, None) for name in ("model", "vae", "host", "port", "device", "dtype", "api_key")}
    return load_settings(getattr(args, "config", None), **flags)


class StartUpError(RuntimeError):
    """Something the operator gave cannot be served (the message says what to give instead): one line, exit 2."""


class PortInUseError(StartUpError):
    """The address to listen on is taken (or not this host's): the operator picks another."""


def preflight(settings: Settings) -> None:
    """What can be checked before uvicorn starts, so that a wrong flag is one clear line (app.cli.commands prints it) and a
    non-zero exit, not a start-up traceback: the device and the dtype, that the model and VAE folders hold a
    config.json, that the model's config builds a refiner whose parameters have the shapes of the weights on disk,
    and that snapshot_dir can hold sessions (``check_snapshot_folder``: writable, case-sensitive)."""
    resolve_dtype(settings.dtype, resolve_device(settings.device))
    for name, value, what, classes in (
            ("model", settings.model, "a local refiner folder in diffusers layout, or no --model to serve the "
             "embedded tiny refiner", SUPPORTED_CLASSES),
            ("vae", settings.vae, "a local AutoencoderKLLTX2Video folder in diffusers layout (`python -m app "
             "make-checkpoint --preset tiny-vae --out DIR` writes a test one), or no --vae", (VAE_CLASS,))):
        if not value:
            continue
        folder = Path(value).expanduser()
        if not folder.is_dir():
            raise ModelLoadError(f"{name} folder {value!r} does not exist; pass {what}")
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{name} folder {value!r} has no config.json; pass {what}"
                                 f"{pipeline_hint(folder, classes)}")
    if settings.model:
        check_model_folder(Path(settings.model).expanduser())
    if settings.snapshot_dir is not None:
        from app.persistence.records import check_snapshot_folder

        try:
            check_snapshot_folder(Path(settings.snapshot_dir).expanduser())
        except OSError as exc:
            raise StartUpError(str(exc)) from None


def check_model_folder(folder: Path) -> None:
    """ModelLoadError naming what is wrong when ``folder``'s config.json cannot build the refiner its weights were
    saved from (not JSON, another model class, an unknown or mistyped field, a parameter of another shape), without
    reading any weights: the model is built on the meta device and compared with the safetensors headers."""
    import torch
    from diffusers import SanaWMLTX2RefinerTransformer3DModel
    from safetensors import safe_open

    config_path = folder / "config.json"
    config = read_config_file(config_path)  # parsed and checked as the loader will read it
    if (folder / WEIGHTS).is_file():
        files = [folder / WEIGHTS]
    elif (folder / WEIGHTS_INDEX).is_file():
        try:
            index = json.loads((folder / WEIGHTS_INDEX).read_text())
            files = sorted({folder / name for name in index["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{folder / WEIGHTS_INDEX} is not a safetensors index ({type(exc).__name__}: "
                                 f"{exc}); it maps each parameter to its file under 'weight_map'") from None
    else:
        found = sorted(p.name for p in folder.iterdir())
        raise ModelLoadError(f"{folder}: no {WEIGHTS} or {WEIGHTS_INDEX} (found {found}); save the weights as "
                             "safetensors (save_pretrained does)")
    try:
        with torch.device("meta"):  # shapes only: no memory, no time
            model = SanaWMLTX2RefinerTransformer3DModel.from_config(config)
    except Exception as exc:  # diffusers and the model's __init__ raise many types for a field it cannot use
        raise ModelLoadError(f"{config_path} does not build a refiner ({type(exc).__name__}: {exc}); fix the "
                             "field it names, or pass the config.json saved with the weights") from None
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    wrong = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as weights:
                for name in weights.keys():
                    shape = tuple(weights.get_slice(name).get_shape())
                    if name in expected and expected[name] != shape:
                        wrong.append(f"{name} is {list(shape)} on disk but {list(expected[name])} by the config")
        except Exception as exc:  # missing shard, truncated or not safetensors
            raise ModelLoadError(f"{file} is not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    if wrong:
        more = f" (and {len(wrong) - 2} more)" if len(wrong) > 2 else ""
        raise ModelLoadError(f"{config_path} does not match the weights beside it: {'; '.join(wrong[:2])}{more}; pass "
                             "the config.json saved with these weights")


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """The listening address taken before the model is loaded, so a busy port is known in a second, not after the
    load and the warm-up. Listening at once, because with SO_REUSEADDR (needed to restart over connections in
    TIME_WAIT) Linux lets a second socket bind a port that is bound but not listening: two servers started together
    would both pass and one fail after its load. A client connecting during the load waits in the backlog until the
    server is up. Every address ``host`` resolves to, as uvicorn would bind them. PortInUseError naming the address
    and what to do otherwise."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortInUseError(f"cannot listen on host {host!r}: {exc.strerror}; pass --host with an address of this "
                             "machine (127.0.0.1, 0.0.0.0, ::)") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys((i[0], i[1], i[2], None, i[4]) for i in infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
                sock.listen(2048)  # uvicorn's default backlog
            except OSError as exc:
                shown = f"[{address[0]}]:{address[1]}" if family == socket.AF_INET6 else f"{address[0]}:{address[1]}"
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUseError(f"port {port} on {host} ({shown}) is already in use, by another server or "
                                         "an instance of this one; stop it, or pass --port with a free port "
                                         "(WM_REFINER_PORT)") from None
                raise PortInUseError(f"cannot listen on {shown}: {exc.strerror}; pass --host with an address of this "
                                     "machine and --port with a port you may use (>= 1024 without privileges)") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def embedded_defaults(settings: Settings) -> Settings:
    """The embedded tiny refiner (no model given) keeps its sessions across restarts out of the box: with no
    ``snapshot_dir`` set, a drain saves them under ``cache_dir/snapshots`` (``embedded_snapshots: false`` turns it
    off). A real model's sessions are as big as its KV caches, so its operator chooses where they go."""
    if settings.model or settings.snapshot_dir is not None or not settings.embedded_snapshots:
        return settings
    folder = Path(settings.cache_dir).expanduser() / "snapshots"
    from app.persistence.records import check_snapshot_folder

    try:
        check_snapshot_folder(folder)
    except OSError as exc:
        # Nobody asked for this folder: a laptop's cache on a case-insensitive volume (macOS, Windows) serves without
        # it, saying so, rather than refusing to start (a snapshot_dir the operator gave is still refused, exit 2).
        log.warning("sessions are not saved across restarts: %s (set snapshot_dir to such a folder to keep them, or "
                    "embedded_snapshots: false to silence this)", exc)
        return settings
    return settings.model_copy(update={"snapshot_dir": folder})


class LoadFailure(logging.Filter):
    """A model, VAE or default prompt that passed the checks above but failed to load in the app's start-up: the
    command reports it as one line (exit 2), so uvicorn's traceback of it and its "startup failed" are left out of
    the log."""

    def __init__(self) -> None:
        super().__init__()
        self.error: ModelLoadError | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        return self.error is None or record.levelno < logging.ERROR

    def watch(self, services: Services) -> None:
        start = services.start

        async def start_or_record() -> None:
            try:
                await start()
            except ModelLoadError as exc:
                self.error = exc
                raise

        services.start = start_or_record  # the app's lifespan calls it
        logging.getLogger("uvicorn.error").addFilter(self)


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """A warning for each ``WM_REFINER_*`` variable that names no setting (a typo is otherwise silently ignored, while
    a YAML key or a flag with one is refused), with the nearest setting's variable."""
    import difflib

    known = {name.upper() for name in Settings.model_fields} | {"CONFIG", "URL"}  # + the file; the client's server
    warnings = []
    for name in sorted(os.environ if environ is None else environ):
        if name.startswith(ENV_PREFIX) and name.removeprefix(ENV_PREFIX) not in known:
            close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), known, n=1)
            hint = f"did you mean ${ENV_PREFIX}{close[0]}?" if close else "docs/operations.md lists every setting"
            warnings.append(f"${name} is not a setting and is ignored ({hint})")
    return warnings


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def serve_command(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = embedded_defaults(settings)
    preflight(settings)
    for warning in unknown_variables():
        log.warning("%s", warning)
    sockets = bind_sockets(settings.host, settings.port)
    for sock in sockets:  # uvicorn names no address for sockets it is handed: said here (the port, if 0, chosen)
        host, port = sock.getsockname()[:2]
        log.info("listening on http://%s:%d (ready once the model is loaded and warmed up: GET /ready)",
                 f"[{host}]" if ":" in host else host, port)
    if settings.api_key is None and not _loopback(settings.host):
        log.warning("listening on %s without api_key: anyone who reaches this port can use the service; set "
                    "--api-key or $WM_REFINER_API_KEY (docs/operations.md)", settings.host)
    try:
        if not settings.model:
            folder = ensure_embedded_model(settings.embedded_model_dir)
            log.info("no --model given: serving the embedded tiny refiner from %s", folder)
        if settings.snapshot_dir is not None:
            log.info("sessions are saved to %s on shutdown and adopted from there", settings.snapshot_dir)
        server = build_server(settings)
        failure = LoadFailure()
        failure.watch(server.services)
        try:
            asyncio.run(server.serve(sockets=sockets))
        except SystemExit:  # uvicorn's exit after a failed start-up
            if failure.error is not None:
                raise StartUpError(str(failure.error)) from None
            raise
    finally:
        for sock in sockets:
            sock.close()
    # uvicorn reports a failed start-up (e.g. the model did not load) by not starting, not by raising.
    return 0 if server.started else 1
