"""``python -m bench.hostile [--url URL] [--api-key KEY]``: a bounded hostile client (issue 16, items 4-6).

Against a running server (or, without ``--url``, one started here with small limits), each case must be refused
in bounded time, never answered after holding what it sent:

- a head that never ends (must be cut off, 408, within ``request_header_timeout_s``);
- a huge header (must be refused, 431, long before 128 MiB were sent);
- a body trickled one byte a second (must be cut off within ``request_body_timeout_s``);
- bodies held open by many connections (the next must get 503 + Retry-After at once);
- a chunk of finite but huge latents (3e38: must get 422, never 200 with NaN).

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
    http.close()
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
