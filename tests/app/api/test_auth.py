"""The API key covers every route the app registers, HTTP and WebSocket, except /health, /ready, /metrics."""

from __future__ import annotations

import base64
import re

import pytest
from starlette.testclient import WebSocketDenialResponse

from app.api.factory import PUBLIC_PATHS, registered_routes

from tests.app.conftest import OCTET, make_clip, payload, running_app

KEY = "s3cret-key"
WRONG = {"authorization": "Bearer not-the-key"}
GOOD = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def client(checkpoint_dir, tmp_path_factory):
    from app.core.settings import Settings

    settings = Settings(
        model=str(checkpoint_dir), device="cpu", dtype="float32", api_key=KEY, cache_dir=tmp_path_factory.mktemp("c")
    )
    with running_app(settings) as client:
        yield client


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "some-id", path)


def http_routes(app):
    for path, methods, websocket in registered_routes(app):
        if not websocket:
            for method in sorted(methods - {"HEAD"}):
                yield method, path


def ws_routes(app):
    return [path for path, _, websocket in registered_routes(app) if websocket]


def test_the_walk_sees_every_kind_of_route(client):
    paths = {path for _, path in http_routes(client.app)}
    assert {"/v1/sessions", "/v1/sessions/{session_id}/chunks", "/v1/refine", "/v1/info", "/openapi.json"} <= paths
    assert ws_routes(client.app) == ["/v1/sessions/{session_id}/stream", "/v1/sessions/{session_id}/watch"]


def test_every_http_route_but_the_probes_needs_the_key(client):
    checked = 0
    for method, path in http_routes(client.app):
        url = concrete(path)
        if path in PUBLIC_PATHS:
            assert client.request(method, url).status_code == 200, path
            continue
        for headers in ({}, WRONG, {"authorization": KEY}, {"authorization": f"Basic {KEY}"}):
            response = client.request(method, url, headers=headers)
            assert response.status_code == 401, f"{method} {path} with {headers}: {response.status_code}"
            assert response.json()["error"]["code"] == "unauthorized"
            assert response.headers["www-authenticate"].startswith("Bearer")
        # The key in the query string is never read.
        assert client.request(method, url, params={"api_key": KEY, "key": KEY}).status_code == 401
        if path.startswith("/v1/admin/"):
            # With the key it would drain this module's server; test_reliability covers it on a server of its own.
            checked += 1
            continue
        assert client.request(method, url, headers=GOOD).status_code != 401, f"{method} {path} refused the key"
        checked += 1
    assert checked >= 7


def test_every_websocket_route_refuses_before_accepting(client):
    session_id = client.post("/v1/sessions", headers=GOOD).json()["session_id"]
    for path in ws_routes(client.app):
        url = path.replace("{session_id}", session_id)
        for headers in ({}, WRONG):
            with pytest.raises(WebSocketDenialResponse) as denied:
                # A copy: the test client adds its handshake headers to the dict it is given.
                with client.websocket_connect(url, headers=dict(headers)):
                    pass
            assert denied.value.status_code == 401
            assert denied.value.json()["error"]["code"] == "unauthorized"
            assert "'wm-refiner.bearer.<key as base64url, unpadded>'" in denied.value.json()["error"]["message"]
        with pytest.raises(WebSocketDenialResponse):
            with client.websocket_connect(f"{url}?api_key={KEY}"):
                pass
        with client.websocket_connect(url, headers=dict(GOOD)) as ws:
            latents, embeds, _ = make_clip(frames=1)
            ws.send_bytes(payload(latents, embeds))
            assert ws.receive()["type"] == "websocket.send"


def test_unknown_paths_are_401_too(client):
    assert client.get("/v1/secret-admin").status_code == 401
    assert client.get("/v1/secret-admin", headers=GOOD).status_code == 404


def test_the_key_works_end_to_end(client):
    latents, embeds, mask = make_clip(frames=4)
    response = client.post("/v1/refine", content=payload(latents, embeds, mask), headers={**OCTET, **GOOD})
    assert response.status_code == 200


