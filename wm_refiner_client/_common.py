"""What the sync and async clients share: configuration, request shapes, response parsing, the stream's events.
No I/O here."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from . import spec
from .errors import ERROR_CLASSES, APIError, ProtocolError, error_from
from .retry import parse_retry_after

API_KEY_ENV = "WM_REFINER_API_KEY"
URL_ENV = "WM_REFINER_URL"
DEFAULT_URL = "http://127.0.0.1:8000"
# The keyword arguments of create_session, session and refine: the session's fields (spec.FIELDS).
CONFIG_FIELDS = spec.NAMES


# A connection this client closes itself (Ctrl-C, a closed stream, a reconnect) need not wait for the server's close
# frame: a server whose reader is busy with the last message (a block refining) would hold the close for seconds
# (websockets' default: 10 s). The server's own closes (after a flush, a drain) are not waited on at all.
CLOSE_TIMEOUT_S = 1.0


class _KeepaliveFailures(logging.Filter):
    """websockets logs a keepalive ping that raised (a connection closing under it) at ERROR with a traceback; the
    connection's end reaches this client anyway (a reconnect, or the stream's error), so the record is lowered to
    DEBUG: a program that logs at DEBUG still sees it, an unconfigured one (the command line) no longer prints a
    traceback during a run that succeeds."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() == "keepalive ping failed":
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


# The logger of every WebSocket this client opens (websockets' ``logger=``).
WS_LOG = logging.getLogger("wm_refiner_client.websocket")
WS_LOG.addFilter(_KeepaliveFailures())


def resolve_url(base_url: str | None) -> str:
    """The server's base URL (``base_url``, else ``$WM_REFINER_URL``, else the default), checked: ValueError at once
    for an address no request could reach, naming the fix (httpx would fail each request with UnsupportedProtocol,
    and a retried request would spend its whole retry budget on it). ``ws://`` and ``wss://`` are taken for
    ``http://`` and ``https://``: the client derives the WebSocket URLs itself."""
    given = base_url or os.environ.get(URL_ENV)
    source = "the server address" if base_url else f"${URL_ENV}"
    return check_url(given, source).rstrip("/") if given else DEFAULT_URL


def check_url(url: str, source: str = "the server address") -> str:
    """``url`` as an http(s) URL; ValueError saying what to give instead (``source``: where it came from)."""
    url = url.strip()
    parts = urlsplit(url)
    if "://" not in url:  # 'localhost:8000', '127.0.0.1:8000', 'myhost'
        raise ValueError(f"{source} {url!r} has no scheme; give http://{url} (or https://, ws://, wss://)")
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme.lower(), parts.scheme.lower())
    if scheme not in ("http", "https"):
        raise ValueError(f"{source} {url!r} has the scheme {parts.scheme!r}; give http://, https://, ws:// or wss:// "
                         f"(e.g. http://{parts.netloc or 'localhost:8000'})")
    try:
        parts.port  # noqa: B018 (raises for a port that is not a number or out of range)
    except ValueError as exc:
        raise ValueError(f"{source} {url!r} has a bad port ({exc}); give http://HOST:PORT, e.g. "
                         "http://127.0.0.1:8000") from None
    if not parts.hostname:
        raise ValueError(f"{source} {url!r} names no host; give http://HOST:PORT, e.g. http://127.0.0.1:8000")
    return urlunsplit((scheme, parts.netloc, parts.path, parts.query, parts.fragment))


def resolve_api_key(api_key: str | None) -> str | None:
    return api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def ws_url(base_url: str, path: str, query: Mapping[str, Any] | None = None) -> str:
    parts = urlsplit(base_url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    prefix = parts.path.rstrip("/")
    return urlunsplit((scheme, parts.netloc, prefix + path, urlencode(query or {}), ""))


def session_path(session_id: str, suffix: str = "") -> str:
    """The path of a session's route; ValueError for an id no session can have (spec.check_session_id)."""
    return f"/v1/sessions/{quote(check_session_id(session_id), safe='')}{suffix}"


def check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - set(CONFIG_FIELDS))
    if unknown:
        raise TypeError(f"unknown session config field(s) {unknown}; the fields are {list(CONFIG_FIELDS)}")
    return {name: value for name, value in config.items() if value is not None}


def refine_query(config: Mapping[str, Any]) -> dict[str, str]:
    """``/v1/refine`` takes the config as query parameters (lists as comma-separated text; no sigmas)."""
    fields = check_config(config)
    refused = [name for name in fields if not spec.BY_NAME[name].in_query]
    if refused:
        raise TypeError(f"/v1/refine takes no {', '.join(refused)}; create a session for those (it takes "
                        f"{list(spec.QUERY_NAMES)})")
    return {name: spec.BY_NAME[name].to_text(value) for name, value in fields.items()}


