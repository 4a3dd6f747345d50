"""One declaration of a session's fields (wm_refiner_client.spec) and what is derived from it: the model's config
agrees with it, and the JSON body, /v1/refine's query, the OpenAPI document, the settings, /v1/info, the command
line and the client's keyword arguments list exactly its fields. One session-id rule at every entry (routes,
client, snapshot files), one replica_id rule at start-up."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from app.api.factory import create_app
from app.cli.commands import build_parser
from app.cli.remote import session_flags
from app.core.settings import Settings, check_replica_id, load_settings
from app.persistence.leases import acquire
from app.persistence.records import has_snapshot, remove_record, snapshot_path
from models.config import SessionConfig
from models.errors import InvalidConfigError
from wm_refiner_client import Client, spec
from wm_refiner_client._common import CONFIG_FIELDS, check_config, refine_query

from tests.app.conftest import NGINX, LiveServer, nginx_prefix

ROOT = Path(__file__).resolve().parents[3]


# --- the model's config ----------------------------------------------------------------------------------------------
def test_the_spec_and_the_models_config_have_the_same_fields_and_defaults():
    model_fields = [f.name for f in dataclasses.fields(SessionConfig)]
    assert list(spec.CONFIG_NAMES) == model_fields
    assert SessionConfig().to_dict() == {name: spec.BY_NAME[name].default_json() for name in spec.CONFIG_NAMES}
    assert set(spec.OUTPUT_NAMES) == {"outputs", "video_format", "video_quality", "video_lookahead", "preview_width"}


def _valid_around(name: str, value) -> dict:
    """A config with ``name`` = ``value`` and the other fields chosen so no rule across fields interferes."""
    config = {name: value}
    if name == "sink_frames":
        config.update(block_size=1, kv_max_frames=max(value + 1, 2))
    elif name == "block_size":
        config.update(sink_frames=1, kv_max_frames=max(value + 1, 2))
    elif name == "kv_max_frames":
        config.update(sink_frames=1, block_size=1)
    return config


@pytest.mark.parametrize("field", [f for f in spec.FIELDS if f.part == spec.CONFIG and f.kind in (spec.INTEGER, spec.NUMBER)],
                         ids=lambda f: f.name)
def test_the_model_takes_the_specs_bounds_and_refuses_past_them(field):
    low = field.minimum + (1e-9 if field.exclusive_minimum else 0)
    # The largest value a rule across fields still allows: a sink or a block needs one more frame of window.
    high = field.maximum - 1 if field.name in ("sink_frames", "block_size") else field.maximum
    for value in (low, high):
        value = int(value) if field.kind == spec.INTEGER else value
        SessionConfig(**_valid_around(field.name, value))
    below = field.minimum if field.exclusive_minimum else field.minimum - 1
    above = field.maximum + 1 if field.kind == spec.INTEGER else field.maximum * (1 + 1e-9)
    for value in (below, above):
        value = int(value) if field.kind == spec.INTEGER else value
        with pytest.raises(InvalidConfigError, match=field.name):
            SessionConfig(**{field.name: value})


def test_the_model_takes_the_specs_choices_and_schedules():
    for choice in spec.BY_NAME["positions"].choices:
        SessionConfig(positions=choice)
    with pytest.raises(InvalidConfigError, match="positions"):
        SessionConfig(positions="relative")
    sigmas = spec.BY_NAME["sigmas"]
    SessionConfig(sigmas=[sigmas.maximum, sigmas.minimum])  # min_items values at the item bounds
    for bad in ([0.0], [sigmas.maximum + 1e-6, 0.0], [0.5, sigmas.minimum - 1e-6]):
        with pytest.raises(InvalidConfigError, match="sigmas"):
            SessionConfig(sigmas=bad)


# --- settings ----------------------------------------------------------------------------------------------------
def test_each_server_default_is_a_setting_with_the_specs_default():
    settings = Settings()
    for field in spec.FIELDS:
        if field.setting is None:
            assert field.part != spec.CONFIG, field.name  # every model field has a server default
            continue
        assert Settings.model_fields[field.setting].default == field.default, field.name
    assert settings.session_default_values() == spec.defaults()
    changed = Settings(default_block_size=2, default_sigmas=(0.9, 0.0), default_positions="rebased")
    values = changed.session_default_values()
    assert (values["block_size"], values["sigmas"], values["positions"]) == (2, [0.9, 0.0], "rebased")


# --- OpenAPI, the body, the query --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def schema() -> dict:
    return create_app(Settings(warmup=False)).openapi()


def _without_null(prop: dict) -> dict:
    """A property's schema less pydantic's null branch and its docs."""
    prop = {k: v for k, v in prop.items() if k not in ("title", "description", "default")}
    branches = [b for b in prop.pop("anyOf", []) if b != {"type": "null"}]
    if not branches:
        return prop
    return {**prop, **branches[0]} if len(branches) == 1 else {**prop, "anyOf": branches}


def test_the_session_body_in_openapi_is_the_spec(schema):
    for path, method in (("/v1/sessions", "post"), ("/v1/sessions/{session_id}", "put")):
        body = schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        assert list(body["properties"]) == list(spec.NAMES) and body["additionalProperties"] is False
        for field in spec.FIELDS:
            prop = body["properties"][field.name]
            assert _without_null(prop) == field.json_schema(), field.name
            assert prop["description"] == field.doc


def test_the_config_in_responses_is_the_spec(schema):
    out = schema["components"]["schemas"]["SessionConfigOut"]
    assert list(out["properties"]) == list(spec.NAMES)
    assert sorted(out["required"]) == sorted(spec.NAMES)


@pytest.mark.parametrize("path", ["/v1/sessions/{session_id}/chunks", "/v1/refine"])
def test_openapi_describes_the_refined_payload_of_chunks_and_refine(schema, path):
    """The 200 body is safetensors only (no JSON), its tensors and metadata listed, seq and latency_ms required,
    and the example header is one a reader of the documented layout decodes."""
    import json
    import struct

    import jsonschema
    from safetensors.torch import load

    ok = schema["paths"][path]["post"]["responses"]["200"]
    assert list(ok["content"]) == ["application/octet-stream"]
    for words in ("little-endian", "__metadata__", "seq", "latency_ms", "frame_start", "frame_end"):
        assert words in ok["description"], words
    described = ok["content"]["application/octet-stream"]["x-safetensors"]
    assert {"latents", "video"} <= set(described["tensors"])
    metadata = described["metadata"]
    assert {"frame_start", "frame_end", "seq", "latency_ms"} <= set(metadata["required"])
    jsonschema.Draft202012Validator.check_schema(metadata)
    example = described["example_header"]
    jsonschema.validate(example["__metadata__"], metadata)
    assert json.dumps(example, separators=(",", ":")) in ok["description"]
    header = json.dumps(example).encode()
    end = example["latents"]["data_offsets"][1]
    tensors = load(struct.pack("<Q", len(header)) + header + bytes(end))
    assert list(tensors["latents"].shape) == example["latents"]["shape"]


def test_each_routes_400_and_409_say_exactly_when(schema):
    """The 400 and 409 of each route name the error codes it answers with, and no other route's."""
    import re

    from app.core.error_kinds import ERRORS

    def said(path: str, method: str, status: str) -> str:
        return schema["paths"][path][method]["responses"][status]["description"]

    def codes(text: str) -> set[str]:
        return set(re.findall(r"\b([a-z]+_[a-z_]+):", text))

    chunks, refine = "/v1/sessions/{session_id}/chunks", "/v1/refine"
    assert codes(said("/v1/sessions/{session_id}", "put", "409")) == {"session_exists"}
    assert codes(said(chunks, "post", "409")) == {"seq_conflict", "stream_closed"}
    assert codes(said("/v1/sessions", "post", "400")) == {"invalid_payload"}
    assert "JSON" in said("/v1/sessions", "post", "400") and "safetensors" not in said("/v1/sessions", "post", "400")
    assert said("/v1/sessions", "post", "400") == said("/v1/sessions/{session_id}", "put", "400")
    for path in (chunks, refine):
        assert codes(said(path, "post", "400")) == {"invalid_payload", "missing_input"}
    assert "empty while flush is not true" in said(chunks, "post", "400")
    assert all(ERRORS[code] for path in (chunks, refine) for code in codes(said(path, "post", "400")))
    body = schema["paths"][chunks]["post"]["requestBody"]
    assert body["required"] is False and "empty with flush=true" in body["description"]


