"""Service settings: defaults < YAML file (``--config``) < ``WM_REFINER_*`` environment < command-line flags.

Every limit the service enforces is a field here, so an operator can see and change all of them in one place
(docs/operations.md lists each with its environment variable).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (Field, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError, create_model, field_validator,
                      model_validator)
from pydantic_settings import (BaseSettings, InitSettingsSource, NoDecode, PydanticBaseSettingsSource,
                               SettingsConfigDict, SettingsError)

from models.config import SessionConfig
from models.errors import InvalidConfigError
from wm_refiner_client import spec

from app.core.values import parse_bytes, parse_origins

ENV_PREFIX = "WM_REFINER_"
MiB = 1024 * 1024


def _default_cache_dir() -> Path:
    return Path("~/.cache/wm-refiner").expanduser()


# --- replica ids --------------------------------------------------------------------------------------------------
REPLICA_ID_RULE = "[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_REPLICA_ID = re.compile(REPLICA_ID_RULE)


MIN_SIGNING_KEY_CHARS = 32


def check_replica_id(replica_id: str) -> str:
    """``replica_id`` when it is a safe token; ValueError saying what to choose otherwise.

    It is sent as the ``X-Replica`` header, written into session leases and becomes part of temporary file names
    in the snapshot folder (``.<session>.session.safetensors.<replica_id>.<random>.tmp``, found again with a glob
    at start-up): so letters,
    digits, '.', '_' and '-', starting with a letter or digit, at most 128 characters (a host name and a pid fit).
    No '/', no glob characters, no spaces or control characters that a header or a file name would mangle.
    """
    if not isinstance(replica_id, str) or not _REPLICA_ID.fullmatch(replica_id):
        raise ValueError(
            f"replica_id {replica_id!r} is not a safe token ({REPLICA_ID_RULE}: letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, at most 128 characters); set one such as 'replica-0' or the pod's name"
        )
    return replica_id


def _default_replica_id() -> str:
    # Random per process: the id is on every response (X-Replica), the unauthenticated ones included, so the default
    # must not reveal the host name or the process id. A deployment names its replicas (the pod name in deploy/k8s).
    return f"replica-{secrets.token_hex(6)}"


def _settings_type(field: spec.SessionField) -> Any:
    if field.kind == spec.INTEGER:
        return int
    if field.kind == spec.NUMBER:
        return float
    if field.kind == spec.NUMBERS:
        return tuple[float, ...]
    if field.kind == spec.CHOICE:
        return Literal[field.choices]
    raise AssertionError(f"no settings type for a {field.kind} field ({field.name})")


# The default_* settings, one per spec field that names one (``SessionField.setting``): a new session field with a
# server default needs no line here.
_SessionDefaults = create_model(
    "_SessionDefaults",
    __base__=BaseSettings,
    **{
        f.setting: (_settings_type(f), Field(default=f.default, description=f"session default: {f.doc}"))
        for f in spec.FIELDS
        if f.setting is not None
    },
)


class Settings(_SessionDefaults):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        frozen=True,
        protected_namespaces=(),
        # A refused value is not echoed in the error: it may be a secret (api_key, snapshot_signing_key) that is
        # only mistyped. Each validator's message says what was wrong and what to send instead.
        hide_input_in_errors=True,
    )

    # --- the model -----------------------------------------------------------------------------------------
    model: str | None = Field(
        default=None, description="refiner folder (diffusers layout); unset: the embedded tiny refiner"
    )
    cache_dir: Path = Field(
        default_factory=_default_cache_dir, description="where the embedded tiny refiner is built on first start"
    )
    device: str = Field(default="auto", description="cpu, cuda, cuda:N or auto")
    dtype: str = Field(default="auto", description="float32, bfloat16, float16, float64 (or bf16, fp16, ...) or auto")
    vae: str | None = Field(
        default=None,
        description="LTX-2 video VAE folder (diffusers layout, AutoencoderKLLTX2Video) for sessions with video "
        "outputs; unset: latents only",
    )
    torch_threads: PositiveInt | None = Field(
        default=None, description="CPU threads for torch's kernels; unset: torch's default (one per core)"
    )

    # --- the server ----------------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = Field(default=None, repr=False, description="unset: no authentication")
    admin_api_key: str | None = Field(
        default=None, repr=False,
        description="the key of the operator routes (/v1/admin/*: the drain); set, api_key no longer opens them (a "
        "client with the service's key cannot drain a replica); unset: api_key guards them like every route",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    forwarded_allow_ips: str | None = Field(
        default=None,
        description="the proxies whose X-Forwarded-For / X-Forwarded-Proto this server believes (uvicorn's "
        "forwarded_allow_ips: comma-separated addresses or networks, '*' for any); unset: none, the headers are "
        "ignored and the client is the connection's peer (uvicorn's own default trusts 127.0.0.1, where a client "
        "reaching the replica directly chose its address in the log)",
    )

    # --- browsers on other origins (app.api.cors) --------------------------------------------------------------
    cors_origins: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="origins (scheme://host[:port]) whose pages may call the API: CORS headers on HTTP answers, and "
        "the allow-list for the Origin of a WebSocket handshake or of a request but GET/HEAD/OPTIONS (others: 403); "
        "comma-separated, '*' for any; unset: no CORS headers and no Origin check",
    )

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _cors_origins(cls, value: Any) -> tuple[str, ...]:
        return parse_origins(value)

    # --- limits --------------------------------------------------------------------------------------------
    max_sessions: PositiveInt = 16
    max_body_bytes: PositiveInt = 64 * MiB
    max_inflight_body_bytes: PositiveInt = Field(
        default=256 * MiB,
        description="request-body bytes all connections together may hold while they arrive, WebSocket messages "
        "still arriving included; a body past it is refused with 503 + Retry-After before it is read, a WebSocket "
        "closed with 1013 unless it is the only one holding any (at least max_body_bytes)",
    )
    max_header_bytes: PositiveInt = Field(
        default=64 * 1024, description="largest request line + headers; larger: 431 and the connection closed"
    )
    request_header_timeout_s: PositiveFloat = Field(
        default=10.0, description="time a client has to send a request's headers (from its first byte, or from "
        "connecting); then 408 and closed"
    )
    request_body_timeout_s: PositiveFloat = Field(
        default=120.0, description="time a client has to send a request's body once its headers arrived (then 408 "
        "and closed), and a WebSocket message from its first byte to its last (then closed with 1013)"
    )
    max_ws_message_bytes: PositiveInt = 64 * MiB
    ws_max_write_buffer_bytes: int = Field(
        default=1 * MiB, ge=64 * 1024,
        description="a WebSocket whose unsent output (pongs included: a ping is answered without back-pressure) "
        "is over this is not read until its client reads; at least 64 KiB, asyncio's high-water mark"
    )
    max_frames_per_chunk: PositiveInt = 64
    max_clip_frames: PositiveInt = 512
    max_prompt_tokens: PositiveInt = 1024
    # A session's memory and compute follow from what its client asks for; these caps bound them server-side.
    max_window_frames: PositiveInt = Field(
        default=64, description="largest kv_max_frames + block_size a session may ask for (bounds its KV cache)"
    )
    max_denoise_steps: PositiveInt = Field(default=16, description="most sigmas - 1 (forwards per block) a session may ask for")
    max_frame_tokens: PositiveInt = Field(
        default=4096, description="largest H x W per latent frame (4096 covers 2048x2048 pixels)"
    )
    max_batch: PositiveInt = Field(default=4, description="largest batch B per session")
    session_idle_timeout_s: PositiveFloat = Field(
        default=600.0, description="how long a session is kept without a request when session_retention_s is unset "
        "(its older name: the same setting)"
    )
    # --- memory: admission by bytes, parking, spilling (app.sessions.parking) -----------------------------------------
    device_memory_budget: int | Literal["auto"] | None = Field(
        default=None,
        description="device bytes the sessions may hold (a number, or with a unit: 40GiB); auto: on CUDA the memory "
        "free after the warm-up minus device_memory_reserve, on the CPU none; unset: no budget (max_sessions only). "
        "A session past it is refused with 503 insufficient_memory at its first chunk",
    )
    device_memory_reserve: int = Field(
        default=2 * 1024 * MiB, ge=0,
        description="with device_memory_budget auto: device bytes left out of the budget (activations of the model "
        "calls, the allocator's slack)",
    )
    park_after_s: PositiveFloat = Field(
        default=30.0, description="a session with no work this long moves its device state to host memory (pinned "
        "on CUDA); it comes back on its next request"
    )
    spill_after_s: PositiveFloat = Field(
        default=300.0, description="a parked session with no work this long (since its last chunk or message) is written to snapshot_dir and "
        "freed (needs snapshot_dir; without it a session stays parked until session_retention_s)"
    )
    session_retention_s: PositiveFloat | None = Field(
        default=None, description="a session without a request this long is deleted (then 410), whether active, "
        "parked or spilled; unset: session_idle_timeout_s"
    )
    max_spilled_sessions: PositiveInt = Field(
        default=1000, description="spilled sessions this replica keeps in snapshot_dir: at the bound a parked session "
        "is no longer spilled (it stays parked, holding its max_sessions place) and a new session is refused (503 "
        "over_capacity) once no spilled one is past session_retention_s"
    )
    max_spilled_bytes: PositiveInt | None = Field(
        default=None, description="bytes of this replica's spilled sessions' files in snapshot_dir, bounded like "
        "max_spilled_sessions (a spill starts only below it); unset: by count only"
    )
    evicted_ids_remembered: PositiveInt = 10_000
    engine_queue_depth: PositiveInt = 64
    session_queue_depth: PositiveInt = 4
    # --- the engine ------------------------------------------------------------------------------------------
    batching: Literal["auto"] | bool = Field(
        default="auto",
        description="run the ready forwards of several sessions as one model call: auto (batch only if the start-up "
        "probe finds batched rows bit-identical to solo ones for this model here), true (always; warns when the probe "
        "fails), false (one session per call)",
    )
    max_batch_rows: PositiveInt = Field(
        default=8, description="most rows (sessions' batches summed) in one model call"
    )
    compile_step: bool = Field(
        default=False,
        description="torch.compile the batched step at bucketed batch sizes (compiled during the warm-up); for GPUs",
    )
    compile_buckets: Annotated[Literal["every", "powers"] | tuple[PositiveInt, ...], NoDecode] = Field(
        default="every",
        description="batch sizes compile_step compiles (a call of R rows runs at the smallest >= R, padded with "
        "zero rows): every (1 .. max_batch_rows: never pads), powers (1, 2, 4, ... max_batch_rows: half the "
        "compiles at start-up, 3 rows run as 4), or a comma-separated list (max_batch_rows is added)",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        default="default", description="torch.compile mode of compile_step; reduce-overhead adds CUDA graphs (on an "
        "H200 slower than default, and 3.4x the compile time: docs/benchmarks.md, GPU)"
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        default="inductor", description="torch.compile backend of compile_step (the others are for debugging)"
    )
    # Default eager: a compiled step is a speed-up, never a difference in what is served (eager gives the same
    # results within the parity tolerance, and a shape the warm-up did not compile already runs eagerly), so a
    # compiler that breaks on one machine (a missing triton, an inductor bug, a crashing C++ compiler) should cost
    # speed, visibly, not the replica: with fail every replica of the same image stays unready, forever (a retry
    # fails the same way). What the speed costs stays honest: admission: realtime admits by the costs it measures
    # on the step that runs. fail is for an operator whose capacity plan holds only with the compiled step.
    compile_fallback: Literal["eager", "fail"] = Field(
        default="eager",
        description="when compile_step's compiling fails: eager (log the reason once, serve the step eagerly, say so "
        "in /v1/info's engine.step and refiner_compile_failed) or fail (stay unready, /ready's 503 naming the reason)",
    )
    admission: Literal["none", "count", "realtime"] = Field(
        default="none",
        description="realtime: refuse a new realtime session (503 over_capacity) when, by the engine's measured "
        "cost per row, the realtime sessions held plus it would need more than admission_max_load of the engine's "
        "time; none (or count, the specification's name for it): admit by count and memory budget only",
    )
    admission_max_load: PositiveFloat = Field(
        default=0.9,
        description="with admission: realtime, the share of the engine's time realtime sessions may need (seconds "
        "of model time per second of video, summed)",
    )
    ws_outbound_queue: PositiveInt = 8
    watch_queue_units: PositiveInt = Field(
        default=8, description="units a watcher may fall behind before it loses some (it is told how many)"
    )
    max_watchers: PositiveInt = Field(default=8, description="most watchers of one session")
    max_watch_encodings: int = Field(
        default=2, ge=0,
        description="distinct video encodings (video_format, video_quality) a session's watchers may ask for beyond "
        "the producer's own: each costs CPU per unit however many watchers share it, so a watcher asking for one "
        "more is refused with 503 over_capacity before its handshake is accepted; 0: watchers get the producer's "
        "video (or no video) only",
    )
    encode_workers: PositiveInt = Field(
        default=2, description="threads that put units on the wire (safetensors, JPEG, H.264) for producers and "
        "responses; watchers' encodings run on a pool of half as many (at least one), at a lower CPU priority, so "
        "watchers never wait on (or delay) a producer's encoding"
    )
    retry_after_s: PositiveInt = 1
    drain_timeout_s: PositiveFloat = 30.0
    # A dropped WebSocket keeps its session this long for the client to reattach (then 410).
    ws_reattach_grace_s: PositiveFloat = 60.0
    # Units a session keeps after returning them (streamed or in HTTP responses), so a reattaching client can ask
    # for what it missed. 0 keeps none (no resume sends anything again): a host that cannot spare the memory.
    ws_resume_units: NonNegativeInt = 32
    flushed_session_ttl_s: PositiveFloat = Field(
        default=60.0, description="a flushed session is released this long after its last request (then 410)"
    )

    # --- restarts ------------------------------------------------------------------------------------------
    snapshot_dir: Path | None = Field(
        default=None,
        description="where drain (and checkpoints) write sessions and any replica adopts them on their next "
        "request; share it between replicas; unset: none",
    )
    snapshot_signing_key: str | None = Field(
        default=None, repr=False,
        description="a secret (at least 32 characters) every replica sharing snapshot_dir holds, best from the "
        f"environment ({ENV_PREFIX}SNAPSHOT_SIGNING_KEY): each session file written is signed with it "
        "(HMAC-SHA256 over its metadata and tensors) and a file that is unsigned or signed otherwise is refused, as "
        "a corrupt one is; unset: files are neither signed nor checked. Never logged or shown in /v1/info",
    )
    embedded_snapshots: bool = Field(
        default=True,
        description="with the embedded tiny refiner (no model) and no snapshot_dir: save sessions under "
        "cache_dir/snapshots, so `python -m app serve` keeps them across restarts; false: no snapshots",
    )
    checkpoint_every_blocks: int = Field(
        default=0, ge=0,
        description="write a session's crash checkpoint to snapshot_dir every this many refined blocks; 0: off",
    )
    checkpoint_interval_s: float = Field(
        default=0.0, ge=0.0,
        description="and/or when this long passed since its last one (and it refined a block since); 0: off",
    )
    session_lease_s: float = Field(
        default=10.0, gt=0.0,
        description="a replica's lease on each session it holds with a file in snapshot_dir, renewed every third of "
        "it: another replica adopts the file only once the owner released it or this long after its last renewal",
    )
    concurrent_adoptions: PositiveInt = Field(
        default=2,
        description="sessions read from snapshot_dir and built in host memory at once (a spilled session coming back, "
        "another replica's after a drain or a crash): each holds its file and the session built from it meanwhile, "
        "about twice the file's size (~18 GiB for a 720p window); more wait their turn, before taking the lease",
    )
    peers: str | None = Field(
        default=None,
        description="the deployment's replicas, for GET /v1/sessions to list all of them: comma-separated base URLs "
        "(this replica's own may be among them), or dns:NAME:PORT (every address of a headless service)",
    )
    peer_api_key: str | None = Field(
        default=None, repr=False,
        description="the key this replica sends to its peers when it lists the deployment (unset: its own api_key); "
        "never the caller's",
    )
    replica_id: str = Field(
        default_factory=_default_replica_id,
        description="this process's name in a deployment: the X-Replica header, session leases; a safe token "
        f"({REPLICA_ID_RULE})",
    )

    # --- prompt ------------------------------------------------------------------------------------------------
    default_prompt: Path | None = Field(
        default=None,
        description="safetensors file with prompt_embeds (1, L, caption_channels) and optionally "
        "prompt_attention_mask (1, L), used by sessions and clips whose first chunk carries no prompt; unset: "
        "the first chunk must carry one",
    )

    # --- warm-up -------------------------------------------------------------------------------------------
    warmup: bool = True
    warmup_height: PositiveInt = 4
    warmup_width: PositiveInt = 4
    warmup_prompt_tokens: PositiveInt = 8
    warmup_geometries: Annotated[tuple[tuple[PositiveInt, PositiveInt], ...], NoDecode] = Field(
        default=(),
        description="more latent sizes (height x width, e.g. 15x26,22x40) warmed up before /ready besides "
        "warmup_height x warmup_width: their batching classes probed (batching: auto/true) and, with "
        "compile_step, compiled; once ready, a stream of a size not listed is probed when first seen (holding the "
        "engine) and runs eagerly (counted in refiner_uncompiled_model_calls) rather than compiling while other "
        "sessions wait",
    )

    @field_validator("warmup_geometries", mode="before")
    @classmethod
    def _warmup_geometries(cls, value: Any) -> tuple[tuple[int, int], ...]:
        return parse_geometries(value)

    @field_validator("compile_buckets", mode="before")
    @classmethod
    def _compile_buckets(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip() not in ("every", "powers"):
            try:
                value = tuple(int(part) for part in value.split(",") if part.strip())
            except ValueError:
                raise ValueError(f"compile_buckets {value!r}: every, powers, or batch sizes like 1,2,3,4") from None
        elif isinstance(value, str):
            return value.strip()
        if not value:
            raise ValueError("compile_buckets is empty: every, powers, or batch sizes like 1,2,3,4")
        return value

    def compile_geometries(self) -> list[tuple[int, int]]:
        """Every latent (height, width) the compiled step is warmed up for: the warm-up's, then the listed ones."""
        return list(dict.fromkeys([(self.warmup_height, self.warmup_width), *self.warmup_geometries]))

    # --- responses -----------------------------------------------------------------------------------------
    response_dtype: Literal["float32", "model"] = "float32"

    # --- session defaults (a client's POST /v1/sessions fields override these) -----------------------------
    # default_seed, default_fps, ...: generated from wm_refiner_client.spec (_SessionDefaults above).

    @field_validator("replica_id")
    @classmethod
    def _replica_id_safe(cls, value: str) -> str:
        return check_replica_id(value)

    @field_validator("api_key", "admin_api_key", "peer_api_key")
    @classmethod
    def _key_without_surrounding_space(cls, value: str | None, info) -> str | None:
        # A key read from a file or a Kubernetes secret often ends with a newline. Clients send the key without it
        # (a header's value has no surrounding space), so as configured it could never match: every request 401.
        # The value itself is never in the message (it may be a real key).
        if value is None or value == "":
            return value
        stripped = value.strip()
        if not stripped:
            raise ValueError(f"{info.field_name} is only whitespace; give the key, or leave it unset to run without "
                             "authentication")
        return stripped

    @field_validator("snapshot_signing_key")
    @classmethod
    def _signing_key_long_enough(cls, value: str | None) -> str | None:
        # The value itself is never in the message: a key that is refused may still be a real one, mistyped.
        if value is not None and len(value) < MIN_SIGNING_KEY_CHARS:
            raise ValueError(
                f"snapshot_signing_key has {len(value)} characters; a key must have at least {MIN_SIGNING_KEY_CHARS} "
                "(make one with: python -c 'import secrets; print(secrets.token_hex(32))')"
            )
        return value

    @property
    def signing_key(self) -> bytes | None:
        """``snapshot_signing_key`` as the bytes HMAC takes (its UTF-8), or None when unset."""
        return None if self.snapshot_signing_key is None else self.snapshot_signing_key.encode()

    @field_validator("device_memory_budget", "device_memory_reserve", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        if value is None or value == "auto":
            return value
        return parse_bytes(value)

    @property
    def upkeep_interval_s(self) -> float:
        """How often the sessions' timer runs (app.sessions.upkeep): half the shortest of the idle settings, at most
        5 s."""
        return min(self.retention_s / 2, self.ws_reattach_grace_s / 2, self.park_after_s / 2, self.spill_after_s / 2,
                   5.0)

    @property
    def retention_s(self) -> float:
        """How long a session is kept without a request (session_retention_s, or its older name)."""
        return self.session_retention_s if self.session_retention_s is not None else self.session_idle_timeout_s

    @model_validator(mode="after")
    def _inflight_holds_a_body(self) -> Settings:
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) is below max_body_bytes "
                f"({self.max_body_bytes}): no body of the largest size could ever be accepted; set it to at least "
                "max_body_bytes (a few times it lets that many such bodies arrive at once)"
            )
        return self

    @model_validator(mode="after")
    def _geometries_fit_a_frame(self) -> Settings:
        for height, width in self.warmup_geometries:
            if height * width > self.max_frame_tokens:
                raise ValueError(
                    f"warmup_geometries {height}x{width}: {height * width} tokens per frame, past max_frame_tokens "
                    f"({self.max_frame_tokens}); no stream of that size is accepted, so compiling it would only cost "
                    "start-up time: remove it or raise max_frame_tokens"
                )
        return self

    @model_validator(mode="after")
    def _buckets_fit_a_call(self) -> Settings:
        if isinstance(self.compile_buckets, tuple) and max(self.compile_buckets, default=1) > self.max_batch_rows:
            raise ValueError(
                f"compile_buckets {','.join(map(str, self.compile_buckets))}: no call has more than max_batch_rows "
                f"({self.max_batch_rows}) rows; list batch sizes up to it, or every / powers"
            )
        return self

    @model_validator(mode="after")
    def _session_defaults_valid(self) -> Settings:
        try:
            self.session_defaults()
        except InvalidConfigError as exc:
            raise ValueError(f"default session settings: {exc}") from None
        return self

    def session_defaults(self) -> SessionConfig:
        """The model config a session gets for every field it leaves unset."""
        return SessionConfig.from_dict({f.name: getattr(self, f.setting) for f in spec.FIELDS if f.setting})

    def session_default_values(self) -> dict[str, Any]:
        """Every session field's default on this server, as JSON (``/v1/info`` ``default_session_config``)."""
        config = self.session_defaults().to_dict()
        return {f.name: config[f.name] if f.name in config else f.default_json() for f in spec.FIELDS}

    @property
    def embedded_model_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() / "tiny"

    def limits(self) -> dict[str, Any]:
        """The limits clients can run into, as /v1/info reports them."""
        names = (
            "max_sessions",
            "max_body_bytes",
            "max_ws_message_bytes",
            "max_frames_per_chunk",
            "max_clip_frames",
            "max_prompt_tokens",
            "session_idle_timeout_s",
            "park_after_s",
            "spill_after_s",
            "engine_queue_depth",
            "session_queue_depth",
            "max_batch_rows",
            "ws_outbound_queue",
            "ws_reattach_grace_s",
            "ws_resume_units",
            "watch_queue_units",
            "max_watchers",
            "max_watch_encodings",
            "max_spilled_sessions",
            "max_spilled_bytes",
            "max_inflight_body_bytes",
            "max_header_bytes",
            "request_header_timeout_s",
            "request_body_timeout_s",
        )
        return {name: getattr(self, name) for name in names}