check_session_id = spec.check_session_id


def response_error(status: int, content: bytes, headers: Mapping[str, str]) -> APIError:
    try:
        body: Any = json.loads(content) if content else None
    except ValueError:
        body = content.decode("utf-8", "replace")
    return error_from(status, body, parse_retry_after(headers.get("retry-after")))


# --- how much of an answer the client reads --------------------------------------------------------------------
MAX_JSON_ANSWER_BYTES = 16 * 2**20
# What one latent frame can bring back, per batch row and latent pixel (one of the H x W positions): its latents,
# 4 bytes a channel (float32, the widest ``response_dtype``), and, when the outputs hold pixels, its video frames:
# the service loads only LTX-2 video VAEs, 8 pixel frames of 32 x 32 pixels per latent frame and pixel, 3 channels
# of 4 bytes (``float32``), 1 (``uint8``) or, encoded (``jpeg``, ``h264``, a format this client does not know), 2:
# an encoder's worst case, noise at its best quality, stays below twice the raw frame.
LATENT_CHANNEL_BYTES = 4
VIDEO_VALUES_PER_LATENT_PIXEL = 8 * 32 * 32 * 3
VIDEO_VALUE_BYTES = {"float32": 4, "uint8": 1}
# Per latent frame and batch row, whatever its size: an encoded frame's headers (8 JPEGs, or an H.264 segment's
# boxes and its init segment); per answer: the safetensors header and metadata.
ENCODED_FRAME_OVERHEAD_BYTES = 64 * 2**10
UNIT_HEADER_BYTES = 2**20
# Frames a session may hold back and send with a later answer when the client does not know its config: a field
# the handle was not given (``Session(client, id, {})``) takes the server's default, which may exceed the spec's.
UNKNOWN_HELD_FRAMES = 256
# The outputs and video format of a session whose handle was not given them: the session may have any, so the
# widest (video as float32 and a preview) is assumed.
UNKNOWN_OUTPUTS = tuple(kind.name for kind in spec.KINDS)
UNKNOWN_VIDEO_FORMAT = "float32"
# Video frames held back for an exact decode (``video_lookahead: "exact"``): the decoder's own look-ahead, 7 latent
# frames for the tiny test VAE, 22 for the released decoder's depth (GET /v1/info ``vae.lookahead_latent_frames``).
EXACT_LOOKAHEAD_FRAMES = 64
# The bound on a binary answer is this many times the most it can weigh: a bound against a runaway server, not an
# estimate to be tight against.
ANSWER_MARGIN = 2