def test_rejections_are_counted(client):
    client.get("/v1/info")
    text = client.get("/metrics").text
    line = next(l for l in text.splitlines() if l.startswith('refiner_rejected_requests_total{reason="unauthorized"}'))
    assert float(line.split()[-1]) >= 1


def test_a_real_server_refuses_the_websocket_handshake_with_401(make_settings):
    import httpx
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from tests.app.conftest import DEADLINE_S, LiveServer

    with LiveServer(make_settings(api_key=KEY)) as server:
        with httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
            assert http.post("/v1/sessions").status_code == 401
            session_id = http.post("/v1/sessions", headers=GOOD).json()["session_id"]
        url = f"{server.ws_url}/v1/sessions/{session_id}/stream"
        for headers in ({}, WRONG):
            with pytest.raises(InvalidStatus) as refused:
                connect(url, additional_headers=headers, open_timeout=DEADLINE_S)
            assert refused.value.response.status_code == 401
        with connect(url, additional_headers=GOOD, open_timeout=DEADLINE_S) as ws:
            ws.send('{"type": "flush"}')
            assert ws.recv(timeout=DEADLINE_S) == '{"type": "done", "frames": 0}'


def bearer_subprotocol(key: str) -> str:
    return "wm-refiner.bearer." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def test_a_websocket_may_carry_the_key_as_a_subprotocol(client):
    """Browsers cannot set headers on a WebSocket (the view page): the key may come as a base64url subprotocol."""
    session_id = client.post("/v1/sessions", headers=GOOD).json()["session_id"]
    url = f"/v1/sessions/{session_id}/stream"
    refused = (
        ["wm-refiner"],
        ["wm-refiner", bearer_subprotocol("not-the-key")],
        ["wm-refiner", bearer_subprotocol(KEY + "x")],
        ["wm-refiner", bearer_subprotocol(KEY) + "=="],  # padding is not a token character: refused, not stripped
        ["wm-refiner", f"wm-refiner.bearer.{KEY}"],  # the key itself, not encoded
        ["wm-refiner", "wm-refiner.bearer."],
        ["wm-refiner", "bearer." + bearer_subprotocol(KEY).rpartition(".")[2]],
    )
    for protocols in refused:
        with pytest.raises(WebSocketDenialResponse) as denied:
            with client.websocket_connect(url, subprotocols=protocols):
                pass
        assert denied.value.status_code == 401, protocols
    # On a plain HTTP request the header is no credential.
    assert client.get("/v1/info", headers={"sec-websocket-protocol": bearer_subprotocol(KEY)}).status_code == 401
    with client.websocket_connect(url, subprotocols=["wm-refiner", bearer_subprotocol(KEY)]) as ws:
        ws.send_text('{"type": "flush"}')
        assert ws.receive_text() == '{"type": "done", "frames": 0}'


def test_the_subprotocol_key_is_base64url():
    """A key whose base64 holds '+' and '/' travels as '-' and '_' (the only alphabet a subprotocol token allows)."""
    from app.api.auth import ApiKeyMiddleware

    key = "wm>>>???key"  # base64 'd20+Pj4/Pz9rZXk=': both substitutions and the padding
    middleware = ApiKeyMiddleware(None, key, public_paths=())

    def authorized(protocol: str, kind: str = "websocket") -> bool:
        return middleware._authorized({"type": kind, "headers": [(b"sec-websocket-protocol", protocol.encode())]},
                                      key.encode())

    assert bearer_subprotocol(key) == "wm-refiner.bearer.d20-Pj4_Pz9rZXk"
    assert authorized("wm-refiner, " + bearer_subprotocol(key))
    assert not authorized("wm-refiner, wm-refiner.bearer.d20+Pj4/Pz9rZXk")
    assert not authorized(bearer_subprotocol(key), kind="http")