def test_refines_query_parameters_are_the_specs_query_fields(schema):
    parameters = {p["name"]: p for p in schema["paths"]["/v1/refine"]["post"]["parameters"] if p["in"] == "query"}
    assert list(parameters) == list(spec.QUERY_NAMES)
    assert "sigmas" not in parameters and not spec.BY_NAME["sigmas"].in_query
    for field in spec.FIELDS:
        if not field.in_query:
            continue
        value = _without_null(parameters[field.name]["schema"])
        if field.kind in (spec.INTEGER, spec.NUMBER, spec.CHOICE):
            assert value == field.json_schema(), field.name
        else:  # lists and the look-ahead are text, read by SessionField.from_text
            assert value["type"] == "string", field.name



@pytest.mark.skipif(not os.path.exists(NGINX), reason="needs Debian's nginx (apt-get install nginx)")
def test_behind_a_proxy_under_a_path_prefix_the_docs_pages_load_the_schema_under_the_prefix(make_settings, tmp_path):
    """/docs and /redoc name the schema relative to themselves: behind nginx under /refiner/ they load
    /refiner/openapi.json (FastAPI's pages named /openapi.json, at the origin's root, where nothing of this server's
    is; docs/api.md "Behind a reverse proxy"). At the root they load /openapi.json, as before."""
    import re
    from urllib.parse import urljoin

    import httpx

    with LiveServer(make_settings()) as server, nginx_prefix(server.port, tmp_path / "nginx") as url:
        expected = httpx.get(f"{server.base_url}/openapi.json").json()
        for base in (url, server.base_url):
            for page, named in (("docs", r"url: '([^']+)'"), ("redoc", r'spec-url="([^"]+)"')):
                html = httpx.get(f"{base}/{page}")
                assert html.status_code == 200, html.text
                target = urljoin(f"{base}/{page}", re.search(named, html.text).group(1))
                assert target == f"{base}/openapi.json"
                assert httpx.get(target).json() == expected, target

