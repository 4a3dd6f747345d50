"""The other replicas of a deployment (setting ``peers``) and asking them for their sessions.

A peer is another process, possibly broken or hostile; asking it must never hang or break the listing:

- each peer gets ``PEER_DEADLINE_S`` in all (connect, every page, every byte), not per read: a peer that trickles
  its answer is cut off and named in ``unreachable``;
- at most ``MAX_PEER_PAGES`` pages and ``MAX_PEER_BYTES`` bytes per page are read from one peer, and a page may hold
  at most the ``limit`` asked; a cursor that repeats or never ends is a misbehaving peer (named, not followed);
- an entry must be an object with a valid ``session_id`` and ``created_at``; a peer that sends anything else is
  named and its entries left out (one bad peer never turns the listing into a 500);
- DNS (``dns:NAME:PORT``) is resolved without blocking the event loop;
- peers are asked with the replicas' own credential (setting ``peer_api_key``, else this replica's ``api_key``),
  never with the caller's ``Authorization`` header: the listing travels over plain HTTP between replicas, so keep
  that traffic on the deployment's private network.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from wm_refiner_client import spec

from app.core.settings import Settings

PEER_DEADLINE_S = 2.0
PAGE_LIMIT = 1000
MAX_PEER_PAGES = 64  # 64,000 sessions per replica: far past any max_sessions
MAX_PEER_BYTES = 4 * 1024 * 1024  # a page of 1000 summaries is ~300 KB


class PeerMisbehaved(Exception):
    """The peer answered, but not with a bounded, well-formed listing."""


async def peer_urls(settings: Settings) -> list[str]:
    """Base URLs of the other replicas (setting ``peers``); this replica's own address is left out."""
    peers = settings.peers or ""
    loop = asyncio.get_running_loop()
    if peers.startswith("dns:"):
        _, name, port = peers.split(":", 2)
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(name, int(port), type=socket.SOCK_STREAM),
                                           PEER_DEADLINE_S)
        except (OSError, asyncio.TimeoutError):
            return []
        addresses = sorted({info[4][0] for info in infos})
        urls = [f"http://{'[' + a + ']' if ':' in a else a}:{port}" for a in addresses]
    else:
        urls = [part.strip().rstrip("/") for part in peers.split(",") if part.strip()]
    own = {f"http://{settings.host}:{settings.port}", f"http://127.0.0.1:{settings.port}",
           f"http://localhost:{settings.port}"}
    own |= {f"http://{a}:{settings.port}" for a in await _own_addresses()}
    return [url for url in urls if url not in own]


def peer_headers(settings: Settings) -> dict[str, str]:
    """What this replica sends to its peers: the replicas' credential, never the caller's."""
    key = settings.peer_api_key or settings.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


async def peer_sessions(urls: list[str], headers: dict[str, str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every session the replicas at ``urls`` hold (``scope=local``, all pages), and the ones that did not give a
    bounded, well-formed listing within ``PEER_DEADLINE_S``."""
    import httpx

    unreachable: list[str] = []

    async def ask(base: str, http: httpx.AsyncClient) -> list[dict[str, Any]]:
        try:
            return await asyncio.wait_for(_listing(base, http, headers), PEER_DEADLINE_S)
        except (httpx.HTTPError, PeerMisbehaved, asyncio.TimeoutError):
            unreachable.append(base)
            return []

    async with httpx.AsyncClient(timeout=PEER_DEADLINE_S) as http:
        answers = await asyncio.gather(*(ask(base, http) for base in urls))
    return [entry for found in answers for entry in found], sorted(unreachable)


async def peer_position(urls: list[str], headers: dict[str, str], session_id: str) -> str | None:
    """Where ``session_id`` stands in the listings (its ``created_at``), from the first replica at ``urls`` that
    knows it, live or lately ended: the ``after_created_at`` of its ``scope=local`` page after that id. None if
    none does within ``PEER_DEADLINE_S`` (a peer that does not answer, or answers out of shape, knows nothing)."""
    import httpx

    async def ask(base: str, http: httpx.AsyncClient) -> str | None:
        params = {"scope": "local", "limit": 1, "after": session_id}
        try:
            data = await asyncio.wait_for(_read(base, http, params, headers), PEER_DEADLINE_S)
            value = json.loads(data).get("after_created_at")
        except (httpx.HTTPError, PeerMisbehaved, asyncio.TimeoutError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) and len(value) <= 64 else None

    async with httpx.AsyncClient(timeout=PEER_DEADLINE_S) as http:
        answers = await asyncio.gather(*(ask(base, http) for base in urls))
    return next((answer for answer in answers if answer is not None), None)


async def _read(base: str, http, params: dict[str, Any], headers: dict[str, str]) -> bytes:
    """One page of the peer's listing, at most ``MAX_PEER_BYTES``; an error status raises."""
    async with http.stream("GET", f"{base}/v1/sessions", params=params, headers=headers) as reply:
        reply.raise_for_status()
        data = bytearray()
        async for part in reply.aiter_bytes():
            data += part
            if len(data) > MAX_PEER_BYTES:
                raise PeerMisbehaved(f"a page of more than {MAX_PEER_BYTES} bytes")
    return bytes(data)


async def _listing(base: str, http, headers: dict[str, str]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    following: str | None = None
    seen: set[str] = set()
    for _ in range(MAX_PEER_PAGES):
        params = {"scope": "local", "limit": PAGE_LIMIT, **({"after": following} if following else {})}
        entries, following = _page(await _read(base, http, params, headers))
        found += entries
        if following is None:
            return found
        if following in seen:
            raise PeerMisbehaved(f"the cursor {following!r} came back")
        seen.add(following)
    raise PeerMisbehaved(f"more than {MAX_PEER_PAGES} pages")


def _page(data: bytes) -> tuple[list[dict[str, Any]], str | None]:
    try:
        body = json.loads(data)
        entries, following = body["sessions"], body["next"]
    except (ValueError, TypeError, KeyError) as exc:
        raise PeerMisbehaved(f"not a session listing ({exc!r})") from None
    if not isinstance(entries, list) or len(entries) > PAGE_LIMIT:
        raise PeerMisbehaved("sessions is not a list of at most the limit asked")
    if following is not None and not (isinstance(following, str) and spec.is_session_id(following)):
        raise PeerMisbehaved("next is not a session id")
    for entry in entries:
        if not (isinstance(entry, dict) and isinstance(entry.get("session_id"), str)
                and spec.is_session_id(entry["session_id"]) and isinstance(entry.get("created_at"), str)):
            raise PeerMisbehaved("an entry without a valid session_id and created_at")
    return entries, following


async def _own_addresses() -> set[str]:
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(socket.gethostname(), None),
                                       PEER_DEADLINE_S)
    except (OSError, asyncio.TimeoutError):
        return set()
    return {info[4][0] for info in infos}
