"""The wire format: safetensors bytes <-> named tensors plus string metadata (``frame_start``, ``frame_end``,
``seq``, ``latency_ms``)."""

from __future__ import annotations

import json
import struct
from collections import Counter
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _load
from safetensors.torch import save as _save

from app.core.error_kinds import ApiError

LATENTS = "latents"
PROMPT_EMBEDS = "prompt_embeds"
PROMPT_MASK = "prompt_attention_mask"
CHUNK_TENSORS = (LATENTS, PROMPT_EMBEDS, PROMPT_MASK)
OCTET_STREAM = "application/octet-stream"


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None = None) -> bytes:
    """safetensors bytes; tensors go to the CPU, metadata values become strings."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    return _save(cpu, metadata=meta or None)


# What an empty body of POST /v1/sessions/{id}/chunks without flush=true is told (with flush=true it is a flush).
EMPTY_CHUNK = (
    "the body is empty and flush is not true: send a safetensors file (safetensors.torch.save) with a 'latents' "
    "tensor (B, C, t, H, W), or, to refine the pending frames as the final block without new frames, an empty "
    "body with ?flush=true"
)
EMPTY_PAYLOAD = "the body is empty; send a safetensors file (safetensors.torch.save) with a 'latents' tensor"
# What an empty binary message on the WebSocket stream is told.
EMPTY_MESSAGE = (
    "the binary message is empty: send a safetensors file (safetensors.torch.save) with a 'latents' tensor, or the "
    'text {"type": "flush"} to refine the pending frames as the final block'
)


# The largest safetensors header a request may have. A payload names at most the three CHUNK_TENSORS (a header of a
# few hundred bytes, whatever their sizes) plus whatever __metadata__ its writer adds; safetensors' own parser takes
# headers up to 100 MB, and on one of tens of MB (thousands of metadata keys, or of zero-size tensors) it runs for
# seconds, on the event loop that serves every other connection. Bounded here, before it runs.
MAX_HEADER_BYTES = 64 * 1024


# What a WebSocket binary message that holds JSON text is told (a client whose send() took the flush's bytes).
JSON_MESSAGE = 'commands such as {"type": "flush"} go in a text message; binary messages carry safetensors payloads'
JSON_BODY = "a session's config goes to POST /v1/sessions (JSON); a chunk's or a clip's body is a safetensors file"


def decode(data: bytes, allowed: tuple[str, ...] = CHUNK_TENSORS, empty: str = EMPTY_PAYLOAD,
           json_text: str = JSON_BODY) -> dict[str, torch.Tensor]:
    """The tensors of a request payload; ``ApiError`` (400) when the bytes are not safetensors, have a header over
    ``MAX_HEADER_BYTES``, name a tensor twice or hold a tensor name the route does not know (a misspelt name must
    not be silently ignored). ``empty``: the message for no bytes at all, which says what the route takes instead;
    ``json_text``: what to do instead, for bytes that are a JSON object (whose first 8 bytes, read as the header's
    length, would otherwise make the refusal say the header is too large)."""
    if not data:
        raise ApiError("invalid_payload", empty)
    if data[:1] == b"{" and len(data) <= MAX_HEADER_BYTES:
        try:
            text = json.loads(bytes(data))
        except (ValueError, RecursionError):
            text = None
        if isinstance(text, dict):
            raise ApiError(
                "invalid_payload",
                f"the bytes are JSON text ({bytes(data[:80]).decode(errors='replace')!r}), not a safetensors file; "
                f"{json_text}",
            )
    if len(data) >= 8:
        (header_size,) = struct.unpack_from("<Q", data)
        if header_size > MAX_HEADER_BYTES:
            raise ApiError(
                "invalid_payload",
                f"the safetensors header declares {header_size} bytes, more than the {MAX_HEADER_BYTES} this server "
                f"reads (a payload names at most {list(allowed)}: a header of a few hundred bytes); send the "
                "bytes of safetensors.torch.save({'latents': ..., 'prompt_embeds': ...}) with little or no "
                "__metadata__",
            )
        _refuse_repeated_keys(bytes(data[8 : 8 + header_size]))
    try:
        tensors = _load(bytes(data))
    except (SafetensorError, Exception) as exc:  # whatever the parser trips on, the bytes are the client's
        raise ApiError(
            "invalid_payload",
            f"the body is not a safetensors file ({exc}); send the bytes of safetensors.torch.save({{'latents': "
            "..., 'prompt_embeds': ...})",
        ) from None
    unknown = sorted(set(tensors) - set(allowed))
    if unknown:
        raise ApiError(
            "invalid_payload",
            f"unknown tensor name(s) {unknown}; a payload holds only {list(allowed)}",
        )
    return tensors


class _RepeatedKeys(ValueError):
    pass


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    mapping = dict(pairs)
    if len(mapping) < len(pairs):  # linear: a header of thousands of keys must not cost seconds
        counts = Counter(key for key, _ in pairs)
        raise _RepeatedKeys(sorted(key for key, n in counts.items() if n > 1))
    return mapping


def _refuse_repeated_keys(header: bytes) -> None:
    """400 for a header that names a tensor (or a field, or a metadata key) twice: safetensors' parser keeps one
    of them without a word, and which one another reader (a proxy, a logger, the sender's own tools) takes is
    its own choice, so the payload means what each reader decides. A header that is not JSON is left to the
    parser, whose message says so."""
    try:
        json.loads(header, object_pairs_hook=_once)
    except _RepeatedKeys as exc:
        raise ApiError(
            "invalid_payload",
            f"the safetensors header names {exc.args[0]} more than once in one object; name each tensor (and each "
            "of its fields, each __metadata__ key) once: safetensors.torch.save writes such a header",
        ) from None
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep: the parser says so below
        pass


def read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` map of safetensors bytes (safetensors.torch.load drops it)."""
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_size])
    return dict(header.get("__metadata__") or {})


def decode_response(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Client side: the tensors and metadata of a response payload."""
    return _load(bytes(data)), read_metadata(data)
