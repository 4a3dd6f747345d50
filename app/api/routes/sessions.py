"""Sessions: create (POST /v1/sessions), list (GET /v1/sessions), inspect (GET), end (DELETE)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wm_refiner_client import spec

from app.api.deps import PlainInteger, ServicesDep, read_body, require_content_type
from app.api.openapi import (CONFIG_400, DELETE_503, GET_503, PUT_409, SessionCreate, SessionCreated,
                             SessionDescription, SessionList, errors)
from app.core.error_kinds import ApiError

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
    responses={201: {"model": SessionCreated, "description": "the new session"},
               **errors(400, 401, 413, 415, 422, 503, when={400: CONFIG_400})},
)
async def create_session(request: Request, services: ServicesDep) -> JSONResponse:
    return JSONResponse(await services.sessions.create(lambda: _read_fields(request, services)), status_code=201)


@router.put(
    "/v1/sessions/{session_id}",
    status_code=201,
    openapi_extra=CREATE_BODY,
    response_model=None,
    responses={
        201: {"model": SessionCreated, "description": "created under the client's id"},
        200: {"model": SessionCreated, "description": "it already exists with this config (a safe retry)"},
        **errors(400, 401, 409, 410, 413, 415, 422, 503, when={400: CONFIG_400, 409: PUT_409}),
    },
)
async def put_session(session_id: str, request: Request, services: ServicesDep) -> JSONResponse:
    """A session under a client-chosen id (``[A-Za-z0-9_-]{8,64}``), so that a router can hash the id in every
    path. Idempotent: the same id and config again answers 200 with the same body."""
    body, created = await services.sessions.put(session_id, lambda: _read_fields(request, services))
    return JSONResponse(body, status_code=201 if created else 200)


async def _read_fields(request: Request, services) -> dict[str, Any]:
    limit = min(MAX_CONFIG_BYTES, services.settings.max_body_bytes)
    return parse_config_body(request, await read_body(request, limit, "for a session config; send only the fields "
                                                                        "you set, e.g. {\"seed\": 7}"))


def _config_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of the body, refused when a key comes twice (the parser would keep the last without a word,
    as a repeated query parameter would be: that is refused too) or is not valid Unicode (a lone surrogate)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ApiError("invalid_config", f"the config names {key[:40]!r} twice; send each field once")
        seen.add(key)
        try:
            key.encode()
        except UnicodeEncodeError:
            raise ApiError("invalid_payload", f"a key of the body, {key[:40]!r}, is not valid Unicode (a lone UTF-16 "
                                              "surrogate); send the field names as docs/api.md spells them") from None
    return dict(pairs)


def _not_a_number(name: str) -> None:
    """``NaN``, ``Infinity``, ``-Infinity``: Python's parser takes them, JSON has no such numbers."""
    raise ApiError("invalid_payload", f"the body is not JSON: {name} is not a JSON number; send a finite number")


def parse_config_body(request: Request, body: bytes) -> dict[str, Any]:
    """The fields a client set; an empty body means all defaults."""
    if not body.strip():
        return {}
    require_content_type(request, "application/json")
    try:
        data = json.loads(body, object_pairs_hook=_config_object, parse_constant=_not_a_number)
    except (ValueError, UnicodeDecodeError) as exc:
        if "digits" in str(exc):  # Python's limit on converting long integers (4300 digits)
            raise ApiError("invalid_config", "a number in the body has thousands of digits; send each field's value "
                                             "within its range (docs/api.md)") from None
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
        problems = "; ".join(_problems(exc.errors()))
        fields = ", ".join(SessionCreate.model_fields)
        raise ApiError("invalid_config", f"invalid session config: {problems}; the fields are {fields}") from None
    return parsed.model_dump(exclude_none=True)


def _problems(errors: list[dict[str, Any]]) -> list[str]:
    """One line per problem. A value that fits no branch of a field's union (video_quality: "auto" or an integer)
    is one line saying what was sent and what the field takes, not one line per branch named in pydantic's terms."""
    by_field: dict[Any, list[dict[str, Any]]] = {}
    for error in errors:
        by_field.setdefault(error["loc"][0] if error["loc"] else "", []).append(error)
    lines = []
    for name, found in by_field.items():
        if len(found) > 1 and all(len(e["loc"]) == 2 and isinstance(e["loc"][1], str) for e in found):
            lines.append(f"{name}: got {found[0].get('input')!r}{_expects(found[0]['loc'])}")
            continue
        lines.extend(f"{'.'.join(map(str, e['loc']))}: {e['msg']}{_expects(e['loc'])}" for e in found)
    return lines


def _expects(loc: tuple) -> str:
    """What the field at ``loc`` takes (its spec's words), for the error: the bound crossed alone does not say it."""
    field = spec.BY_NAME.get(loc[0]) if loc else None
    return f" (send {field.expects()})" if field is not None else ""


@router.get(
    "/v1/sessions",
    response_model=None,
    responses={200: {"model": SessionList, "description": "the live sessions, oldest first"}, **errors(401, 422)},
)
async def list_sessions(
    services: ServicesDep,
    limit: Annotated[int, PlainInteger, Query(ge=1, le=1000, description="sessions per page")] = 100,
    after: Annotated[str | None, Query(max_length=128, description="the 'next' of the previous page")] = None,
    scope: Annotated[
        Literal["deployment", "local"],
        Query(description="deployment (default): every replica's sessions when `peers` is set; local: this one's"),
    ] = "deployment",
) -> dict[str, Any]:
    return await services.sessions.list(limit, after, scope)


@router.get(
    "/v1/sessions/{session_id}",
    response_model=None,
    responses={200: {"model": SessionDescription, "description": "the session's state"},
               **errors(401, 404, 410, 422, 503, when={503: GET_503})},
)
async def get_session(session_id: str, services: ServicesDep) -> dict[str, Any]:
    return await services.sessions.describe(session_id)


@router.delete(
    "/v1/sessions/{session_id}",
    status_code=204,
    response_class=Response,
    responses={204: {"description": "ended; the cache is freed"},
               **errors(401, 404, 410, 422, 503, when={503: DELETE_503})},
)
async def delete_session(session_id: str, services: ServicesDep) -> Response:
    await services.sessions.delete(session_id)
    return Response(status_code=204)
