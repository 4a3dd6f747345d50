"""Sessions: create (POST /v1/sessions), list (GET /v1/sessions), inspect (GET), end (DELETE)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from models import SessionConfig
from wm_refiner_client import spec

from ..deps import ServicesDep, check_config_limits, read_body, reject_unknown_query, require_content_type
from ..errors import ApiError
from ..openapi import SessionCreate, SessionCreated, SessionDescription, SessionList, errors

router = APIRouter(tags=["sessions"])

# A session config is a few numbers; a body beyond this is a mistake or an attack.
MAX_CONFIG_BYTES = 64 * 1024


CREATE_BODY = {
    "requestBody": {
        "required": False,
        "content": {"application/json": {"schema": SessionCreate.model_json_schema()}},
        "description": "the session config; an empty body (or {}) takes every default",
    }
}


@router.post(
    "/v1/sessions",
    status_code=201,
    openapi_extra=CREATE_BODY,
    response_model=None,
    responses={201: {"model": SessionCreated, "description": "the new session"}, **errors(400, 401, 413, 415, 422, 503)},
)
async def create_session(request: Request, services: ServicesDep) -> JSONResponse:
    reject_unknown_query(request)  # the config goes in the body; ?seed=7 must not be ignored quietly
    services.require_ready()
    config, outputs = await _read_config(request, services)
    handle = services.registry.create(services.require_model(), config, services.default_prompt, outputs=outputs)
    return JSONResponse({"session_id": handle.id, "config": {**config.to_dict(), **outputs.to_dict()}}, status_code=201)


@router.put(
    "/v1/sessions/{session_id}",
    status_code=201,
    openapi_extra=CREATE_BODY,
    response_model=None,
    responses={
        201: {"model": SessionCreated, "description": "created under the client's id"},
        200: {"model": SessionCreated, "description": "it already exists with this config (a safe retry)"},
        **errors(400, 401, 409, 410, 413, 415, 422, 503),
    },
)
async def put_session(session_id: str, request: Request, services: ServicesDep) -> JSONResponse:
    """A session under a client-chosen id (``[A-Za-z0-9_-]{8,64}``), so that a router can hash the id in every
    path. Idempotent: the same id and config again answers 200 with the same body."""
    reject_unknown_query(request)
    services.require_ready()
    try:
        spec.check_session_id(session_id)
    except ValueError as exc:
        raise ApiError("invalid_request", str(exc)) from None
    config, outputs = await _read_config(request, services)
    body = {"session_id": session_id, "config": {**config.to_dict(), **outputs.to_dict()}}
    existing = await _existing(services, session_id)
    if existing is not None:
        if existing.config == config and existing.outputs == outputs:
            return JSONResponse(body, status_code=200)
        raise ApiError(
            "session_exists",
            f"session {session_id} already exists with another config ({_differences(existing, config, outputs)}); "
            "PUT it with the same config to get it again, or choose another id",
        )
    handle = services.registry.create(services.require_model(), config, services.default_prompt, outputs=outputs,
                                      session_id=session_id)
    return JSONResponse({**body, "session_id": handle.id}, status_code=201)


async def _existing(services, session_id: str):
    try:
        return await services.lookup(session_id)
    except ApiError as error:
        if error.kind == "session_not_found":
            return None
        raise  # 410 while remembered as evicted


def _differences(existing, config: SessionConfig, outputs) -> str:
    have = {**existing.config.to_dict(), **existing.outputs.to_dict()}
    want = {**config.to_dict(), **outputs.to_dict()}
    return ", ".join(f"{name}: {have[name]!r} there, {want[name]!r} asked" for name in want if have[name] != want[name])


async def _read_config(request: Request, services) -> tuple[SessionConfig, Any]:
    body = await read_body(request, min(MAX_CONFIG_BYTES, services.settings.max_body_bytes))
    return resolve_config(parse_config_body(request, body), services)


def resolve_config(fields: dict[str, Any], services) -> tuple[SessionConfig, Any]:
    """The session's config and outputs from the fields a client set (JSON values, checked by ``check_fields``):
    unset fields take the server's defaults; 422 for what the model or this server's limits refuse."""
    outputs = services.outputs({name: fields.pop(name) for name in spec.OUTPUT_NAMES if name in fields})
    defaults = services.settings.session_defaults().to_dict()
    config = check_config_limits(SessionConfig.from_dict({**defaults, **fields}), services.settings)
    return config, outputs


def parse_config_body(request: Request, body: bytes) -> dict[str, Any]:
    """The fields a client set; an empty body means all defaults."""
    if not body.strip():
        return {}
    require_content_type(request, "application/json")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError("invalid_payload", f"the body is not JSON ({exc}); send a JSON object such as {{\"seed\": 7}}")
    except RecursionError:
        # Found by the schema fuzzer: a few kB of "[[[[..." exhaust the parser's stack; that is the client's 400.
        raise ApiError(
            "invalid_payload", "the body nests JSON too deeply; send a flat JSON object such as {\"seed\": 7}"
        ) from None
    if not isinstance(data, dict):
        raise ApiError("invalid_config", f"the body must be a JSON object of config fields, got {type(data).__name__}")
    return check_fields(data)


def check_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The set fields of ``data`` (JSON values) after the spec's per-field checks (names, types, bounds); 422
    invalid_config naming each problem. The body and /v1/refine's query both come through here."""
    try:
        parsed = SessionCreate.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        fields = ", ".join(SessionCreate.model_fields)
        raise ApiError("invalid_config", f"invalid session config: {problems}; the fields are {fields}") from None
    return parsed.model_dump(exclude_none=True)


