"""The WebSocket protocol's AsyncAPI document (app/static/asyncapi.yaml, served as GET /asyncapi.yaml): a valid
AsyncAPI 3 document, complete (every WebSocket route, event type and error code of the server is in it), and true
(the events and unit metadata a live server sends validate against its schemas).

Validity is checked against the AsyncAPI initiative's own JSON Schema of the 3.0.0 specification
(asyncapi-3.0.0.schema.json beside this file: ``schemas/3.0.0-without-$id.json`` of the npm package
@asyncapi/specs 6.11.1, Apache-2.0), so the check needs no network."""

from __future__ import annotations

import importlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
import jsonschema
import pytest
import yaml
from starlette.routing import WebSocketRoute
from websockets.sync.client import connect

from app.core.error_kinds import ERRORS
from bench.live import ROOT
from tests.app.conftest import NGINX, nginx_prefix
from wm_refiner_client.units import encode, read_metadata

from .conftest import clip

DOCUMENT_PATH = ROOT / "app" / "static" / "asyncapi.yaml"
DOCUMENT = yaml.safe_load(DOCUMENT_PATH.read_text())
SPECIFICATION = json.loads((Path(__file__).parent / "asyncapi-3.0.0.schema.json").read_text())


def resolve(node: Any, document: dict = DOCUMENT) -> Any:
    """``node`` with every local ``$ref`` replaced by what it points to."""
    if isinstance(node, dict):
        if set(node) == {"$ref"}:
            target: Any = document
            for part in node["$ref"].removeprefix("#/").split("/"):
                target = target[part]
            return resolve(target, document)
        return {key: resolve(value, document) for key, value in node.items()}
    if isinstance(node, list):
        return [resolve(item, document) for item in node]
    return node


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if "$ref" in node else []
        return found + [ref for value in node.values() for ref in refs(value)]
    if isinstance(node, list):
        return [ref for item in node for ref in refs(item)]
    return []


def event_schemas() -> dict[str, dict]:
    """Each JSON message's payload schema, by its ``type``."""
    schemas = {}
    for message in resolve(DOCUMENT["components"]["messages"]).values():
        kind = message["payload"].get("properties", {}).get("type", {}).get("const")
        if kind is not None:
            schemas[kind] = message["payload"]
    return schemas


def test_the_document_is_asyncapi_3_and_its_references_resolve():
    validator = jsonschema.Draft7Validator(SPECIFICATION)
    problems = [f"{list(error.path)}: {error.message[:200]}" for error in validator.iter_errors(DOCUMENT)]
    assert not problems, problems
    broken = {**DOCUMENT, "operations": {"x": {"action": "publish", "channel": {"$ref": "#/channels/stream"}}}}
    assert not validator.is_valid(broken)  # the check can fail: AsyncAPI 2's verbs are not 3's
    for ref in refs(DOCUMENT):
        assert ref.startswith("#/"), ref
        resolve({"$ref": ref})  # a KeyError names a dangling reference
    for name, operation in DOCUMENT["operations"].items():
        channel = operation["channel"]["$ref"]
        for message in operation["messages"]:
            assert message["$ref"].startswith(channel + "/messages/"), f"{name}: a message of another channel"
    for message in resolve(DOCUMENT["components"]["messages"]).values():
        jsonschema.Draft7Validator.check_schema(message["payload"])


def test_every_websocket_route_event_and_error_code_is_documented():
    routes = set()
    for module_path in (ROOT / "app" / "api" / "routes").glob("*.py"):
        module = importlib.import_module(f"app.api.routes.{module_path.stem}")
        router = getattr(module, "router", None)
        routes |= {r.path for r in getattr(router, "routes", []) if isinstance(r, WebSocketRoute)}
    assert routes == {channel["address"] for channel in DOCUMENT["channels"].values()}
    sent = set()
    for module in ("stream.py", "watch.py"):
        sent |= set(re.findall(r'"type": "(\w+)"', (ROOT / "app" / "api" / "routes" / module).read_text()))
    sent.discard("flush")  # received, not sent
    assert sent and sent <= set(event_schemas()), f"undocumented events: {sent - set(event_schemas())}"
    codes = DOCUMENT["components"]["schemas"]["ErrorBody"]["properties"]["code"]["enum"]
    assert set(codes) == set(ERRORS)


