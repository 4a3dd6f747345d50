"""``python -m bench.hostile [--url URL] [--api-key KEY]``: a bounded hostile client (issue 16, items 4-6).

Against a running server (or, without ``--url``, one started here with small limits), each case must be refused
in bounded time, never answered after holding what it sent:

- a head that never ends (must be cut off, 408, within ``request_header_timeout_s``);
- a huge header (must be refused, 431, long before 128 MiB were sent);
- a body trickled one byte a second (must be cut off within ``request_body_timeout_s``);
- bodies held open by many connections (the next must get 503 + Retry-After at once);
- a chunk of finite but huge latents (3e38: must get 422, never 200 with NaN);
- the same over a stream (an error event, the connection stays open, and the next good message is refined);
- WebSocket handshakes the server refuses: without the key (401, with ``--api-key``) or for no session (404), and
  a header line over websockets' 8192-byte limit (431): each must get its HTTP status, not silence;
- a text message that is not UTF-8 (must be closed with 1007);
- a browser-style handshake offering only ``wm-refiner.bearer.<key>`` (the 101 must name it, or browsers fail it).

(The server's log is not visible from here: tests/app/test_hardening_ws.py checks that none of these logs an ERROR.)

Prints one line per case and exits non-zero when any fails. Every wait has a deadline (``--deadline``).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from urllib.parse import urlparse

import httpx


def response_head(sock: socket.socket) -> bytes:
    """What the server answered before closing (or b'' when it closed without a word)."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            part = sock.recv(65536)
            if not part:
                break
            data += part
    except (ConnectionResetError, socket.timeout):
        pass
    return data


