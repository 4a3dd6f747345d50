"""cors_origins: CORS on HTTP (preflights answered before the API key, errors readable) and the Origin check on
WebSocket handshakes. The same in a real browser: tests/app/api/test_view_browser.py (test_a_page_on_another_origin_*)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from starlette.testclient import WebSocketDenialResponse

from app.core.settings import Settings

from tests.app.conftest import running_app

KEY = "cors-key"
ALLOWED = "http://localhost:3000"
OTHER = "http://evil.example"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def client(checkpoint_dir, tmp_path_factory):
    settings = Settings(model=str(checkpoint_dir), device="cpu", dtype="float32", api_key=KEY,
                        cors_origins=f"{ALLOWED}, https://app.example.com", cache_dir=tmp_path_factory.mktemp("c"))
    with running_app(settings) as client:
        yield client


def preflight(client, origin: str, method: str, path: str, headers: str = "authorization, content-type"):
    return client.options(path, headers={"origin": origin, "access-control-request-method": method,
                                         "access-control-request-headers": headers})


def test_a_preflight_from_an_allowed_origin_is_answered_without_the_key(client):
    for method, path in (("GET", "/v1/info"), ("POST", "/v1/sessions"), ("DELETE", "/v1/sessions/some-id")):
        response = preflight(client, ALLOWED, method, path)
        assert response.status_code == 200, (path, response.text)
        assert response.headers["access-control-allow-origin"] == ALLOWED
        assert method in response.headers["access-control-allow-methods"]
        assert "authorization" in response.headers["access-control-allow-headers"].lower()


def test_a_preflight_from_another_origin_is_refused_with_the_error_envelope(client):
    # Starlette's own refusal was a plain-text 400 "Disallowed CORS origin" that named no setting.
    for method in ("POST", "GET", "DELETE"):
        response = preflight(client, OTHER, method, "/v1/sessions")
        assert response.status_code == 403, response.text
        error = response.json()["error"]
        assert error["code"] == "origin_not_allowed"
        assert f"a CORS preflight for a {method} from a page on origin {OTHER!r}" in error["message"]
        assert "cors_origins" in error["message"]
        assert "access-control-allow-origin" not in response.headers
        assert "x-replica" in response.headers
    # a plain OPTIONS without the preflight's header is not a preflight: answered as before
    assert client.options("/v1/sessions", headers={**AUTH, "origin": OTHER}).status_code != 403


def test_answers_and_errors_carry_the_cors_headers_for_an_allowed_origin(client):
    origin = {"origin": ALLOWED}
    info = client.get("/v1/info", headers={**AUTH, **origin})
    assert info.status_code == 200
    assert info.headers["access-control-allow-origin"] == ALLOWED
    assert "x-replica" in info.headers["access-control-expose-headers"].lower()
    for response, code in ((client.get("/v1/info", headers=origin), "unauthorized"),
                           (client.get("/v1/sessions/no-such-session", headers={**AUTH, **origin}),
                            "session_not_found"),
                           (client.post("/v1/sessions", json={"block_size": -1}, headers={**AUTH, **origin}),
                            "invalid_config")):
        assert response.json()["error"]["code"] == code, response.text
        assert response.headers["access-control-allow-origin"] == ALLOWED, code
    assert "access-control-allow-origin" not in client.get("/v1/info", headers={**AUTH, "origin": OTHER}).headers


def test_a_websocket_from_another_origin_is_refused_with_403(client):
    created = client.post("/v1/sessions", json={}, headers=AUTH).json()["session_id"]
    for route in ("stream", "watch"):
        path = f"/v1/sessions/{created}/{route}"
        with pytest.raises(WebSocketDenialResponse) as denied:
            with client.websocket_connect(path, headers={**AUTH, "origin": OTHER}):
                pass
        assert denied.value.status_code == 403
        assert denied.value.json()["error"]["code"] == "origin_not_allowed"
        assert OTHER in denied.value.json()["error"]["message"]
        assert "x-replica" in denied.value.headers
        # an allowed origin, this server's own (the view page) and a program (no Origin) are let through
        for headers in ({"origin": ALLOWED}, {"origin": "http://testserver"}, {}):
            with client.websocket_connect(path, headers={**AUTH, **headers}) as websocket:
                websocket.close()


def test_the_setting_takes_origins_and_refuses_what_no_browser_sends(make_settings):
    assert make_settings().cors_origins == ()
    assert make_settings(cors_origins="http://a.test:8080,https://B.test").cors_origins == (
        "http://a.test:8080", "https://b.test")
    assert make_settings(cors_origins=["*"]).cors_origins == ("*",)
    for wrong in ("localhost:3000", "http://a.test/", "http://a.test/app", "ftp://a.test"):
        with pytest.raises(ValidationError, match="scheme://host"):
            make_settings(cors_origins=wrong)


def test_without_cors_origins_nothing_changes(make_settings):
    with running_app(make_settings()) as client:
        response = client.get("/v1/info", headers={"origin": OTHER})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
        created = client.post("/v1/sessions", json={}).json()["session_id"]
        with client.websocket_connect(f"/v1/sessions/{created}/watch", headers={"origin": OTHER}) as websocket:
            websocket.close()


def test_a_request_that_changes_something_from_another_origin_is_refused_before_any_route(client):
    """CORS keeps a foreign page from reading answers, not from sending a request without a preflight (a POST with
    no body, no Content-Type): before the fix such a page created sessions, flushed them and drained the server."""
    created = client.post("/v1/sessions", json={}, headers=AUTH).json()["session_id"]
    before = client.get("/v1/sessions", headers=AUTH).json()["sessions"]
    for method, path in (("POST", "/v1/sessions"), ("POST", f"/v1/sessions/{created}/chunks?flush=true"),
                         ("PUT", "/v1/sessions/foreign-page-1"), ("DELETE", f"/v1/sessions/{created}"),
                         ("POST", "/v1/admin/drain"), ("PATCH", "/v1/sessions")):
        response = client.request(method, path, headers={**AUTH, "origin": OTHER})
        assert response.status_code == 403, (method, path, response.text)
        assert response.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in response.headers
        assert "x-replica" in response.headers  # which replica refused it, as for every answer
    assert client.get("/v1/sessions", headers=AUTH).json()["sessions"] == before
    assert client.get(f"/v1/sessions/{created}", headers=AUTH).json()["flushed"] is False
    assert client.get("/ready").status_code == 200
    # reading stays as it was (the browser keeps the answer from the page); an allowed origin, this server's own
    # pages and programs (no Origin) change things as before
    assert client.get("/v1/info", headers={**AUTH, "origin": OTHER}).status_code == 200
    for headers in ({"origin": ALLOWED}, {"origin": "http://testserver"}, {}):
        response = client.post("/v1/sessions", headers={**AUTH, **headers})
        assert response.status_code == 201, (headers, response.text)
        assert client.delete(f"/v1/sessions/{response.json()['session_id']}",
                             headers={**AUTH, **headers}).status_code == 204


def test_without_a_key_a_page_on_another_origin_cannot_drain_the_server(make_settings):
    with running_app(make_settings(cors_origins=ALLOWED)) as client:
        response = client.post("/v1/admin/drain", headers={"origin": OTHER})
        assert response.status_code == 403 and response.json()["error"]["code"] == "origin_not_allowed"
        assert client.get("/ready").status_code == 200
