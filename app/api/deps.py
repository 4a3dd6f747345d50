"""Request plumbing shared by the routes: the app's services, the query rule, bounded body reading, content types."""

from __future__ import annotations

import asyncio
import re
from typing import Annotated, Awaitable, TypeVar

from fastapi import Depends
from fastapi.dependencies.models import Dependant
from pydantic import BeforeValidator
from starlette.datastructures import QueryParams
from starlette.requests import ClientDisconnect, HTTPConnection, Request

from app.core.codec import OCTET_STREAM
from app.core.error_kinds import ApiError
from app.core.tasks import outlast, retrieve
from app.runtime.services import Services


def get_services(connection: HTTPConnection) -> Services:
    return connection.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]

OCTET_BODY = {
    "requestBody": {
        "required": True,
        "content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}},
        "description": "a safetensors file: latents (B, C, t, H, W)[, prompt_embeds (B, L, D)"
        "[, prompt_attention_mask (B, L)]]",
    }
}
# The 200 bodies (a refined payload) are described in app.api.openapi (CHUNK_RESPONSE, REFINE_RESPONSE).


def _plain_integer(value: object) -> object:
    # Query values arrive as text, and pydantic's lax int takes "1.0", "+0.0" or "1_000" for numbers (found by
    # the schema fuzzer); a seq or a seed written so is a client bug worth a 422, as the schema says integer.
    if isinstance(value, str) and not re.fullmatch(r"-?[0-9]+", value):
        raise ValueError(f"{value!r} is not a plain integer; write it like 3")
    return value


# Goes beside Query(...) on an integer query parameter: decimal digits only.
PlainInteger = BeforeValidator(_plain_integer)


def reject_unknown_query(query: QueryParams, known: frozenset[str] = frozenset()) -> None:
    """422 for a query parameter the route does not take, or one given more than once: a misspelt ``flsuh=true``,
    a config field sent as ``POST /v1/sessions?seed=7`` or ``?seed=1&seed=2`` (of which the framework would keep one)
    would otherwise be ignored without a word, and the client get what it did not ask for. The schema says the same
    (``QUERY_RULE``, in /openapi.json's description). Called for every route by ``app.api.factory.QueryRule``."""
    unknown = sorted(set(query) - known)
    if unknown:
        takes = f"this route takes only {sorted(known)}" if known else "this route takes no query parameters"
        raise ApiError("invalid_request", f"unknown query parameter(s) {unknown}; {takes}")
    repeated = sorted(name for name in set(query) if len(query.getlist(name)) > 1)
    if repeated:
        raise ApiError("invalid_request", f"query parameter(s) {repeated} given more than once; give each at most once")


def declared_query(dependant: Dependant) -> frozenset[str]:
    """The query parameters a route declares: its endpoint's and its dependencies' (``/v1/refine`` takes the session
    fields through one), by the name a client sends. What the route declares is what /openapi.json documents, so
    the rule and the schema cannot disagree."""
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= declared_query(sub)
    return frozenset(names)


QUERY_RULE = ("Query parameters: each route takes only the ones it documents, each at most once; an unknown or repeated "
              "query parameter is refused with 422 invalid_request (never ignored).")


def require_content_type(request: Request, expected: str) -> None:
    """415 unless the body is declared as ``expected`` (an absent header is taken as that), in one header: RFC 9110
    allows one, and of two (even equal ones: no reason to tell them apart) which one a proxy or framework reads is
    theirs to choose, so none is."""
    values = request.headers.getlist("content-type")
    if len(values) > 1:
        raise ApiError(
            "unsupported_media_type",
            f"Content-Type given {len(values)} times ({', '.join(map(repr, values))}); send it once, as {expected}",
        )
    _require_identity_encoding(request)
    declared = values[0] if values else None
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != expected:
        raise ApiError(
            "unsupported_media_type",
            f"Content-Type {declared!r} is not accepted here; send the body as {expected}",
        )


def _require_identity_encoding(request: Request) -> None:
    """415 for a body sent with a Content-Encoding (gzip, br, ...): this server reads bodies as they come, so a
    compressed one would be parsed as its compressed bytes (a gzipped chunk got "not a safetensors file (header too
    large)"), and a plain body that claims an encoding would be taken though its sender meant something else. RFC
    9110 (15.5.16): 415, with Accept-Encoding naming the codings taken; here none but identity."""
    codings = [coding.strip().lower() for value in request.headers.getlist("content-encoding")
               for coding in value.split(",")]
    if any(coding not in ("", "identity") for coding in codings):
        declared = ", ".join(request.headers.getlist("content-encoding"))
        raise ApiError(
            "unsupported_media_type",
            f"Content-Encoding {declared!r} is not accepted: this server reads bodies as sent; send the body "
            "uncompressed, without a Content-Encoding header (tensors barely compress)",
            headers={"Accept-Encoding": "identity"},
        )


FRAMES_ADVICE = "(max_body_bytes); send fewer frames per chunk"


async def read_body(request: Request, limit: int, advice: str = FRAMES_ADVICE) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit``: from Content-Length before
    reading anything, else while it streams in, so an oversized body is never held in memory. ``advice``: the
    limit's name and what to send instead (default: a chunk's)."""
    too_large = ApiError("payload_too_large", f"the body is larger than the limit of {limit} bytes {advice}")
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError("invalid_payload", f"Content-Length {declared!r} is not a number") from None
        if size > limit:
            raise too_large
    parts: list[bytes] = []
    received = 0
    try:
        async for part in request.stream():
            received += len(part)
            if received > limit:
                raise too_large
            parts.append(part)
    except ClientDisconnect:
        # Nobody is left to answer; end the request without logging it as a server error.
        raise ApiError("invalid_payload", "the client disconnected before the body was complete") from None
    return b"".join(parts)


T = TypeVar("T")


async def until_client_leaves(request: Request, work: Awaitable[T], body_read: asyncio.Event) -> T | None:
    """``work``'s result, or None once the client has closed its connection (``work`` is cancelled then: nobody
    is left to answer). Listens for the disconnect only once ``body_read`` is set: before that, the body's own
    messages are the route's to read (and a client gone then already ended the read)."""

    async def gone() -> None:
        await body_read.wait()
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        task.add_done_callback(retrieve)  # it lets go on its own; nobody is left to tell how it ended
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    # Until the work has let go of what it holds, even if the route is cancelled meanwhile (the server shutting
    # down): that cancellation then goes on, rather than being taken for the work's own.
    cancelled = await outlast(task)
    retrieve(task)  # nobody is left to tell; retrieved, so that asyncio does not log it either
    if cancelled:
        raise asyncio.CancelledError
    return None