def run(url: str, api_key: str | None, deadline: float, body_bytes: int) -> list[tuple[str, bool, str]]:
    parsed = urlparse(url)
    address = (parsed.hostname, parsed.port or 80)
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = httpx.Client(base_url=url, headers=headers, timeout=deadline)
    results = []

    def connect() -> socket.socket:
        return socket.create_connection(address, timeout=deadline)

    def chunk_head(session_id: str, length: int) -> bytes:
        return (f"POST /v1/sessions/{session_id}/chunks?seq=0 HTTP/1.1\r\nHost: x\r\n{auth}"
                f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n\r\n").encode()

    sock = connect()
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    head = response_head(sock)
    sock.close()
    results.append(("unfinished head", head.startswith(b"HTTP/1.1 408"), head[:40].decode(errors="replace")))

    sock, sent = connect(), 0
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        while sent < 128 * 1024 * 1024:
            sock.sendall(b"a" * 1024 * 1024)
            sent += 1024 * 1024
    except OSError:
        pass
    head = response_head(sock)
    sock.close()
    results.append(("huge header", sent < 64 * 1024 * 1024 and not head.startswith(b"HTTP/1.1 200"),
                    f"{sent >> 20} MiB sent, {head[:40].decode(errors='replace')!r}"))

    session_id = http.post("/v1/sessions").json()["session_id"]
    sock, started = connect(), time.monotonic()
    sock.sendall(chunk_head(session_id, 100))
    try:
        while time.monotonic() - started < deadline:
            sock.sendall(b"\0")
            time.sleep(1.0)
    except OSError:
        pass
    cut = time.monotonic() - started < deadline
    sock.close()
    results.append(("trickled body", cut, f"cut off after {time.monotonic() - started:.0f} s"))

    held, refused = [], b""
    try:
        for _ in range(64):
            sock = connect()
            sock.sendall(chunk_head(session_id, body_bytes))
            sock.settimeout(0.5)
            head = response_head(sock)
            if head.startswith(b"HTTP/1.1 503"):
                refused = head
                sock.close()
                break
            sock.settimeout(deadline)
            sock.sendall(b"\0" * (body_bytes - 1))
            held.append(sock)
    finally:
        for sock in held:
            sock.close()
    results.append(("bodies in flight", b"retry-after" in refused.lower(), f"503 after {len(held)} held bodies"))

    import torch
    from safetensors.torch import save

    latents = torch.randn(1, 128, 4, 4, 4)
    latents[:, :, :, 0, 0] = 3e38
    body = save({"latents": latents, "prompt_embeds": torch.randn(1, 6, 32)})
    poisoned = http.post(f"/v1/sessions/{session_id}/chunks?seq=0", content=body,
                         headers={"content-type": "application/octet-stream"})
    results.append(("huge finite latents", poisoned.status_code == 422, f"{poisoned.status_code}"))
    results += websocket_cases(url, address, api_key, http, deadline)
    http.close()
    return results


def ws_handshake(address, path: str, headers: dict[str, str], deadline: float,
                 extra: bytes = b"") -> tuple[socket.socket, bytes]:
    """A raw WebSocket handshake: the socket and the response head (b'' when the server said nothing)."""
    sock = socket.create_connection(address, timeout=deadline)
    lines = [f"GET {path} HTTP/1.1", "Host: x", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13",
             *(f"{name}: {value}" for name, value in headers.items())]
    sock.sendall("\r\n".join(lines).encode() + b"\r\n" + extra + b"\r\n")
    return sock, response_head(sock)


def close_code(sock: socket.socket) -> int | None:
    """The code of the next close frame the server sends (None if it closed without one)."""
    data = b""
    try:
        while True:
            while len(data) < 4:
                part = sock.recv(65536)
                if not part:
                    return None
                data += part
            length = data[1] & 0x7F
            header = 2 + (2 if length == 126 else 8 if length == 127 else 0)
            if length >= 126:
                while len(data) < header:
                    data += sock.recv(65536)
                length = int.from_bytes(data[2:header], "big")
            while len(data) < header + length:
                part = sock.recv(65536)
                if not part:
                    return None
                data += part
            if data[0] & 0x0F == 0x8:
                return int.from_bytes(data[header : header + 2], "big")
            data = data[header + length :]
    except (OSError, socket.timeout):
        return None


def websocket_cases(url: str, address, api_key: str | None, http: httpx.Client,
                    deadline: float) -> list[tuple[str, bool, str]]:
    import base64
    import json

    import torch
    from safetensors.torch import save
    from websockets.sync.client import connect

    results = []
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    session_id = http.post("/v1/sessions").json()["session_id"]
    stream_path = f"/v1/sessions/{session_id}/stream"

    refusals = [("/v1/sessions/no-such-session/stream", auth, b"404")]
    if api_key:
        refusals.append((stream_path, {}, b"401"))
    for path, headers, status in refusals:
        sock, head = ws_handshake(address, path, headers, deadline)
        sock.close()
        results.append((f"refused handshake ({status.decode()})", head.startswith(b"HTTP/1.1 " + status),
                        repr(head[:30])))

    sock, head = ws_handshake(address, stream_path, auth, deadline, extra=b"X-Big: " + b"a" * 8200 + b"\r\n")
    sock.close()
    results.append(("8 KB handshake header line", head.startswith(b"HTTP/1.1 431"), repr(head[:40])))

    sock, head = ws_handshake(address, stream_path, auth, deadline)
    code = None
    if head.startswith(b"HTTP/1.1 101"):
        data, mask = b'{"type": "\xff\xfe"}', b"\x01\x02\x03\x04"
        sock.sendall(bytes([0x81, 0x80 | len(data)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
        code = close_code(sock)
    sock.close()
    results.append(("text message not UTF-8", code == 1007, f"close {code}, head {head[:20]!r}"))

    # Without a key on the server the subprotocol is no credential, but must still be selected.
    bearer = "wm-refiner.bearer." + base64.urlsafe_b64encode((api_key or "k").encode()).decode().rstrip("=")
    fresh = http.post("/v1/sessions").json()["session_id"]
    sock, head = ws_handshake(address, f"/v1/sessions/{fresh}/stream", {"Sec-WebSocket-Protocol": bearer}, deadline)
    sock.close()
    echoed = f"sec-websocket-protocol: {bearer}".lower().encode() in head.lower()
    results.append(("browser subprotocol only", head.startswith(b"HTTP/1.1 101") and echoed, repr(head[:20])))

    # A poisoned message on a stream: an error event, then the same connection refines a good message.
    session_id = http.post("/v1/sessions").json()["session_id"]
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 128, 4, 4, 4, generator=generator)
    embeds = torch.randn(1, 6, 32, generator=generator)
    poisoned = latents.clone()
    poisoned[:, :, :, 0, 0] = 3e38
    ws_url = url.replace("http", "ws", 1) + f"/v1/sessions/{session_id}/stream"
    outcome, ok = "no answer", False
    try:
        with connect(ws_url, additional_headers=auth, open_timeout=deadline, close_timeout=deadline) as ws:
            ws.send(save({"latents": poisoned, "prompt_embeds": embeds}))
            event = json.loads(ws.recv(timeout=deadline))
            error = event.get("error", {})
            outcome = f"{error.get('code')}"
            ws.send(save({"latents": latents, "prompt_embeds": embeds}))
            unit = ws.recv(timeout=deadline)
            ok = error.get("code") == "invalid_input" and isinstance(unit, bytes)
            outcome += f", then a {len(unit)}-byte unit" if isinstance(unit, bytes) else f", then {unit[:80]}"
    except Exception as exc:  # any failure of the case is its result, not the tool's
        outcome += f" ({exc!r})"
    results.append(("poisoned stream message", ok, outcome))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server; default: one started here with small limits")
    parser.add_argument("--api-key")
    parser.add_argument("--deadline", type=float, default=20.0, help="seconds any one case may take")
    parser.add_argument("--body-bytes", type=int, default=1024 * 1024,
                        help="size of each held body (the server's max_body_bytes or less)")
    args = parser.parse_args(argv)
    if args.url:
        results = run(args.url, args.api_key, args.deadline, args.body_bytes)
    else:
        import tempfile

        from app.settings import Settings
        from bench.live import ThreadServer

        with tempfile.TemporaryDirectory() as cache:
            settings = Settings(device="cpu", dtype="float32", cache_dir=cache, max_body_bytes=args.body_bytes,
                                max_inflight_body_bytes=4 * args.body_bytes, request_header_timeout_s=2.0,
                                request_body_timeout_s=3.0, api_key=args.api_key)
            with ThreadServer(settings) as server:
                results = run(server.base_url, args.api_key, args.deadline, args.body_bytes)
    for name, ok, detail in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
