"""The deployment listing (``GET /v1/sessions`` with setting ``peers``) against peers that misbehave: one that
trickles its answer, one whose cursor never ends, one whose entries have no session id, one with a page far past
the limit. The listing answers within its deadline (not 2 s per read), names each of them in ``unreachable``, keeps
the well-behaved peer's sessions, and sends peers the replicas' credential, never the caller's."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.app.conftest import LiveServer, running_app

GOOD_ENTRY = {"session_id": "peer-session-0001", "created_at": "2026-01-01T00:00:00+00:00", "frames_received": 3,
              "frames_returned": 3, "flushed": False, "replica": "peer"}


class FakePeer(BaseHTTPRequestHandler):
    """A replica's ``GET /v1/sessions`` as ``self.server.mode`` says."""

    def log_message(self, *args):  # keep the test output clean
        pass

    def _json(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.server.requests += 1
        self.server.authorization.append(self.headers.get("authorization"))
        mode = self.server.mode
        if mode == "good":
            self._json({"sessions": [GOOD_ENTRY], "next": None})
        elif mode == "trickle":
            data = json.dumps({"sessions": [], "next": None}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            for byte in data:  # one byte every 0.5 s: 14 s in all, each read well within a per-read timeout
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.5)
        elif mode == "endless":
            self._json({"sessions": [], "next": uuid.uuid4().hex})
        elif mode == "no-id":
            self._json({"sessions": [{"created_at": "2026-01-01T00:00:00+00:00"}], "next": None})
        elif mode == "huge":
            self._json({"sessions": [{**GOOD_ENTRY, "session_id": f"s{i:015d}"} for i in range(200_000)], "next": None})


@pytest.fixture
def peers():
    servers = {}
    for mode in ("good", "trickle", "endless", "no-id", "huge"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), FakePeer)
        server.daemon_threads = True
        server.mode, server.requests, server.authorization = mode, 0, []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers[mode] = server
    yield servers
    for server in servers.values():
        server.shutdown()
        server.server_close()


def url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_misbehaving_peers_cannot_hang_or_break_the_listing(make_settings, peers):
    settings = make_settings(peers=",".join(url(s) for s in peers.values()), api_key="client-key",
                             peer_api_key="replica-key")
    with running_app(settings) as client:
        started = time.monotonic()
        reply = client.get("/v1/sessions", headers={"Authorization": "Bearer client-key"})
        took = time.monotonic() - started
    assert reply.status_code == 200, reply.text
    body = reply.json()
    # 2 s in all per peer (the trickling one needs 14 s; before, each read had 2 s and it took that long).
    assert took < 8, f"the listing took {took:.1f} s"
    bad = {url(peers[mode]) for mode in ("trickle", "endless", "no-id", "huge")}
    assert set(body["unreachable"]) == bad
    assert [entry["session_id"] for entry in body["sessions"]] == [GOOD_ENTRY["session_id"]]
    assert peers["endless"].requests <= 64, "an endless cursor is not followed for ever"
    # The peers get the replicas' credential; the caller's key never leaves this replica.
    sent = {auth for server in peers.values() for auth in server.authorization}
    assert sent == {"Bearer replica-key"}


def test_misbehaving_peers_cannot_hang_a_cursor_nobody_knows(make_settings, peers):
    """An ``after`` unknown here is asked of the peers (it may have ended on one of them): none of these knows it,
    so 422, within the same 2 s per peer."""
    with running_app(make_settings(peers=",".join(url(s) for s in peers.values()))) as client:
        started = time.monotonic()
        reply = client.get("/v1/sessions", params={"after": "f" * 32})
        took = time.monotonic() - started
    assert reply.status_code == 422 and "pass the 'next' of the previous page" in reply.text, reply.text
    assert took < 8, f"the listing took {took:.1f} s"


def test_a_cursor_that_ended_on_another_replica_still_pages_the_deployment(make_settings):
    """Behind a router the next page may reach another replica than the one where the previous page's last session
    ended: that replica asks its peers where the session stood, and the walk goes on."""
    with LiveServer(make_settings()) as other, httpx.Client(base_url=other.base_url) as on_other, \
            running_app(make_settings(peers=other.base_url)) as client:
        theirs = [on_other.post("/v1/sessions").json()["session_id"] for _ in range(2)]
        mine = client.post("/v1/sessions").json()["session_id"]
        first = client.get("/v1/sessions", params={"limit": 1}).json()
        assert [s["session_id"] for s in first["sessions"]] == [theirs[0]] and first["next"] == theirs[0]
        assert on_other.delete(f"/v1/sessions/{theirs[0]}").status_code == 204
        rest = client.get("/v1/sessions", params={"after": first["next"]})
        assert rest.status_code == 200, rest.text
        assert [s["session_id"] for s in rest.json()["sessions"]] == [theirs[1], mine]
        # The peer's answer that made it possible, as a replica asks it.
        local = on_other.get("/v1/sessions", params={"scope": "local", "limit": 1, "after": theirs[0]}).json()
        assert local["sessions"][0]["session_id"] == theirs[1] and local["after_created_at"] is not None


def test_without_a_peer_key_the_replica_sends_its_own(make_settings, peers):
    settings = make_settings(peers=url(peers["good"]), api_key="shared-key")
    with running_app(settings) as client:
        reply = client.get("/v1/sessions", headers={"Authorization": "Bearer shared-key"})
    assert reply.status_code == 200 and reply.json()["sessions"][0]["session_id"] == GOOD_ENTRY["session_id"]
    assert peers["good"].authorization == ["Bearer shared-key"]
