"""What makes two HTTP chunks sent under one ``seq`` the same request (api.md, ``seq``).

A repeat of the last accepted ``seq`` gets the stored response only when it is that request again: the same
``flush`` and the same body bytes. A chunk sent under a used ``seq`` with other frames or another ``flush`` is a
client bug (its frames would be silently dropped, its flush not done), refused with 409 ``seq_conflict``.

The body is kept as its length and SHA-256, not as its bytes: SHA-256 because on the AMD EPYC machine it runs at
~1.8 GB/s (SHA extensions) against ~0.75 GB/s for BLAKE2b; a 720p chunk of 3 latent frames (1.35 MB in float32)
takes ~0.8 ms, a body at the default ``max_body_bytes`` (64 MiB) ~40 ms, so a large one is hashed off the event
loop (``app.sessions.operations``). The request is saved with the stored response (``app.persistence.records``),
so a retry after a drain, a restart or an adoption by another replica is recognised too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChunkRequest:
    flush: bool
    size: int  # the body's bytes
    sha256: str  # hex

    @classmethod
    def of(cls, body: bytes, flush: bool) -> ChunkRequest:
        return cls(flush, len(body), hashlib.sha256(body).hexdigest())

    def differences(self, other: ChunkRequest) -> list[str]:
        """What ``other`` (a new request) changes of this one (the accepted one), in words; empty when the same."""
        found = []
        if other.flush != self.flush:
            found.append(f"flush={str(other.flush).lower()} where it had flush={str(self.flush).lower()}")
        if other.size != self.size:
            found.append(f"a body of {other.size} bytes where it had {self.size}")
        elif other.sha256 != self.sha256:
            found.append(f"other body bytes (the same length, {self.size} bytes)")
        return found

    def to_fields(self) -> dict[str, Any]:
        return {"flush": self.flush, "bytes": self.size, "sha256": self.sha256}

    @classmethod
    def from_fields(cls, fields: Any) -> ChunkRequest | None:
        """The request ``to_fields`` wrote, None for None; ValueError for anything else."""
        if fields is None:
            return None
        if not isinstance(fields, dict):
            raise ValueError(f"a chunk request is a JSON object, not {type(fields).__name__}")
        flush, size, digest = fields.get("flush"), fields.get("bytes"), fields.get("sha256")
        if (not isinstance(flush, bool) or type(size) is not int or size < 0 or not isinstance(digest, str)
                or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
            raise ValueError(f"a chunk request is {{flush: bool, bytes: int >= 0, sha256: 64 hex digits}}, not "
                             f"{str(fields)[:200]}")
        return cls(flush, size, digest)