def test_the_server_serves_the_document(server):
    response = httpx.get(f"{server.base_url}/asyncapi.yaml")
    assert response.status_code == 200 and response.text == DOCUMENT_PATH.read_text()
    # /openapi.json (the HTTP routes) points at it, where a client generator starts.
    description = httpx.get(f"{server.base_url}/openapi.json").json()["info"]["description"]
    assert "[asyncapi.yaml](asyncapi.yaml)" in description


@pytest.mark.skipif(not os.path.exists(NGINX), reason="needs Debian's nginx (apt-get install nginx)")
def test_behind_a_proxy_under_a_path_prefix_openapi_links_the_document_under_the_prefix(server, tmp_path):
    """/openapi.json's link to this document is relative: resolved against the pages that show it (/docs, /redoc)
    or the document itself, behind nginx under /refiner/ it names /refiner/asyncapi.yaml. It was /asyncapi.yaml,
    the origin's root, where nothing of this server's is (docs/api.md "Behind a reverse proxy")."""
    with nginx_prefix(server.port, tmp_path / "nginx") as url:
        description = httpx.get(f"{url}/openapi.json").json()["info"]["description"]
        link = re.search(r"\[[^\]]*\]\(([^)]*asyncapi[^)]*)\)", description).group(1)
        for page in ("docs", "redoc", "openapi.json"):
            target = urljoin(f"{url}/{page}", link)
            response = httpx.get(target)
            assert response.status_code == 200 and response.text == DOCUMENT_PATH.read_text(), (page, target)


def test_what_a_live_server_sends_matches_the_document(server):
    latents, prompt, _ = clip(8)
    session = httpx.post(f"{server.base_url}/v1/sessions", json={}).json()["session_id"]
    schemas = event_schemas()
    unit_doc = resolve(DOCUMENT["components"]["messages"]["unit"])["x-safetensors"]
    received: list[Any] = []
    watched: list[Any] = []
    joined = threading.Event()

    def watch() -> None:
        with connect(f"{server.ws_url}/v1/sessions/{session}/watch", max_size=None) as ws:
            joined.set()
            for message in ws:
                watched.append(message)

    watcher = threading.Thread(target=watch)
    watcher.start()
    assert joined.wait(30)
    with connect(f"{server.ws_url}/v1/sessions/{session}/stream?resume_from=0", max_size=None) as ws:
        ws.send('{"type": "pause"}')  # not a message of the protocol: an error event
        ws.send(encode({"latents": latents[:, :, :5], "prompt_embeds": prompt}))
        ws.send(encode({"latents": latents[:, :, 5:]}))
        ws.send('{"type": "flush"}')
        received.extend(ws)
    watcher.join(30)
    events = [json.loads(m) for m in received + watched if isinstance(m, str)]
    assert {event["type"] for event in events} == {"session", "error", "block", "done"}
    for event in events:
        jsonschema.validate(event, schemas[event["type"]])
    units = [m for m in received + watched if isinstance(m, bytes)]
    assert len(units) == 2 * 4  # sink, two blocks, the short one: on the stream and to the watcher
    for data in units:
        jsonschema.validate(read_metadata(data), unit_doc["metadata"])
        from safetensors.numpy import load

        assert set(load(data)) <= set(unit_doc["tensors"])


@pytest.mark.parametrize("name", ["chunk", "unit"])
def test_binary_messages_name_their_tensors(name):
    message = DOCUMENT["components"]["messages"][name]
    assert message["contentType"] == "application/octet-stream" and message["x-safetensors"]["tensors"]


