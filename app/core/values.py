"""Setting values that need more than a type: byte sizes (``40GiB``) and browser origins (``cors_origins``).

Shared by the settings (``app.core.settings``) and the command line (``python -m app plan --reserve``), so that a
size means the same wherever it is written.
"""

from __future__ import annotations

import math
from typing import Any, Iterable
from urllib.parse import urlsplit


def parse_bytes(value: Any) -> int:
    """Bytes from an integer or a string such as ``40GiB``, ``512 MiB``, ``1.5e9``."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number of bytes")
    if isinstance(value, (int, float)):
        number = value
    else:
        text = str(value).strip()
        units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
                 "tb": 10**12, "b": 1}
        scale = 1
        for suffix, size in units.items():
            if text.lower().endswith(suffix):
                text, scale = text[: -len(suffix)].strip(), size
                break
        try:
            number = float(text) * scale
        except ValueError:
            raise ValueError(f"{value!r} is not a number of bytes; write e.g. 40000000000, 40GiB or 512MiB") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{value!r} is not a number of bytes (>= 0)")
    return int(number)


def check_origin(origin: str) -> str:
    """``origin`` when it is ``*`` or a browser origin (``scheme://host[:port]``, no path); ValueError otherwise.

    A browser's ``Origin`` is compared as a string, so ``http://localhost:3000/`` (a trailing slash) or a path would
    never match anything: refused here rather than silently matching nothing."""
    origin = origin.strip()
    if origin == "*":
        return origin
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or parts.fragment \
            or parts.username or parts.password:
        raise ValueError(
            f"cors_origins entry {origin!r} is not an origin; give scheme://host[:port] exactly as the browser's "
            "Origin header shows it (e.g. 'http://localhost:3000', 'https://app.example.com', no path or trailing "
            "'/'), or '*' for any origin"
        )
    return origin.lower()


def parse_origins(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """The allow-list from a setting: a comma-separated string (environment, flag) or a list (YAML)."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(check_origin(str(item)) for item in items if str(item).strip())
