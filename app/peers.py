"""The other replicas of a deployment (setting ``peers``) and asking them for their sessions."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from .settings import Settings


def peer_urls(settings: Settings) -> list[str]:
    """Base URLs of the other replicas (setting ``peers``); this replica's own address is left out."""
    spec = settings.peers or ""
    if spec.startswith("dns:"):
        _, name, port = spec.split(":", 2)
        try:
            addresses = sorted({info[4][0] for info in socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)})
        except OSError:
            return []
        urls = [f"http://{'[' + a + ']' if ':' in a else a}:{port}" for a in addresses]
    else:
        urls = [part.strip().rstrip("/") for part in spec.split(",") if part.strip()]
    own = {f"http://{settings.host}:{settings.port}", f"http://127.0.0.1:{settings.port}",
           f"http://localhost:{settings.port}"}
    own |= {f"http://{a}:{settings.port}" for a in _own_addresses()}
    return [url for url in urls if url not in own]


async def peer_sessions(urls: list[str], headers: dict[str, str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every session the replicas at ``urls`` hold (``scope=local``, all pages), and the ones that did not answer
    within 2 s."""
    import httpx

    unreachable: list[str] = []

    async def ask(base: str, http) -> list[dict[str, Any]]:
        try:
            found, following = [], None
            while True:
                params = {"scope": "local", "limit": 1000, **({"after": following} if following else {})}
                reply = await http.get(f"{base}/v1/sessions", params=params, headers=headers)
                reply.raise_for_status()
                body = reply.json()
                found += body["sessions"]
                following = body["next"]
                if following is None:
                    return found
        except (httpx.HTTPError, ValueError, KeyError):
            unreachable.append(base)
            return []

    async with httpx.AsyncClient(timeout=2.0) as http:
        answers = await asyncio.gather(*(ask(base, http) for base in urls))
    return [entry for found in answers for entry in found], unreachable


def _own_addresses() -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return set()
