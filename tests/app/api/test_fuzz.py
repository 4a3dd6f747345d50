"""Schema fuzzing: schemathesis generates requests for every operation in /openapi.json, with and without an API
key configured, and checks each response: never a 5xx, and the status, content type, headers and body are the
ones the schema documents for it. Afterwards the app must still be whole: probes answer and a normal session
returns exactly the bytes of an untroubled run.

The app runs behind a real uvicorn on 127.0.0.1 (conftest.LiveServer) rather than through
``schemathesis.openapi.from_asgi``: schemathesis' pytest plugin ends every ASGI lifespan it started after each
test item, and this app's lifespan (model, engine thread) is started once per module. Real HTTP parsing is a
bonus: Content-Length, chunked bodies and odd headers are the server's, not a test client's.

Bodies: the schema says ``application/octet-stream`` for the tensor routes, and random bytes would only ever
reach the safetensors parser, so a strategy registered for that media type builds real safetensors files with
fuzzed names, ranks, dtypes, shapes and values (NaN, Inf), some of them then corrupted. Session-scoped
operations run against generated ids (404s, odd characters) and against live sessions, fresh or long-lived,
so chunks reach the session checks and the engine.

Bounded and reproducible: a fixed number of examples per operation, derandomized (the same requests every run),
no deadline, no example database. ``WM_FUZZ_EXAMPLES=500`` makes it a deeper, randomized local hunt.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save
from schemathesis import GenerationMode
from schemathesis.core.parameters import ParameterLocation
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from fastapi.routing import iter_route_contexts
from app.core.settings import Settings
from models import SessionConfig
from app.api import openapi

from tests.app.conftest import DEADLINE_S, LiveServer, expected_clip, make_clip, payload, read_latents, wait_until

KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("WM_FUZZ_EXAMPLES", "40"))
RANDOMIZED = "WM_FUZZ_EXAMPLES" in os.environ
OCTET = "application/octet-stream"

# Every HTTP operation the app serves (the docs pages aside); test_the_schema_documents_every_route keeps this
# list honest, so a new route cannot go unfuzzed. The flag: whether it has inputs a negative case can break
# (a path id is any string, so the session GET/DELETE have none; schemathesis then finds nothing to negate).
OPERATIONS = [
    ("GET", "/health", False),
    ("GET", "/ready", False),
    ("GET", "/metrics", False),
    ("GET", "/v1/info", False),
    ("POST", "/v1/sessions", True),
    ("PUT", "/v1/sessions/{session_id}", True),
    ("GET", "/v1/sessions", True),
    ("GET", "/v1/sessions/{session_id}", False),
    ("DELETE", "/v1/sessions/{session_id}", False),
    ("POST", "/v1/sessions/{session_id}/chunks", True),
    ("POST", "/v1/refine", True),
]
TENSOR_ROUTES = {"/v1/sessions/{session_id}/chunks", "/v1/refine"}
DOCS_ROUTES = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}

# Positive-data acceptance is left out on purpose: the config's rules across fields (kv_max_frames >=
# sink_frames + block_size, sigmas decreasing to 0) and every tensor rule live outside what a JSON schema can
# say, so schema-valid requests are legitimately refused with 400/422.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


# --- safetensors bodies ------------------------------------------------------------------------------------
# Half the bodies are valid chunks (so the engine runs and sessions move on), a quarter valid but for one
# defect, a quarter anything at all; any of them may then have its bytes corrupted.
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool]
NAMES = ["latents", "prompt_embeds", "prompt_attention_mask", "prompt_embed", "noise"]
DEFECTS = ["dtype", "rank", "channels", "size", "nan", "inf", "extra-name", "no-latents", "mask-shape", "empty-prompt"]


def randn(draw, shape) -> torch.Tensor:
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    return torch.randn(shape, generator=generator)


@st.composite
def valid_chunk(draw) -> dict[str, torch.Tensor]:
    # A small fixed geometry most of the time, so a long-lived session keeps accepting chunks.
    batch, side = draw(st.sampled_from([(1, 2), (1, 2), (1, 2), (1, 3), (2, 2)]))
    # Mostly what both tensor routes take (a clip needs more frames than its sink), sometimes 0 or too many.
    frames = draw(st.sampled_from([2, 3, 4, 1, 0, 5]))
    chunk = {"latents": randn(draw, (batch, 128, frames, side, side)).to(draw(st.sampled_from(DTYPES[:3])))}
    if draw(st.sampled_from([True, True, False])):
        tokens = draw(st.integers(1, 5))
        chunk["prompt_embeds"] = randn(draw, (batch, tokens, 32))
        if draw(st.booleans()):
            chunk["prompt_attention_mask"] = torch.ones(batch, tokens, dtype=draw(st.sampled_from(DTYPES[4:])))
    return chunk


@st.composite
def broken_chunk(draw) -> dict[str, torch.Tensor]:
    chunk = draw(valid_chunk())
    name = draw(st.sampled_from(sorted(chunk)))
    tensor = chunk[name]
    defect = draw(st.sampled_from(DEFECTS))
    if defect == "dtype":
        chunk[name] = tensor.to(draw(st.sampled_from(DTYPES[3:])))
    elif defect == "rank":
        chunk[name] = tensor.unsqueeze(0) if draw(st.booleans()) else tensor.reshape(-1)
    elif defect == "channels" and tensor.ndim >= 2:
        chunk[name] = randn(draw, (*tensor.shape[:1], draw(st.sampled_from([1, 16, 64, 129])), *tensor.shape[2:]))
    elif defect == "size" and tensor.ndim >= 1:
        chunk[name] = randn(draw, (*tensor.shape[:-1], tensor.shape[-1] + 1))
    elif defect in ("nan", "inf") and tensor.is_floating_point() and tensor.numel():
        tensor = tensor.clone()
        tensor.view(-1)[draw(st.integers(0, tensor.numel() - 1))] = float(defect) * draw(st.sampled_from([1, -1]))
        chunk[name] = tensor
    elif defect == "extra-name":
        chunk[draw(st.sampled_from(NAMES[3:]))] = tensor.clone()
    elif defect == "no-latents":
        chunk.pop("latents")
    elif defect == "mask-shape" and "prompt_embeds" in chunk:
        chunk["prompt_attention_mask"] = torch.ones(1, 9, dtype=torch.int64)
    elif defect == "empty-prompt" and "prompt_embeds" in chunk:
        chunk["prompt_embeds"] = torch.zeros(chunk["prompt_embeds"].shape[0], 0, 32)
        chunk.pop("prompt_attention_mask", None)
    return chunk


@st.composite
def any_tensors(draw) -> dict[str, torch.Tensor]:
    chunk = {}
    for name in draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=3)):
        values = randn(draw, draw(st.lists(st.integers(0, 3), max_size=6)))
        dtype = draw(st.sampled_from(DTYPES))
        chunk[name] = values > 0 if dtype == torch.bool else (values * 4).to(dtype)
    return chunk


@st.composite
def safetensors_bodies(draw) -> bytes:
    tensors = draw(st.one_of(valid_chunk(), valid_chunk(), broken_chunk(), any_tensors()))
    data = save({name: tensor.contiguous() for name, tensor in tensors.items()})
    corruption = draw(st.sampled_from([None] * 6 + ["truncate", "flip", "append", "header-size"]))
    if corruption == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif corruption == "flip":
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    elif corruption == "append":
        data += draw(st.binary(min_size=1, max_size=64))
    elif corruption == "header-size":
        data = draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little") + data[8:]
    return data


schemathesis.openapi.media_type(OCTET, safetensors_bodies())


# --- the app under fuzz ------------------------------------------------------------------------------------
@dataclass
class Fuzzed:
    server: LiveServer
    schema: object
    headers: dict[str, str]
    client: httpx.Client
    shared_session: str | None = None
    done: set = field(default_factory=set)
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)  # (method, path, status) -> responses

    def new_session(self) -> str:
        response = self.client.post("/v1/sessions", json={}, headers=self.headers)
        assert response.status_code == 201, response.text
        return response.json()["session_id"]

    def shared(self) -> str:
        """A long-lived session that accumulates whatever the fuzzer manages to get accepted (recreated if a
        fuzzed DELETE ended it)."""
        if self.shared_session is None or self.client.get(
            f"/v1/sessions/{self.shared_session}", headers=self.headers
        ).status_code != 200:
            self.shared_session = self.new_session()
        return self.shared_session


@pytest.fixture(scope="module", params=[None, KEY], ids=["no-key", "api-key"])
def fuzzed(request, checkpoint_dir, tmp_path_factory):
    key = request.param
    settings_ = Settings(
        model=str(checkpoint_dir),
        device="cpu",
        dtype="float32",
        cache_dir=tmp_path_factory.mktemp("cache"),
        api_key=key,
        # The fuzzer creates a session per POST; the session limit has its own test (test_errors), and hitting
        # it here would be a legitimate 503 that hides real ones.
        max_sessions=100_000,
        # Low enough that the generated chunks cross them now and then (and get their 413).
        max_frames_per_chunk=4,
        max_clip_frames=4,
        max_prompt_tokens=4,
    )
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with LiveServer(settings_) as server, httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as client:
        # A copy: schemathesis adds its user-agent to the dict it is given.
        schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", headers=dict(headers))
        yield Fuzzed(server, schema, headers, client)


def fuzz(fuzzed: Fuzzed, method: str, path: str, mode: GenerationMode) -> None:
    operation = fuzzed.schema[path][method]
    session_scoped = "{session_id}" in path
    refine_config = path == "/v1/refine" and mode == GenerationMode.POSITIVE
    checks = CHECKS + ([ignored_auth] if fuzzed.headers else [])

    @given(
        case=operation.as_strategy(generation_mode=mode),
        target=st.sampled_from(["generated", "fresh", "shared"]),
        defaults=st.booleans(),
    )
    @settings(
        # The tensor routes hold most of the logic worth fuzzing; they get more of the budget.
        max_examples=EXAMPLES * (3 if path in TENSOR_ROUTES else 1),
        deadline=None,
        derandomize=not RANDOMIZED,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    def run(case, target, defaults):
        if defaults and refine_config:
            # Schema-valid settings drawn at random rarely meet the rules across fields (kv_max_frames >=
            # sink_frames + block_size, each up to 2**20), so most clips would end in 422 before the engine: half
            # the positive /v1/refine cases take the server's defaults, and the body decides.
            case.query = {}
        if case.query:
            # requests leaves a None-valued or empty-list parameter out of the URL, and sends a list as repeated
            # keys (the last one read), so a negative case's broken parameter could arrive valid or not at all and
            # its acceptance be blamed on the server; send such values as their JSON text (no parameter takes a
            # list).
            case.query = {name: as_sent(value) for name, value in case.query.items()}
        headers = fuzzed.headers
        if leaves_the_key_out(case):
            headers = {}  # the case is negative by leaving the required key out: do not put it back
        if session_scoped and target != "generated":
            case.path_parameters = {"session_id": fuzzed.new_session() if target == "fresh" else fuzzed.shared()}
        fuzzed.requests += 1
        response = case.call_and_validate(
            base_url=fuzzed.server.base_url, headers=headers, checks=checks, timeout=DEADLINE_S
        )
        fuzzed.statuses[method, path, response.status_code] += 1

    run()
    fuzzed.done.add((method, path, mode))


def as_sent(value):
    return json.dumps(value) if value is None or isinstance(value, (list, dict)) else value


def leaves_the_key_out(case) -> bool:
    mutations = getattr(case.meta.phase.data, "mutations", ()) if case.meta is not None else ()
    return any(
        mutation.parameter_location == ParameterLocation.HEADER and mutation.parameter == "Authorization"
        for mutation in mutations
    )


CASES = [
    pytest.param(method, path, mode, id=f"{method} {path} {mode.value}")
    for method, path, has_inputs in OPERATIONS
    for mode in ([GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if has_inputs else [GenerationMode.POSITIVE])
]


@pytest.mark.parametrize("method,path,mode", CASES)
def test_fuzz_operation(fuzzed, method, path, mode):
    fuzz(fuzzed, method, path, mode)


def test_after_fuzzing_the_app_still_works(fuzzed, refiner):
    # Self-contained when run alone (-k): fuzz whatever this app has not seen yet.
    for case in CASES:
        if tuple(case.values) not in fuzzed.done:
            fuzz(fuzzed, *case.values)
    assert fuzzed.requests >= len(CASES) * EXAMPLES // 2, "the fuzzer sent suspiciously few requests"
    # The generated safetensors got past the parser and the checks into the engine, not only into 400s.
    chunks = "/v1/sessions/{session_id}/chunks"
    seen = "\n".join(f"{method} {path} {status}: {n}" for (method, path, status), n in sorted(fuzzed.statuses.items()))
    for status in (200, 400, 404, 422):
        assert fuzzed.statuses["POST", chunks, status] > 0, f"no POST chunks {status}; answered:\n{seen}"
    for status in (200, 400, 422):
        assert fuzzed.statuses["POST", "/v1/refine", status] > 0, f"no POST /v1/refine {status}; answered:\n{seen}"
    assert fuzzed.statuses["POST", chunks, 413] + fuzzed.statuses["POST", "/v1/refine", 413] > 0, seen
    client, headers = fuzzed.client, fuzzed.headers
    services = fuzzed.server.services
    wait_until(lambda: services.engine.outstanding == 0, "the engine to settle")
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    assert client.get("/v1/info", headers=headers).status_code == 200

    latents, embeds, mask = make_clip(frames=8, prompt_len=4, seed=5)
    session_id = fuzzed.new_session()
    url = f"/v1/sessions/{session_id}/chunks"
    octet = {**headers, "content-type": OCTET}
    first = client.post(url, params={"seq": 0}, content=payload(latents[:, :, :4], embeds, mask), headers=octet)
    last = client.post(url, params={"seq": 1, "flush": "true"}, content=payload(latents[:, :, 4:]), headers=octet)
    assert first.status_code == last.status_code == 200, (first.text, last.text)
    got = torch.cat([read_latents(first.content)[0], read_latents(last.content)[0]], dim=2)
    assert torch.equal(got, expected_clip(refiner, latents, embeds, mask))
    # The long-lived session took fuzzed chunks; whatever state they left, it still answers coherently.
    if fuzzed.shared_session is not None:
        state = client.get(f"/v1/sessions/{fuzzed.shared_session}", headers=headers)
        assert state.status_code in (200, 404), state.text


# --- the schema itself -------------------------------------------------------------------------------------
def test_the_schema_documents_every_route(fuzzed):
    documented = {
        (method.upper(), path)
        for path, operations in fuzzed.schema.raw_schema["paths"].items()
        for method in operations
    }
    # Routes left out of the schema on purpose (include_in_schema=False: operator routes, the docs pages) are
    # not for clients; everything else a client can call must be documented, and so fuzzed.
    served = {
        (method, context.path)
        for context in iter_route_contexts(fuzzed.server.server.config.app.routes)
        if context.methods and getattr(context.original_route, "include_in_schema", True)
        and context.path not in DOCS_ROUTES
        for method in context.methods - {"HEAD"}
    }
    assert documented == served == {(method, path) for method, path, _ in OPERATIONS}


def test_every_error_status_is_documented_with_the_envelope(fuzzed):
    raw = fuzzed.schema.raw_schema
    for path, operations in raw["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if int(status) < 400 or path == "/ready":
                    continue
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorEnvelope"}, (method, path, status)
            statuses = set(operation["responses"])
            if path not in ("/health", "/ready", "/metrics"):
                assert "401" in statuses, (method, path)
                if fuzzed.headers:
                    assert operation["security"] == [{"api_key": []}], (method, path)
            elif fuzzed.headers:
                assert operation["security"] == [], (method, path)
    bodies = {path: operations["post"]["requestBody"] for path, operations in raw["paths"].items() if "post" in operations}
    assert list(bodies["/v1/refine"]["content"]) == [OCTET]
    assert list(bodies["/v1/sessions/{session_id}/chunks"]["content"]) == [OCTET]
    assert list(bodies["/v1/sessions"]["content"]) == ["application/json"]


F = openapi.FRAMES_MAX
# Configs at the documented bounds (with other fields chosen so no rule across fields interferes), and one
# step past each bound.
AT_THE_BOUNDS = [
    dict(seed=0), dict(seed=openapi.SEED_MAX),
    dict(fps=openapi.FPS_MIN), dict(fps=openapi.FPS_MAX),
    dict(sink_frames=1), dict(sink_frames=F - 1, block_size=1, kv_max_frames=F),
    dict(block_size=1), dict(block_size=F - 1, sink_frames=1, kv_max_frames=F),
    dict(kv_max_frames=openapi.KV_MAX_FRAMES_MIN, sink_frames=1, block_size=1), dict(kv_max_frames=F),
    dict(sigmas=[1.0, 0.0]),
]
PAST_THE_BOUNDS = [
    dict(seed=-1), dict(seed=openapi.SEED_MAX + 1),
    dict(fps=openapi.FPS_MIN * (1 - 1e-9)), dict(fps=openapi.FPS_MAX * (1 + 1e-9)),
    dict(sink_frames=0), dict(sink_frames=F + 1, kv_max_frames=F),
    dict(block_size=0), dict(block_size=F + 1, kv_max_frames=F),
    dict(kv_max_frames=openapi.KV_MAX_FRAMES_MIN - 1, sink_frames=1, block_size=1), dict(kv_max_frames=F + 1),
    dict(sigmas=[0.0]), dict(sigmas=[1.0 + 1e-6, 0.0]), dict(sigmas=[0.5, -1e-6]),
]


@pytest.mark.parametrize("config", AT_THE_BOUNDS, ids=str)
def test_the_model_accepts_the_documented_bounds(config):
    """The schema repeats models.config's ranges; if the model's moved, the schema would lie to clients."""
    SessionConfig(**config)


@pytest.mark.parametrize("config", PAST_THE_BOUNDS, ids=str)
def test_the_model_refuses_past_the_documented_bounds(config):
    from models.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError):
        SessionConfig(**config)