# --- the command line --------------------------------------------------------------------------------------------
def _help(command: str) -> str:
    result = subprocess.run([sys.executable, "-m", "app", command, "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_stream_help_lists_every_field_and_refine_help_the_models():
    stream = _help("stream")
    for field in spec.FIELDS:
        assert field.flag in stream and field.doc in " ".join(stream.split()), field.name
    refine = _help("refine")
    for field in spec.FIELDS:
        assert (field.flag in refine) == (field.part == spec.CONFIG), field.name
    assert "(default: 0.909375,0.725,0.421875,0.0)" in " ".join(refine.split())


def test_flags_are_read_as_query_text_is():
    args = build_parser().parse_args([
        "stream", "--input", "a", "--output", "b", "--seed", "7", "--fps", "8", "--sigmas", "0.9,0.5,0.0",
        "--outputs", "latents,video", "--video-lookahead", "2", "--positions", "rebased",
    ])
    assert session_flags(args) == {"seed": 7, "fps": 8.0, "sigmas": [0.9, 0.5, 0.0], "outputs": ["latents", "video"],
                                   "video_lookahead": 2, "positions": "rebased"}
    refine = build_parser().parse_args(["refine", "--model", "m", "--input", "a", "--output", "b"])
    assert SessionConfig.from_dict(session_flags(refine, spec.CONFIG_NAMES)) == SessionConfig()
    for bad in (["--seed", "7.5"], ["--video-lookahead", "soon"], ["--positions", "relative"], ["--sigmas", "a,b"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["stream", "--input", "a", "--output", "b", *bad])


@pytest.mark.parametrize("flags,fragment", [
    (["--outputs", "video"], "add latents to --outputs"),
    (["--video", "v.mp4", "--outputs", "latents"], "add video to --outputs"),
    (["--video", "v.mp4", "--video-format", "float32"], "leave --video-format unset or h264"),
])
def test_stream_refuses_outputs_its_files_cannot_hold_before_reading_anything(flags, fragment):
    from app.cli.remote import stream_command

    args = build_parser().parse_args(["stream", "--input", "/nonexistent/in.safetensors", "--output", "o", *flags])
    with pytest.raises(ValueError, match=fragment):
        stream_command(args)


# --- the client --------------------------------------------------------------------------------------------------
def test_the_clients_keyword_arguments_are_the_spec():
    assert CONFIG_FIELDS == spec.NAMES
    assert check_config({"seed": 7, "outputs": None}) == {"seed": 7}
    with pytest.raises(TypeError, match="block_sise"):
        check_config({"block_sise": 3})
    with Client("http://127.0.0.1:9") as client:  # nothing listens: the checks come before any request
        with pytest.raises(TypeError, match="unknown session config"):
            client.create_session(sink_frame=2)
        with pytest.raises(TypeError, match="sigmas"):
            client.refine(np.zeros((1, 128, 2, 2, 2), dtype=np.float32), sigmas=[0.5, 0.0])


def test_query_text_round_trips_through_the_spec():
    for field in spec.FIELDS:
        if field.in_query:
            text = refine_query({field.name: field.default_json()})[field.name]
            assert field.from_text(text) == field.default_json(), field.name
    assert refine_query({"outputs": ["latents", "video"], "video_lookahead": 3}) == {
        "outputs": "latents,video", "video_lookahead": "3"}
    assert spec.lookahead_frames(spec.BY_NAME["video_lookahead"].from_text("exact")) is None
    assert spec.lookahead_frames(spec.BY_NAME["video_lookahead"].from_text("4")) == 4
    for bad in (-1, True, "4", 1.5, spec.FRAMES_MAX + 1):
        with pytest.raises(ValueError, match="video_lookahead"):
            spec.lookahead_frames(bad)


# --- /v1/info ----------------------------------------------------------------------------------------------------
def test_info_reports_the_specs_fields_defaults_and_limits(make_settings):
    from tests.app.conftest import running_app

    settings = make_settings(default_block_size=2, max_window_frames=20, max_denoise_steps=5)
    with running_app(settings) as client:
        info = client.get("/v1/info").json()
        created = client.post("/v1/sessions").json()
    assert info["default_session_config"] == {**spec.defaults(), "block_size": 2}
    assert created["config"] == info["default_session_config"]
    fields = info["session_fields"]
    assert list(fields) == list(spec.NAMES)
    for field in spec.FIELDS:
        entry = fields[field.name]
        assert entry["schema"] == field.json_schema() and entry["doc"] == field.doc
        assert entry["default"] == info["default_session_config"][field.name]
        assert entry["query"] == field.in_query
        assert entry["limits"] == {name: getattr(settings, name) for name in field.limited_by}
        for name in field.limited_by:
            assert info["limits"][name] == getattr(settings, name)
    assert fields["kv_max_frames"]["limits"] == {"max_window_frames": 20}
    assert fields["sigmas"]["limits"] == {"max_denoise_steps": 5}


# --- session ids -------------------------------------------------------------------------------------------------
GOOD_IDS = ["abcdefgh", "A" * 64, "client-chosen_id-0001", "0123456789abcdef0123456789abcdef"]
BAD_IDS = ["short", "x" * 65, "dots.are.not.ok", "has space in", "../../etc/passwd", "abc/defgh", "ümlautsxx", "",
           "abcdefg*", "abcdefgh\n"]


def test_the_session_id_rule():
    assert all(spec.is_session_id(good) for good in GOOD_IDS)
    for bad in [*BAD_IDS, None, 12345678]:
        assert not spec.is_session_id(bad), bad
        with pytest.raises(ValueError, match="8 to 64"):
            spec.check_session_id(bad)


def test_a_bad_id_never_becomes_a_snapshot_path(tmp_path):
    assert snapshot_path(tmp_path, "abcdefgh") == tmp_path / "abcdefgh.session.safetensors"
    (tmp_path / "x.session.safetensors").write_bytes(b"")  # a file a short id would name
    for bad in BAD_IDS:
        for reach in (lambda: snapshot_path(tmp_path, bad), lambda: has_snapshot(tmp_path, bad),
                      lambda: remove_record(tmp_path, bad), lambda: acquire(tmp_path, bad, "replica-a", 10.0)):
            with pytest.raises(ValueError, match="8 to 64"):
                reach()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.session.safetensors"]


def test_routes_apply_the_rule(make_settings, tmp_path):
    from tests.app.conftest import running_app

    folder = tmp_path / "snapshots"
    folder.mkdir()
    (folder / "dots.are.not.ok.session.safetensors").write_bytes(b"not looked at")
    with running_app(make_settings(snapshot_dir=folder)) as client:
        made = client.post("/v1/sessions").json()["session_id"]
        assert spec.is_session_id(made), "the ids the server makes obey the rule too"
        for bad in ("short", "x" * 65, "dots.are.not.ok", "has space in"):
            put = client.put(f"/v1/sessions/{bad}", json={})
            assert put.status_code == 422 and "8 to 64" in put.json()["error"]["message"], bad
            for method in ("get", "delete"):
                answer = getattr(client, method)(f"/v1/sessions/{bad}")
                assert answer.status_code == 404 and answer.json()["error"]["code"] == "session_not_found", bad
                assert spec.SESSION_ID_RULE in answer.json()["error"]["message"]
            chunk = client.post(f"/v1/sessions/{bad}/chunks", content=b"", headers={"content-type": "application/octet-stream"})
            assert chunk.status_code == 404, bad
        assert client.put("/v1/sessions/abcdefgh", json={}).status_code == 201
    assert (folder / "dots.are.not.ok.session.safetensors").read_bytes() == b"not looked at"


def test_the_client_refuses_bad_ids_before_sending():
    with Client("http://127.0.0.1:9") as client:  # nothing listens there
        for bad in ("short", "no spaces allowed", "../../etc/passwd"):
            for call in (lambda: client.session(bad), lambda: client.get_session(bad),
                         lambda: client.delete_session(bad)):
                with pytest.raises(ValueError, match="8 to 64"):
                    call()


# --- replica ids -------------------------------------------------------------------------------------------------
def test_replica_id_must_be_a_safe_token(monkeypatch):
    for good in ("replica-a", "pod-7.wm-refiner.default", "host_1-1234", "a" * 128):
        assert Settings(replica_id=good).replica_id == good
    for bad in ("", "a/b", "x y", "a\r\nX-Injected: 1", "claim*", "-lead", ".hidden", "a" * 129, "ünï"):
        with pytest.raises(ValidationError, match="replica_id"):
            Settings(replica_id=bad)
        with pytest.raises(ValueError, match="safe token"):
            check_replica_id(bad)
    monkeypatch.setenv("WM_REFINER_REPLICA_ID", "bad/one")
    with pytest.raises(ValueError, match=r"^\$WM_REFINER_REPLICA_ID='bad/one': replica_id"):
        load_settings()
    monkeypatch.delenv("WM_REFINER_REPLICA_ID")
    default = Settings().replica_id
    assert check_replica_id(default)  # the default is always valid
    # ... and, being on unauthenticated responses (X-Replica), says nothing about the host or the process.
    assert socket.gethostname() not in default and str(os.getpid()) not in default
    assert Settings().replica_id != default, "a new id per process (per Settings), not a fixed name"


def test_serve_stops_at_start_up_on_a_bad_replica_id(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_REFINER_")}
    env["WM_REFINER_REPLICA_ID"] = "a b/c"
    result = subprocess.run([sys.executable, "-m", "app", "serve", "--port", "0"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "replica_id" in result.stderr and "safe token" in result.stderr