def test_one_request_tries_one_key_per_channel(client):
    """Authorization is a singleton field: a request that carried 2,000 of them tried 2,000 keys at once (all fit
    under max_header_bytes), and a handshake as many bearer subprotocols. Several of one kind are refused, the right
    key among them too."""
    guesses = [("authorization", f"Bearer guess-{i}") for i in range(50)]
    assert client.get("/v1/info", headers=[*guesses, ("authorization", f"Bearer {KEY}")]).status_code == 401
    assert client.get("/v1/info", headers=[("authorization", f"Bearer {KEY}")] * 2).status_code == 401
    assert client.get("/v1/info", headers=[("authorization", f"Bearer {KEY}")]).status_code == 200
    session_id = client.post("/v1/sessions", headers=GOOD).json()["session_id"]
    url = f"/v1/sessions/{session_id}/stream"
    many = ["wm-refiner", *(bearer_subprotocol(f"guess-{i}") for i in range(50)), bearer_subprotocol(KEY)]
    with pytest.raises(WebSocketDenialResponse) as denied:
        with client.websocket_connect(url, subprotocols=many):
            pass
    assert denied.value.status_code == 401
    # one of each kind (a proxy that adds the header to a page's handshake carrying the subprotocol) still works
    with client.websocket_connect(url, subprotocols=["wm-refiner", bearer_subprotocol(KEY)], headers=GOOD) as ws:
        ws.send_text('{"type": "flush"}')
        assert ws.receive_text() == '{"type": "done", "frames": 0}'


def test_a_key_configured_with_a_trailing_newline_is_the_key_without_it(checkpoint_dir, tmp_path, monkeypatch):
    """A key read from a file or a Kubernetes secret ends with a newline; clients send the key without it, so, as
    configured, it matched no request (every call 401). It is the key without the space around it; a key of
    whitespace only is refused at start-up (it would otherwise mean "no authentication" or "nobody"), without
    the value in the message."""
    from pydantic import ValidationError

    from app.core.settings import Settings

    monkeypatch.setenv("WM_REFINER_API_KEY", f"{KEY}\n")
    settings = Settings(model=str(checkpoint_dir), device="cpu", dtype="float32", cache_dir=tmp_path)
    assert settings.api_key == KEY
    with running_app(settings) as client:
        assert client.get("/v1/info", headers=GOOD).status_code == 200
        assert client.get("/v1/info", headers=WRONG).status_code == 401
    monkeypatch.setenv("WM_REFINER_API_KEY", " \n")
    with pytest.raises(ValidationError) as refused:
        Settings(model=str(checkpoint_dir), device="cpu", dtype="float32", cache_dir=tmp_path)
    assert "api_key is only whitespace" in str(refused.value)
    monkeypatch.delenv("WM_REFINER_API_KEY")
    assert Settings(peer_api_key=" peer-key ", cache_dir=tmp_path).peer_api_key == "peer-key"


ADMIN = "adm1n-key"


def test_with_an_admin_key_only_it_drains_and_it_opens_nothing_else(checkpoint_dir, tmp_path):
    """admin_api_key set: the operator routes take it and not the clients' api_key (a client holding the service's
    key drained a replica), and it opens no client route. Without api_key, the client routes stay open and the
    drain still needs the admin key."""
    from app.core.settings import Settings

    def settings(**keys):
        return Settings(model=str(checkpoint_dir), device="cpu", dtype="float32", cache_dir=tmp_path, **keys)

    admin = {"authorization": f"Bearer {ADMIN}"}
    with running_app(settings(api_key=KEY, admin_api_key=f"{ADMIN}\n")) as client:
        refused = client.post("/v1/admin/drain", headers=GOOD)
        assert refused.status_code == 401
        assert "admin_api_key" in refused.json()["error"]["message"]
        assert client.get("/v1/info", headers=admin).status_code == 401  # the admin key is no client key
        assert client.get("/v1/info", headers=GOOD).status_code == 200
        assert client.get("/ready").status_code == 200  # nothing was drained
        drained = client.post("/v1/admin/drain", headers=admin)
        assert drained.status_code == 200 and drained.json()["draining"] is True
    with running_app(settings(admin_api_key=ADMIN)) as client:
        assert client.get("/v1/info").status_code == 200
        assert client.post("/v1/admin/drain").status_code == 401
        assert client.get("/ready").status_code == 200