@router.get(
    "/v1/sessions",
    response_model=None,
    responses={200: {"model": SessionList, "description": "the live sessions, oldest first"}, **errors(401, 422)},
)
async def list_sessions(
    request: Request,
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="sessions per page")] = 100,
    after: Annotated[str | None, Query(max_length=128, description="the 'next' of the previous page")] = None,
    scope: Annotated[
        Literal["deployment", "local"],
        Query(description="deployment (default): every replica's sessions when `peers` is set; local: this one's"),
    ] = "deployment",
) -> dict[str, Any]:
    reject_unknown_query(request, frozenset({"limit", "after", "scope"}))
    replica = services.settings.replica_id
    if scope == "local" or not services.settings.peers:
        page, following = services.registry.listing(limit, after)
        return {"sessions": [{**handle.summary(), "replica": replica} for handle in page], "next": following}
    return await deployment_listing(services, request, limit, after)


async def deployment_listing(services, request: Request, limit: int, after: str | None) -> dict[str, Any]:
    """Behind a router, GET /v1/sessions lists the deployment (api.md 1.1): this replica asks every peer for its own
    sessions (``scope=local``, the caller's API key passed on), merges them oldest first and pages the result. A
    peer that does not answer within 2 s is left out and named in ``"unreachable"``."""
    import httpx

    mine = [{**h.summary(), "replica": services.settings.replica_id} for h in services.registry.handles()]
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
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
        answers = await asyncio.gather(*(ask(base, http) for base in services.peer_urls()))
    merged: dict[str, dict[str, Any]] = {}
    for entry in [*mine, *(entry for found in answers for entry in found)]:
        merged.setdefault(entry["session_id"], entry)  # a session seen twice (mid-move): the first answer
    ordered = sorted(merged.values(), key=lambda e: (e["created_at"], e["session_id"]))
    if after is not None:
        ids = [entry["session_id"] for entry in ordered]
        if after not in ids:
            raise ApiError("invalid_request", f"after={after!r} is not a live session of this deployment; pass "
                                              "the 'next' of the previous page")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    body: dict[str, Any] = {"sessions": page, "next": page[-1]["session_id"] if len(ordered) > limit else None}
    if unreachable:
        body["unreachable"] = unreachable
    return body


@router.get(
    "/v1/sessions/{session_id}",
    response_model=None,
    responses={200: {"model": SessionDescription, "description": "the session's state"}, **errors(401, 404, 410, 422)},
)
async def get_session(session_id: str, services: ServicesDep) -> dict[str, Any]:
    return (await services.lookup(session_id)).describe()


@router.delete(
    "/v1/sessions/{session_id}",
    status_code=204,
    response_class=Response,
    responses={204: {"description": "ended; the cache is freed"}, **errors(401, 404, 410, 422)},
)
async def delete_session(session_id: str, services: ServicesDep) -> Response:
    await services.lookup(session_id)  # a session saved by another replica is taken and ended here
    services.registry.delete(session_id)
    for stream in list(services.streams):
        if stream.session_id == session_id:
            stream.close(1000, "session deleted")
    return Response(status_code=204)