def parse_geometries(value: Any) -> tuple[tuple[int, int], ...]:
    """Latent sizes as ``"15x26,22x40"`` (an environment variable), or a list of ``"15x26"`` strings or
    ``[15, 26]`` pairs (YAML)."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    sizes = []
    for item in items:
        try:
            if isinstance(item, str):
                if not item.strip():
                    continue
                height, width = (int(part) for part in item.strip().lower().split("x"))
            else:
                height, width = item
                if not all(isinstance(part, int) and not isinstance(part, bool) for part in (height, width)):
                    raise TypeError
        except (TypeError, ValueError):
            raise ValueError(f"warmup_geometries: {item!r} is not a latent size; write height x width, e.g. "
                             "15x26 (480p) or 22x40 (720p)") from None
        if height < 1 or width < 1:
            raise ValueError(f"warmup_geometries: {item!r}: height and width must be positive")
        sizes.append((height, width))
    return tuple(sizes)


def read_yaml(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {str(file)!r} does not exist")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:  # said with the file's name and line, in one line, as every other mistake in it
        mark = getattr(exc, "problem_mark", None)
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        what = getattr(exc, "problem", None) or type(exc).__name__
        raise SettingsInputError(f"{file}: not valid YAML ({what}{where}); write one `setting: value` per line "
                                 "(docs/operations.md lists every setting)") from None
    if not isinstance(data, dict):
        raise SettingsInputError(f"{file}: a settings file must be a mapping of setting: value, got "
                                 f"{type(data).__name__}")
    return data


class SettingsInputError(ValueError):
    """A setting given wrong (a YAML key, a ``WM_REFINER_*`` variable or a flag), said in one line: which setting,
    where its value came from, what is wrong and what to give instead (pydantic's own report runs over several lines,
    names an internal class and never the variable or the file)."""


def _settings_error(exc: Exception, file: str | None, file_values: dict[str, Any],
                    overrides: dict[str, Any]) -> SettingsInputError:
    import difflib

    def source(name: str) -> str:
        if name in overrides:
            return f"--{name.replace('_', '-')}"
        if f"{ENV_PREFIX}{name.upper()}" in os.environ:
            return f"${ENV_PREFIX}{name.upper()}"
        if name in file_values:
            return f"{name} in {file}"
        return name

    if isinstance(exc, SettingsError):  # a variable pydantic-settings could not even parse (JSON for lists)
        match = re.search(r'field "(\w+)"', str(exc))
        name = match.group(1) if match else "?"
        value = os.environ.get(f"{ENV_PREFIX}{name.upper()}", "")
        return SettingsInputError(
            f"{source(name)}={value!r} cannot be read: from the environment this setting takes JSON (a list as "
            "[0.9, 0.5, 0.0], a mapping as {\"key\": 1}), or set it in the YAML file")
    assert isinstance(exc, ValidationError)
    parts = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            close = difflib.get_close_matches(name, Settings.model_fields, n=1)
            hint = f"did you mean {close[0]}?" if close else "docs/operations.md lists every setting"
            parts.append(f"{source(name)}: no such setting ({hint})")
        elif name:
            parts.append(f"{source(name)}={error.get('input')!r}: {message}")
        else:
            parts.append(message)
    return SettingsInputError("; ".join(parts))


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Settings from the YAML file (or ``WM_REFINER_CONFIG``), the environment and explicit overrides.

    ``None`` overrides are ignored, so unset command-line flags fall through to the environment and the file. A value
    that does not validate raises ``SettingsInputError``: one line naming the setting and where it came from.
    """
    path = config_file or os.environ.get(f"{ENV_PREFIX}CONFIG")
    file_values = read_yaml(path) if path else {}
    overrides = {key: value for key, value in overrides.items() if value is not None}
    try:
        return _load_layered(file_values, overrides)
    except (ValidationError, SettingsError) as exc:
        raise _settings_error(exc, str(path) if path else None, file_values, overrides) from None


def _load_layered(file_values: dict[str, Any], overrides: dict[str, Any]) -> Settings:

    class _Layered(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, InitSettingsSource(settings_cls, file_values))

    layered = _Layered(**overrides)
    # Hand back the plain class: the layering only matters while the values are being read.
    return Settings.model_construct(**layered.model_dump())
