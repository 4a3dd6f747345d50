"""A WebSocket handshake on a path no route serves is refused 404 with the error envelope, as an HTTP request is:
Starlette's bare close made it "403 Forbidden" with no body, which read as a refused key or origin."""

from __future__ import annotations

import pytest
from starlette.testclient import WebSocketDenialResponse


@pytest.mark.parametrize("path", ["/nonexistent", "/v1/sessions/abcdefgh12/bogus", "/health",
                                  "/v1/sessions/a%2Fb/stream", "/v1/v1/sessions/abcdefgh12/stream"])
def test_a_websocket_on_a_path_without_a_route_is_refused_404_with_the_envelope(client, path):
    with pytest.raises(WebSocketDenialResponse) as denied:
        with client.websocket_connect(path):
            pass
    assert denied.value.status_code == 404
    error = denied.value.json()["error"]
    assert error["code"] == "not_found" and "WebSocket" in error["message"], error
    assert "x-replica" in denied.value.headers
    if path.startswith("/v1/v1/"):
        assert "give it without" in error["message"]
    # HTTP keeps its answer
    assert client.get("/nonexistent").json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("route", ["stream", "watch"])
def test_an_http_request_on_a_websocket_route_says_to_open_it_as_a_websocket(client, route):
    answer = client.get(f"/v1/sessions/abcdefgh12/{route}")
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == "not_found" and "is a WebSocket route: open it with a WebSocket client" in error["message"]