def unit_answer_limit(shape: Any, config: Mapping[str, Any], *, whole_clip: bool = False) -> int:
    """The most bytes a unit answering latents of ``shape`` (B, C, t, H, W) may have, for a session of ``config``:
    ``ANSWER_MARGIN`` times what the latent frames it can cover weigh (``LATENT_CHANNEL_BYTES``, and the video
    ``VIDEO_VALUES_PER_LATENT_PIXEL`` when the config's ``outputs`` hold pixels: ``video``, ``preview`` or a kind
    this client does not know), plus ``UNIT_HEADER_BYTES`` for the header and metadata.

    The frames it can cover: a chunk's ``t`` plus those the session may have held back from earlier requests (the
    sink and a partial block, ``sink_frames + block_size``; with video, the frames its decoder waits for,
    ``video_lookahead``); ``whole_clip`` (``/v1/refine``): exactly the clip's ``t``. A server sending more is not
    answering what was asked; reading on would let a runaway (or hostile) one grow this process's memory without
    end.

    A session's ``config`` is the server's (whole) unless its handle was made with less (``Session(client, id,
    {})``): a field it lacks may have any value, so the widest is assumed (``UNKNOWN_HELD_FRAMES``,
    ``UNKNOWN_OUTPUTS``, ``UNKNOWN_VIDEO_FORMAT``). ``/v1/refine``'s is the request's own: a field it leaves out
    takes the default, the spec's for the outputs and the video format (no server setting changes those)."""
    dims = tuple(int(n) for n in shape)
    if len(dims) != 5:
        return MAX_JSON_ANSWER_BYTES  # no unit answers such latents: the server refuses them (an error's JSON)
    batch, channels, frames, height, width = dims
    fields = {name: value for name, value in config.items() if value is not None}
    outputs = fields.get("outputs", spec.BY_NAME["outputs"].default if whole_clip else UNKNOWN_OUTPUTS)
    kinds = outputs.split(",") if isinstance(outputs, str) else list(outputs)
    pixels = any(kind != "latents" for kind in kinds)
    if not whole_clip:
        for name in ("sink_frames", "block_size"):
            value = fields.get(name)
            frames += value if isinstance(value, int) and not isinstance(value, bool) else UNKNOWN_HELD_FRAMES
        if pixels:
            lookahead = fields.get("video_lookahead", spec.EXACT)
            frames += lookahead if isinstance(lookahead, int) and not isinstance(lookahead, bool) \
                else EXACT_LOOKAHEAD_FRAMES
    per_pixel = channels * LATENT_CHANNEL_BYTES
    per_frame = 0
    if pixels:
        video_format = fields.get("video_format", spec.BY_NAME["video_format"].default if whole_clip
                                  else UNKNOWN_VIDEO_FORMAT)
        per_pixel += VIDEO_VALUES_PER_LATENT_PIXEL * VIDEO_VALUE_BYTES.get(video_format, 2)
        per_frame += ENCODED_FRAME_OVERHEAD_BYTES
        if "preview" in kinds:  # a JPEG per unit, preview_width wide (unknown: the widest), the video's aspect
            preview = int(fields.get("preview_width") or spec.BY_NAME["preview_width"].maximum)
            per_frame += 2 * 3 * preview * max(preview * height // max(width, 1), 1) + ENCODED_FRAME_OVERHEAD_BYTES
    most = frames * batch * (height * width * per_pixel + per_frame)
    return ANSWER_MARGIN * most + UNIT_HEADER_BYTES


# --- how big a WebSocket message may be -------------------------------------------------------------------------
def geometry_of(item: Any) -> tuple[int, int, int, int] | None:
    """(B, C, H, W) of a stream chunk (an array, a ``Chunk`` or a chunk dict), None for anything else (the stream
    refuses it when it sends it, naming what is wrong)."""
    latents = item.get("latents") if isinstance(item, dict) else getattr(item, "latents", item)
    shape = getattr(latents, "shape", None)
    if shape is None or len(shape) != 5:
        return None
    batch, channels, _, height, width = (int(n) for n in shape)
    return batch, channels, height, width


def widest_geometry(info: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """The widest (B, C, H, W) a session of the server that answered ``info`` (``GET /v1/info``) may have: its
    ``limits.max_batch`` rows of ``model.channels`` channels and ``limits.max_frame_tokens`` latent pixels (taken as
    one column: the widest preview aspect). For a message of a session whose latents this client has not seen (a
    watch, a stream that sends no chunk)."""
    limits, model = info.get("limits"), info.get("model")
    numbers = {}
    for where, part, name in (("limits", limits, "max_batch"), ("model", model, "channels"),
                              ("limits", limits, "max_frame_tokens")):
        value = part.get(name) if isinstance(part, dict) else None
        if type(value) is not int or value < 1:
            raise ProtocolError(f"GET /v1/info: {where}.{name} is {value!r}, not a positive integer; the client "
                                "bounds a WebSocket message of an unseen session's geometry by it")
        numbers[name] = value
    return numbers["max_batch"], numbers["channels"], numbers["max_frame_tokens"], 1


# One WebSocket message is one unit (``unit_message_limit``): the safetensors header and metadata of one unit (a few
# hundred bytes: tensor names, shapes, frame ranges, a preview's frame numbers) have this much room.
MESSAGE_HEADER_BYTES = 64 * 2**10
# Per encoded piece (a JPEG frame or preview, a row's H.264 frames), besides one byte per RGB value: its headers and
# tables (a JPEG's about 600 bytes, an H.264 segment's boxes and init segment under 2 KiB, measured on 8 x 8 frames,
# where they weigh most). The values take no more than raw uint8 does: measured, noise, binary noise and
# checkerboards at the best quality (JPEG 100, H.264 CRF 0, yuv420p) take at most 0.77 of it on frames of 32 x 32
# pixels and more (one latent pixel is 32 x 32).
ENCODED_PIECE_OVERHEAD_BYTES = 4 * 2**10
# Bytes of one RGB value by video format: the raw formats exactly; an encoded one (``jpeg``, ``h264``, or one this
# client does not know) at most what uint8 takes, which is also what a unit whose encoding failed is sent as.
MESSAGE_VIDEO_VALUE_BYTES = {"float32": 4, "uint8": 1}
# An LTX-2 video VAE (the only kind the service loads): pixel frames per latent frame, pixels per latent pixel side.
LTX2_TEMPORAL, LTX2_SPATIAL = 8, 32


def unit_message_limit(geometry: tuple[int, int, int, int], config: Mapping[str, Any],
                       vae: Mapping[str, Any] | None = None) -> int:
    """The most bytes one unit of a session of ``config`` whose latents are ``geometry`` (B, C, H, W) can weigh as a
    WebSocket message (a stream's or a watch's: one unit each), from what the server sends, not with a margin:

    - its latents (with ``latents`` in ``outputs``): at most ``max(sink_frames, block_size)`` frames (a unit is the sink or one block, a flush's
      shorter), ``LATENT_CHANNEL_BYTES`` a channel (float32, the widest ``response_dtype``);
    - with video (``outputs``: ``video``, or a kind this client does not know): the pixel frames that became final
      with it, at most the VAE's temporal factor times those frames plus the ones its decoder held back
      (``video_lookahead``; ``exact``: the decoder's own, ``vae.lookahead_latent_frames`` of ``GET /v1/info``), of
      H x W latent pixels times the spatial factor squared, 3 values each in ``video_format``
      (``MESSAGE_VIDEO_VALUE_BYTES``; encoded: plus ``ENCODED_PIECE_OVERHEAD_BYTES`` a frame);
    - with ``preview``: one JPEG per row, ``preview_width`` wide and as tall as the video's aspect makes it (a
      session with a preview and no video decodes its video but does not send it);
    - ``MESSAGE_HEADER_BYTES`` for the header.

    ``vae``: ``GET /v1/info``'s ``vae`` (its ``temporal_compression``, ``spatial_compression`` and
    ``lookahead_latent_frames``); without it (or a figure missing) an LTX-2 VAE's factors and
    ``EXACT_LOOKAHEAD_FRAMES``. A field ``config`` lacks may have any value: the widest is assumed
    (``UNKNOWN_HELD_FRAMES``, ``UNKNOWN_OUTPUTS``, ``UNKNOWN_VIDEO_FORMAT``, the widest preview)."""
    batch, channels, height, width = (int(n) for n in geometry)
    fields = {name: value for name, value in config.items() if value is not None}

    def count(name: str, default: int, where: Mapping[str, Any] = fields) -> int:
        value = where.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default

    frames = max(count("sink_frames", UNKNOWN_HELD_FRAMES), count("block_size", UNKNOWN_HELD_FRAMES))
    kinds = output_kinds(fields)
    per_row = frames * height * width * channels * LATENT_CHANNEL_BYTES if "latents" in kinds else 0
    if any(kind not in ("latents", "preview") for kind in kinds):  # video, or a kind this client does not know
        vae = vae if isinstance(vae, Mapping) else {}
        temporal = count("temporal_compression", LTX2_TEMPORAL, vae) or LTX2_TEMPORAL
        spatial = count("spatial_compression", LTX2_SPATIAL, vae) or LTX2_SPATIAL
        held = count("video_lookahead", count("lookahead_latent_frames", EXACT_LOOKAHEAD_FRAMES, vae))
        video_format = fields.get("video_format", UNKNOWN_VIDEO_FORMAT)
        pixel_frames = temporal * (frames + held)
        pixels = height * width * spatial * spatial
        per_row += pixel_frames * pixels * 3 * MESSAGE_VIDEO_VALUE_BYTES.get(video_format, 1)
        if video_format not in MESSAGE_VIDEO_VALUE_BYTES:
            per_row += pixel_frames * ENCODED_PIECE_OVERHEAD_BYTES
    if "preview" in kinds:  # one JPEG a row, round(H_px * preview_width / W_px) tall (at least 1): not the video
        preview = count("preview_width", spec.BY_NAME["preview_width"].maximum) or 1
        tall = max(1, -(-height * preview // max(width, 1)))
        per_row += 3 * preview * tall + ENCODED_PIECE_OVERHEAD_BYTES
    return batch * per_row + MESSAGE_HEADER_BYTES


def output_kinds(config: Mapping[str, Any]) -> list[str]:
    """The output kinds of a session of ``config`` (``UNKNOWN_OUTPUTS`` when it does not say)."""
    outputs = config.get("outputs")
    outputs = UNKNOWN_OUTPUTS if outputs is None else outputs
    return outputs.split(",") if isinstance(outputs, str) else list(outputs)


def limit_needs_info(config: Mapping[str, Any], geometry: tuple[int, int, int, int] | None, watch: bool) -> bool:
    """Whether a WebSocket's ``MessageLimit`` reads ``GET /v1/info``: for the widest geometry when the client has
    not seen the session's latents, and, for a watch, for the VAE's figures (``unit_message_limit``) when its units
    may hold pixels. A stream that knows its geometry does not: its first contact stays its WebSocket (a handle
    made without a request learns the server's state from it), and it takes an LTX-2 VAE's figures."""
    return geometry is None or (watch and any(kind != "latents" for kind in output_kinds(config)))


def message_limit(what: str, config: Mapping[str, Any], geometry: tuple[int, int, int, int] | None,
                  info: Mapping[str, Any] | None) -> MessageLimit:
    """The ``MessageLimit`` of a connection (``what``) of a session of ``config``, from its latents' ``geometry``
    (None: the widest ``info`` allows) and ``info``'s ``vae`` (``limit_needs_info`` says when ``info`` is needed)."""
    if geometry is None:
        geometry = widest_geometry(info)
    return MessageLimit(what, geometry, config, None if info is None else info.get("vae"))


class MessageLimit:
    """What one WebSocket connection may receive: a binary message (a unit) up to ``unit_bytes``
    (``unit_message_limit`` of the session's geometry ``(B, C, H, W)``, with ``vae``: ``GET /v1/info``'s, when the
    client read it), a text message (an event) up to ``MAX_JSON_ANSWER_BYTES``. ``max_size`` (the larger) is
    websockets' own bound, which refuses a bigger message from its frame header, before reading it (``too_big`` names
    it); ``check`` refuses a message of one kind over its own bound. ``what``: the connection, for the message
    (``stream of session ...``)."""

    def __init__(self, what: str, geometry: tuple[int, int, int, int], config: Mapping[str, Any],
                 vae: Mapping[str, Any] | None = None):
        self.what = what
        self.unit_bytes = unit_message_limit(geometry, config, vae)
        self.json_bytes = MAX_JSON_ANSWER_BYTES
        self.max_size = max(self.unit_bytes, self.json_bytes)

    def check(self, message: str | bytes) -> None:
        """``ProtocolError`` for a message over its kind's bound."""
        if isinstance(message, bytes):
            if len(message) > self.unit_bytes:
                raise self._over(len(message), self.unit_bytes, "binary")
        elif len(message) > self.json_bytes // 4 and len(message.encode("utf-8")) > self.json_bytes:
            raise self._over(len(message.encode("utf-8")), self.json_bytes, "text")

    def too_big(self, exc: BaseException) -> ProtocolError | None:
        """The ``ProtocolError`` of a connection this client closed (1009) because a message ran past ``max_size``,
        else None (``exc``: the ``ConnectionClosed`` its receive raised)."""
        from websockets.exceptions import PayloadTooBig

        cause = getattr(exc, "__cause__", None)
        if not isinstance(cause, PayloadTooBig) or cause.message is not None:
            return None
        size = (cause.size or 0) + (cause.current_size or 0)
        return self._over(size, cause.max_size, "")

    def _over(self, size: int, limit: int, kind: str) -> ProtocolError:
        if kind == "text":
            why = "an event of the service is a few KiB (MAX_JSON_ANSWER_BYTES)"
        else:
            why = ("the most one unit of this session can weigh, with margin "
                   "(wm_refiner_client._common.MessageLimit)")
        said = f"a {kind} message of {size} bytes" if kind else f"a message of at least {size} bytes"
        return ProtocolError(f"{self.what}: the server sent {said}, over this connection's limit of {limit} bytes "
                             f"({why}); not read further, the connection is closed. Is this a wm-refiner server "
                             "(the address: --server, $WM_REFINER_URL)?")


@dataclass(frozen=True)
class Answer:
    """An HTTP answer, read whole within its limit (``AnswerBody``): what the clients' callers read of it."""

    status_code: int
    headers: Mapping[str, str]  # httpx's, case-insensitive
    content: bytes


class AnswerBody:
    """One HTTP answer's body as it arrives (the sync and the asyncio client feed it the chunks they stream), read
    no further than its limit: a ``ProtocolError`` naming the size and the limit as soon as the answer declares more
    (``Content-Length``) or sends more; the driver then leaves the stream, which closes the connection unread.

    The limit: ``limit`` (``unit_answer_limit``) for a successful answer of binary units (``POST /v1/refine``, a
    chunk's); ``MAX_JSON_ANSWER_BYTES``, 16 MiB, for every other answer, errors included. A JSON answer of the
    service is small: ``/v1/info`` and a session's state a few KiB, a listing page of its largest size (1000
    sessions) well under 1 MiB, an error's envelope (or a router's HTML page) under one; 16 MiB is more than ten
    times the largest, and a server sending more is not the service (or is broken): reading on, a body that never
    ends (httpx's timeout applies to each read, not to the body) would grow this process's memory without bound.

    ``attempts`` (``protocol.RequestAttempts``): its ``RetryPolicy.deadline_s`` is checked as each piece arrives,
    so a body that trickles in (each read within the timeout) stops at the call's deadline."""

    def __init__(self, response: Any, what: str, limit: int | None = None, attempts: Any = None):
        self.status_code = response.status_code
        self.headers = response.headers
        self.what = what
        self.binary = limit is not None and 200 <= self.status_code < 300
        self.limit = limit if self.binary else MAX_JSON_ANSWER_BYTES
        self.attempts = attempts
        self.size = 0
        self._parts: list[bytes] = []
        declared = response.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            raise self._over(int(declared), declared=True)

    def add(self, piece: bytes) -> None:
        self.size += len(piece)
        if self.size > self.limit:
            raise self._over(self.size, declared=False)
        self._parts.append(piece)
        if self.attempts is not None:
            self.attempts.check_deadline(f"{self.size} bytes of the answer's body had arrived")

    def answer(self) -> Answer:
        return Answer(self.status_code, self.headers, b"".join(self._parts))

    def _over(self, size: int, *, declared: bool) -> ProtocolError:
        said = f"declares {size} bytes" if declared else f"ran past {self.limit} bytes ({size} read)"
        why = ("the most the units asked for can weigh, with margin (wm_refiner_client._common.unit_answer_limit)"
               if self.binary else "a JSON answer of the service is a few KiB (MAX_JSON_ANSWER_BYTES)")
        return ProtocolError(f"{self.what}: the server's {self.status_code} answer {said}, over this answer's limit "
                             f"of {self.limit} bytes ({why}); not read further, the connection is closed. Is this a "
                             "wm-refiner server (the address: --server, $WM_REFINER_URL)?")


def json_answer(response: Any, what: str, required: Iterable[str] = ()) -> dict[str, Any]:
    """The JSON object of a successful answer to ``what`` (``"GET /v1/info"``), with the ``required`` fields;
    ``ProtocolError`` naming what is wrong otherwise (a body that is not JSON: most often another server at that
    address, or a proxy's page), rather than a bare ``JSONDecodeError`` or ``KeyError``."""
    content = response.content
    try:
        data = json.loads(content)
    except ValueError:
        kind = response.headers.get("content-type") or "no content type"
        raise ProtocolError(f"{what}: the server answered {response.status_code} with a body that is not JSON "
                            f"({kind}, {len(content)} bytes: {content[:120]!r}); is this a wm-refiner server (the "
                            "address: --server, $WM_REFINER_URL)?") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{what}: the server answered a JSON {type(data).__name__}, not an object: "
                            f"{content[:120]!r}")
    missing = [name for name in required if name not in data]
    if missing:
        raise ProtocolError(f"{what}: the server's answer lacks {', '.join(missing)} (got the fields "
                            f"{sorted(data)[:20]})")
    return data


def redirect_error(response: Any, what: str) -> ProtocolError:
    """A 3xx: the service never redirects, and the client follows no redirect (a credential or a chunk sent on to
    another host, a loop): the address is most likely a proxy's or a wrong path."""
    where = response.headers.get("location") or "nowhere"
    return ProtocolError(f"{what}: the server answered {response.status_code}, a redirect to {where}; the client "
                         "follows no redirects: give the service's own address (--server, $WM_REFINER_URL)")


def from_answer(cls: Any, data: Any, what: str) -> Any:
    """``cls.from_json(data)``; ``ProtocolError`` when ``data`` lacks a field or has one of the wrong kind."""
    try:
        return cls.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"{what}: the server's answer is not a {cls.__name__} ({type(exc).__name__}: {exc}): "
                            f"{json.dumps(data, default=str)[:200]}") from None


def event_error(event: Mapping[str, Any]) -> APIError:
    """The typed error of a WebSocket ``{"type": "error", "error": {...}}`` event."""
    error = event.get("error") or {}
    if not isinstance(error, dict) or not isinstance(error.get("code", ""), str):
        raise ProtocolError(f"the server sent an error event that is not the service's: {str(event)[:200]}")
    code = error.get("code", "")
    cls = ERROR_CLASSES.get(code)
    status = cls.status if cls is not None else 0
    return error_from(status, {"error": error})


def watch_item(message: str | bytes, return_tensors) -> Any:
    """One watch message: a ``Unit`` (binary), a ``BlockEvent``, a ``DroppedEvent``, None when the session is done
    (``done``); an ``error`` event is raised, an unknown event type is skipped (``WATCH_SKIP``). An event whose fields
    are not the service's is a ``ProtocolError``."""
    from .units import Unit

    if isinstance(message, bytes):
        return Unit.from_payload(message, return_tensors)
    event = parse_event(message)
    kind = event["type"]

    def count(name: str) -> int:
        if not is_count(event[name]):
            raise ValueError(name)
        return event[name]

    try:
        if kind == "block":
            latency = event.get("latency_ms")
            return BlockEvent(count("frame_start"), count("frame_end"), None if latency is None else float(latency))
        if kind == "dropped":
            return DroppedEvent(count("units"))
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"the server sent a {kind} event that is not the service's: {message[:200]!r}") from None
    if kind == "done":
        return None
    if kind == "error":
        raise event_error(event)
    return WATCH_SKIP


WATCH_SKIP = object()  # an event a watcher does not hand on (a type this client does not know)


def watch_message(watch: Any, limit: MessageLimit, message: str | bytes, return_tensors) -> Any:
    """One message of ``watch`` (a ``Watch`` or an ``AsyncWatch``), within ``limit``: what ``watch_item`` makes of it,
    with ``watch.frame_end`` (where its last unit ends) and, at the ``done`` event (None), ``watch.frames`` set."""
    from .units import Unit

    limit.check(message)
    item = watch_item(message, return_tensors)
    if item is None:
        watch.frames = done_frames(message)
    elif isinstance(item, Unit):
        watch.frame_end = item.frame_end
    return item


def watch_open_timeout(timeout: float, deadline_s: float | None) -> float:
    """The timeout of a watch's handshake: the client's ``timeout``, cut to ``RetryPolicy.deadline_s``."""
    return timeout if deadline_s is None else min(timeout, deadline_s)


def watch_open_failed(exc: BaseException, what: str, timeout: float, deadline_s: float | None) -> BaseException:
    """The error of a watch's handshake that failed with ``exc``: one naming ``RetryPolicy.deadline_s`` when the
    deadline (shorter than ``timeout``) is what cut it, else ``exc``."""
    if deadline_s is not None and deadline_s < timeout and isinstance(exc.__cause__, TimeoutError):
        return type(exc)(f"{what}: RetryPolicy.deadline_s ({deadline_s:g} s) passed during the handshake ({exc})")
    return exc


def is_count(value: Any) -> bool:
    """A count as the service sends it: a JSON integer >= 0. Not what ``int()`` takes: 2.5, "7" or true would pass
    for one, and Infinity (which Python's json reads) raises OverflowError."""
    return type(value) is int and value >= 0


def done_frames(message: str) -> int | None:
    """The ``frames`` of a ``done`` event (the frames the session returned in all; None when it has none)."""
    frames = parse_event(message).get("frames")
    if frames is not None and not is_count(frames):
        raise ProtocolError(f"the server sent a done event whose frames are not a frame count: {message[:200]!r}")
    return frames


def parse_event(text: str) -> dict[str, Any]:
    try:
        event = json.loads(text)
    except ValueError:
        raise ProtocolError(f"the server sent a text message that is not JSON: {text[:200]!r}") from None
    if not isinstance(event, dict) or "type" not in event:
        raise ProtocolError(f"the server sent an event without a type: {text[:200]!r}")
    return event


FLUSH_MESSAGE = json.dumps({"type": "flush"})


# --- what the server describes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionState:
    """``GET /v1/sessions/{id}``: where the session stands. ``raw`` holds every field the server sent."""

    session_id: str
    config: dict[str, Any]
    frames_received: int
    frames_returned: int
    pending_frames: int
    next_seq: int
    flushed: bool
    streaming: bool
    video_frames_returned: int = 0
    # Where it is (active, parked, spilled) and what it holds there ({device, host, disk, parts}).
    memory_state: str = "active"
    bytes: dict[str, Any] = field(default_factory=dict, repr=False)
    durable_frames: int | None = None  # input frames its last crash checkpoint covers; None: no checkpoints
    late_blocks: int | None = None  # a realtime session's blocks committed after their deadline; None: not realtime
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionState:
        return cls(
            session_id=data["session_id"],
            config=data.get("config", {}),
            frames_received=data["frames_received"],
            frames_returned=data["frames_returned"],
            pending_frames=data.get("pending_frames", 0),
            next_seq=data["next_seq"],
            flushed=data.get("flushed", False),
            streaming=data.get("streaming", False),
            video_frames_returned=data.get("video_frames_returned", 0),
            memory_state=data.get("state", "active"),
            bytes=data.get("bytes", {}),
            durable_frames=data.get("durable_frames"),
            late_blocks=data.get("late_blocks"),
            raw=data,
        )


def resumed_frames(state: SessionState, frames_returned: int | None) -> int:
    """Where a handle from ``get_session`` starts its units: the caller's own count of refined frames it holds
    (``frames_returned``), else the server's. The caller cannot hold more than the server returned."""
    if frames_returned is None:
        return state.frames_returned
    if isinstance(frames_returned, bool) or not isinstance(frames_returned, int) or frames_returned < 0:
        raise ValueError(f"frames_returned must be an integer >= 0 (the refined frames you hold), "
                         f"got {frames_returned!r}")
    if frames_returned > state.frames_returned:
        raise ValueError(f"frames_returned={frames_returned}, but session {state.session_id} has returned only "
                         f"{state.frames_returned} frames: pass the last frame_end you received")
    return frames_returned


def warn_unreachable(unreachable: Iterable[str]) -> None:
    """Behind a router with ``peers``, a listing names the replicas that gave none (``unreachable``): their sessions
    are missing from it, which a caller (and ``python -m app sessions``) is told rather than shown a short list."""
    missing = sorted(set(unreachable))
    if missing:
        logging.getLogger("wm_refiner_client").warning(
            "GET /v1/sessions: no listing from %s: their sessions are not in this list (a replica down, draining or "
            "slow; the answering replica waits 2 s for its peers)", ", ".join(missing))


@dataclass(frozen=True)
class SessionSummary:
    """One line of ``GET /v1/sessions``."""

    session_id: str
    created_at: str
    last_active_at: str
    frames_received: int
    frames_returned: int
    flushed: bool
    streaming: bool
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionSummary:
        return cls(
            session_id=data["session_id"],
            created_at=data.get("created_at", ""),
            last_active_at=data.get("last_active_at", ""),
            frames_received=data.get("frames_received", 0),
            frames_returned=data.get("frames_returned", 0),
            flushed=data.get("flushed", False),
            streaming=data.get("streaming", False),
            raw=data,
        )


@dataclass(frozen=True)
class BlockEvent:
    """A watcher's note after each refined block's unit."""

    frame_start: int
    frame_end: int
    latency_ms: float | None


@dataclass(frozen=True)
class DroppedEvent:
    """A watcher fell behind and lost ``units`` units (watchers never slow the session down)."""

    units: int


@dataclass
class StreamStats:
    """Progress of one ``session.stream(...)``: frames handed to the server, frames received refined, blocks,
    reconnects, and the server's latency of the last block."""

    frames_sent: int = 0
    frames_refined: int = 0
    video_frames: int = 0
    units: int = 0
    reconnects: int = 0
    last_latency_ms: float | None = None


# Close codes after which reconnecting is pointless: 1008 without a preceding error event means another connection
# took the session over; 1009: a message over the server's size limit (its error event names the limit).
FATAL_CLOSE_CODES = frozenset({1008, 1009})
# Error events after which the server closes the stream itself and the session can go on: reconnect and resume.
RESUMABLE_EVENT_CODES = frozenset({"draining", "engine_busy", "internal_error", "not_ready", "session_moved"})


def watch_query(outputs: str | Iterable[str] | None, video_format: str | None,
                video_quality: str | int | None, resume_from: int | None = None) -> dict[str, str]:
    """A watch's query: ``outputs`` (a kind or several), ``video_format`` / ``video_quality`` (a watcher may ask
    for another encoding than the session's own, within the server's ``max_watch_encodings``); None leaves each
    to the session. ``resume_from``: the latent frames the watcher has (the server sends the units it kept from
    there first); a negative or non-integer one is a ``ValueError``, nothing sent."""
    query: dict[str, str] = {}
    if resume_from is not None:
        if isinstance(resume_from, bool) or not isinstance(resume_from, int) or resume_from < 0:
            raise ValueError(f"resume_from={resume_from!r}: pass the latent frames this watcher has received (an "
                             "int >= 0: the last unit's frame_end), or None to watch from now on")
        query["resume_from"] = str(resume_from)
    if outputs is not None:
        query["outputs"] = outputs if isinstance(outputs, str) else ",".join(outputs)
    if video_format is not None:
        query["video_format"] = str(video_format)
    if video_quality is not None:
        query["video_quality"] = str(video_quality)
    return query
