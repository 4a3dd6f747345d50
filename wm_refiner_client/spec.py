"""A session's fields, declared once: name, type, wire default, bounds, the server setting that supplies its default,
the settings that cap it, and its doc text.

Everything else is derived from ``FIELDS``: the JSON body of ``POST``/``PUT /v1/sessions`` and its OpenAPI schema
(``app.api.openapi``), ``/v1/refine``'s query parameters (``app.api.routes.refine``), the ``default_*`` settings and
``/v1/info``'s session part (``app.core.settings``, ``app.api.routes.info``), the command line's flags (``app.cli.commands``,
``app.cli.remote``) and this client's keyword arguments (``_common``). A new field is one line in ``FIELDS`` plus
the code that uses it.

Plain Python on purpose: the client package installs without torch or the service, and the service imports this
module rather than the other way round. ``models.config.SessionConfig`` (the model's frozen config) keeps its own
defaults, since ``models/`` depends on nothing above it; tests/app/api/test_spec.py checks that the two agree.

Also here: the one rule for session ids (``check_session_id``), shared by the routes, the client and the snapshot
files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from . import formats

# --- bounds a single field can state (rules across fields stay with models.config: 422 invalid_config) ---------------
SEED_MAX = 2**63 - 1
FPS_MAX = 1000.0
# Far below this (about 1e-35) the RoPE time positions (pixel frame / fps, float32) overflow and the model's output is
# NaN, which the service would report as the input's fault. The floor leaves a wide margin where the refiner is
# checked within parity (tests/models/test_session.py): 0.001 fps is a latent frame every 8000 s, no video's rate.
FPS_MIN = 0.001
FRAMES_MAX = 1 << 20  # sink_frames, block_size, kv_max_frames, video_lookahead
KV_MAX_FRAMES_MIN = 2  # the smallest sink_frames + block_size
SIGMAS_MIN_ITEMS = 2
# The 3-step distilled schedule of the public SANA-WM refiner release.
DEFAULT_SIGMAS: tuple[float, ...] = (0.909375, 0.725, 0.421875, 0.0)
EXACT = "exact"
RAW_FORMATS: tuple[str, ...] = ("uint8", "float32")  # video_format's unencoded choices (the encoded: ``formats``)

# The value kinds a field can have. Text (a query parameter, a command-line flag) becomes a JSON value by kind.
INTEGER = "integer"  # a JSON integer; text: decimal digits
NUMBER = "number"  # a JSON number; text: a float
CHOICE = "choice"  # one of ``choices``
NUMBERS = "numbers"  # a list of numbers; text: comma-separated
CHOICES = "choices"  # a list of distinct ``choices``; text: comma-separated
WORD_OR_INTEGER = "word_or_integer"  # the field's ``word`` or an integer in [minimum, maximum]; text: word or digits
LOOKAHEAD = WORD_OR_INTEGER  # video_lookahead: "exact" or latent frames
AUTO = "auto"
BOOLEAN = "boolean"  # a JSON true or false; text: true or false

CONFIG = "config"  # the model's config (models.config.SessionConfig)
OUTPUTS = "outputs"  # what the session's units carry (app.outputs.kinds.Outputs)
FLAGS = "flags"  # how the service treats the session (app.engine.pacing), neither the model's nor the outputs'


@dataclass(frozen=True)
class SessionField:
    """One field of a session. ``default``: what a session gets when neither it nor the server says otherwise;
    ``setting``: the server setting that overrides that default (None: fixed); ``limited_by``: server settings that
    cap it beyond its own bounds (reported in ``/v1/info`` limits); ``in_query``: ``/v1/refine`` takes it as a query
    parameter (a list of sigmas is a session's business)."""

    name: str
    kind: str
    default: Any
    doc: str
    part: str = CONFIG
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] = ()
    min_items: int | None = None
    max_items: int | None = None
    setting: str | None = None
    limited_by: tuple[str, ...] = ()
    in_query: bool = True
    word: str = EXACT  # WORD_OR_INTEGER: the one word it takes besides an integer

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def default_json(self) -> Any:
        return list(self.default) if isinstance(self.default, tuple) else self.default

    def json_schema(self) -> dict[str, Any]:
        """The JSON Schema of a value of this field (not null; the wire's "unset" is leaving the field out)."""
        bounds: dict[str, Any] = {}
        if self.minimum is not None:
            bounds["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
        if self.maximum is not None:
            bounds["maximum"] = self.maximum
        if self.kind == INTEGER:
            return {"type": "integer", **bounds}
        if self.kind == NUMBER:
            return {"type": "number", **bounds}
        if self.kind == CHOICE:
            return {"type": "string", "enum": list(self.choices)}
        if self.kind == BOOLEAN:
            return {"type": "boolean"}
        items = {"type": "number", **bounds} if self.kind == NUMBERS else {"type": "string", "enum": list(self.choices)}
        if self.kind in (NUMBERS, CHOICES):
            schema: dict[str, Any] = {"type": "array", "items": items}
            if self.min_items is not None:
                schema["minItems"] = self.min_items
            if self.max_items is not None:
                schema["maxItems"] = self.max_items
            return schema
        if self.kind == WORD_OR_INTEGER:
            return {"anyOf": [{"type": "string", "const": self.word}, {"type": "integer", **bounds}]}
        raise AssertionError(f"unknown field kind {self.kind!r}")

    def from_text(self, text: str) -> Any:
        """The JSON value a query parameter or a command-line flag stands for; ValueError saying what to write.
        Only the form is checked here: bounds are the server's to check, like a JSON body's."""
        if self.kind == INTEGER:
            if not re.fullmatch(r"-?[0-9]+", text):
                raise ValueError(f"{self.name} must be a plain integer such as {self.default!r}, got {text!r}")
            return int(text)
        if self.kind == NUMBER:
            try:
                return float(text)
            except ValueError:
                raise ValueError(f"{self.name} must be a number such as {self.default!r}, got {text!r}") from None
        if self.kind == CHOICE:
            return text
        if self.kind == BOOLEAN:
            if text not in ("true", "false"):
                raise ValueError(f"{self.name} must be true or false, got {text!r}")
            return text == "true"
        if self.kind == NUMBERS:
            try:
                return [float(part) for part in text.split(",")]
            except ValueError:
                raise ValueError(
                    f"{self.name} must be comma-separated numbers such as "
                    f"{','.join(str(v) for v in self.default)}, got {text!r}"
                ) from None
        if self.kind == CHOICES:
            return [part for part in text.split(",") if part]
        if self.kind == WORD_OR_INTEGER:
            if text == self.word:
                return self.word
            if not re.fullmatch(r"[0-9]+", text):
                unit = " (latent frames)" if self.name == "video_lookahead" else ""
                raise ValueError(f"{self.name} must be {self.word!r} or an integer >= 0{unit}, got {text!r}")
            return int(text)
        raise AssertionError(f"unknown field kind {self.kind!r}")

    def expects(self) -> str:
        """What a value of this field is, in words (an error's "send ... instead")."""
        def bound(value: float | None) -> str:
            return "" if value is None else (str(int(value)) if self.kind != NUMBER else f"{value:g}")

        low = "(" if self.exclusive_minimum else "["
        if self.kind in (INTEGER, NUMBER) and self.minimum is not None and self.maximum is not None:
            what = "an integer" if self.kind == INTEGER else "a number"
            return f"{what} in {low}{bound(self.minimum)}, {bound(self.maximum)}]"
        if self.kind == CHOICE:
            return f"one of {list(self.choices)}"
        if self.kind == CHOICES:
            return f"a list of distinct {list(self.choices)}"
        if self.kind == NUMBERS:
            return f"a list of numbers in [{bound(self.minimum)}, {bound(self.maximum)}]"
        if self.kind == WORD_OR_INTEGER:
            # The range is the widest; what it means (per format, for video_quality) is the field's doc.
            return f"{self.word!r} or an integer in [{bound(self.minimum)}, {bound(self.maximum)}]: {self.doc}"
        if self.kind == BOOLEAN:
            return "true or false"
        return f"a {self.kind}"

    def bounded_integer(self, value: Any) -> int:
        """An INTEGER field's JSON value (unset: its default) checked against its bounds; ValueError naming the
        field and its range otherwise (the server's 422)."""
        value = self.default if value is None else value
        low, high = int(self.minimum), int(self.maximum)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{self.name} must be an integer in [{low}, {high}], got {value!r}; send, say, "
                             f"{self.default}")
        return value

    def to_text(self, value: Any) -> str:
        """The inverse of ``from_text``: a JSON value as a query parameter or a flag's argument."""
        if isinstance(value, (list, tuple)):
            return ",".join(str(v) for v in value)
        if isinstance(value, bool):
            return str(value).lower()
        return str(value)


_MODEL_FIELDS: tuple[SessionField, ...] = (
    SessionField("seed", INTEGER, 42, "noise seed", minimum=0, maximum=SEED_MAX, setting="default_seed"),
    SessionField("fps", NUMBER, 16.0, "frame rate (the RoPE time scale)", minimum=FPS_MIN, maximum=FPS_MAX,
                 setting="default_fps"),
    SessionField("sink_frames", INTEGER, 1, "leading frames kept raw, the attention sink S", minimum=1,
                 maximum=FRAMES_MAX, setting="default_sink_frames"),
    SessionField("block_size", INTEGER, 3, "frames refined together", minimum=1, maximum=FRAMES_MAX,
                 setting="default_block_size", limited_by=("max_window_frames",)),
    SessionField("kv_max_frames", INTEGER, 11, "sink + history frames a block attends to besides itself; at least "
                 "sink_frames + block_size", minimum=KV_MAX_FRAMES_MIN, maximum=FRAMES_MAX,
                 setting="default_kv_max_frames", limited_by=("max_window_frames",)),
    SessionField("sigmas", NUMBERS, DEFAULT_SIGMAS, "the Euler schedule: strictly decreasing, ending in 0.0",
                 minimum=0, maximum=1, min_items=SIGMAS_MIN_ITEMS, setting="default_sigmas",
                 limited_by=("max_denoise_steps",), in_query=False),
    SessionField("positions", CHOICE, "absolute", "RoPE positions: absolute (the reference) or rebased (bounded, "
                 "for long streams)", choices=("absolute", "rebased"), setting="default_positions"),
)


@dataclass(frozen=True)
class OutputKind:
    """One kind of output a session may ask for (a choice of ``outputs``) and the session fields that shape it
    (``options``: part ``outputs``). The server's stage of the same name (``app.outputs``) reads and validates them
    and says what else it needs."""

    name: str
    doc: str
    options: tuple[SessionField, ...] = ()


# The output kinds, in the order of their tensors on the wire. A new kind is one entry here (with its options), its
# stage module and its registration (``app.outputs.catalog.STAGE_TYPES``).
KINDS: tuple[OutputKind, ...] = (
    OutputKind("latents", "the refined latent frames (B, C, n, H, W)"),
    OutputKind("video", "the decoded pixel frames (needs the server's vae setting)", options=(
        SessionField("video_format", CHOICE, "uint8", "uint8 (B, F, H, W, 3) RGB, float32 (B, F, 3, H, W) in [0, "
                     "1], jpeg (one JPEG per frame) or h264 (one fragmented-MP4 segment per unit)", part=OUTPUTS,
                     choices=RAW_FORMATS + formats.NAMES),
        SessionField("video_quality", WORD_OR_INTEGER, AUTO, "jpeg: quality 1-100 (auto: 85); h264: CRF 0-51, "
                     "lower is better (auto: 23); uint8 and float32 ignore it", part=OUTPUTS, minimum=0,
                     maximum=100, word=AUTO),
        SessionField("video_lookahead", LOOKAHEAD, EXACT, "'exact' (equal to the whole-clip decode) or N latent "
                     "frames of look-ahead", part=OUTPUTS, minimum=0, maximum=FRAMES_MAX),
    )),
    OutputKind("preview", "a small JPEG of each unit's last video frame, for session lists (needs the server's "
               "vae setting)", options=(SessionField(
                   "preview_width", INTEGER, 160, "the preview's width in pixels (its height keeps the video's aspect "
                   "ratio)", part=OUTPUTS, minimum=16, maximum=1024),)),
)
KIND_BY_NAME: dict[str, OutputKind] = {k.name: k for k in KINDS}

FIELDS: tuple[SessionField, ...] = (
    *_MODEL_FIELDS,
    SessionField("outputs", CHOICES, ("latents",), "what units carry: " + "; ".join(
        f"{k.name}: {k.doc}" for k in KINDS), part=OUTPUTS, choices=tuple(k.name for k in KINDS), min_items=1,
                 max_items=len(KINDS)),
    *(option for kind in KINDS for option in kind.options),
    SessionField("realtime", BOOLEAN, False, "the client plays the stream at fps as it arrives: each block has a "
                 "deadline (late_blocks counts the missed ones) and, with the server's admission: realtime, the "
                 "session is only admitted if the engine can keep up", part=FLAGS, in_query=False),
)
BY_NAME: dict[str, SessionField] = {f.name: f for f in FIELDS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
CONFIG_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS if f.part == CONFIG)
OUTPUT_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS if f.part == OUTPUTS)
FLAG_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS if f.part == FLAGS)
QUERY_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS if f.in_query)


def defaults() -> dict[str, Any]:
    """Every field's default as JSON (what a server with no ``default_*`` settings gives a session)."""
    return {f.name: f.default_json() for f in FIELDS}


def lookahead_frames(value: Any) -> int | None:
    """The one reading of ``video_lookahead``'s JSON value: None for "exact" (or unset), else the latent frames a
    pixel frame waits for. Text goes through ``SessionField.from_text`` first. ValueError saying what to send."""
    if value is None or value == EXACT:
        return None
    top = BY_NAME["video_lookahead"].maximum
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise ValueError(f"video_lookahead must be \"exact\" or an integer in [0, {top}] (latent frames), got {value!r}")
    return value


# What ``video_quality`` means per encoded format: (lowest, highest, what "auto" stands for).
QUALITY_RANGES: dict[str, tuple[int, int, int]] = {name: f.quality for name, f in formats.FORMATS.items()}


def video_quality(video_format: str, value: Any) -> int | None:
    """The one reading of ``video_quality``'s JSON value for ``video_format``: the JPEG quality or the H.264 CRF
    ("auto" or unset: the format's default), None for the raw formats, which have no quality and ignore it (a query
    or a command line that sets it for every format stays valid). ValueError saying what to send."""
    if value is None:
        value = AUTO
    if video_format not in QUALITY_RANGES:
        if value != AUTO and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100):
            raise ValueError(f"video_quality must be 'auto' or an integer in [0, 100], got {value!r}")
        return None
    low, high, default = QUALITY_RANGES[video_format]
    if value == AUTO:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        what = formats.FORMATS[video_format].quality_doc
        raise ValueError(f"video_quality for {video_format} is {what}: 'auto' ({default}) or an integer in "
                         f"[{low}, {high}], got {value!r}")
    return value


def output_kinds(value: Any) -> tuple[str, ...]:
    """The one reading of ``outputs``' JSON value (unset: the default), in canonical order; ValueError saying what
    to send."""
    spec = BY_NAME["outputs"]
    kinds = spec.default if value is None else value
    if not isinstance(kinds, (list, tuple)) or not kinds or any(k not in spec.choices for k in kinds):
        raise ValueError(f"outputs must be a non-empty list of {list(spec.choices)}, got {kinds!r}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"outputs lists a kind twice: {list(kinds)}; list each at most once")
    return tuple(kind for kind in spec.choices if kind in kinds)


# --- session ids --------------------------------------------------------------------------------------------------
SESSION_ID_RULE = "[A-Za-z0-9_-]{8,64}"
_SESSION_ID = re.compile(SESSION_ID_RULE)


def is_session_id(session_id: object) -> bool:
    """Whether ``session_id`` may name a session.

    The one rule, for every session: 8 to 64 of A-Z, a-z, 0-9, '_' and '-' (api.md 1.1 documents it for the ids
    clients choose with ``PUT``; the ids the server makes, 32 hex digits of a UUID, obey it too). Being a plain
    token it is safe in a URL path, in a router's hash, in a log line and as a file name in ``snapshot_dir``: no
    '/', no '.', nothing a shell or a glob reads specially. Anything else names no session: the routes answer 404
    (422 where a client tries to create one), the client refuses it before sending, and ``app.persistence.records`` never
    turns it into a path.
    """
    return isinstance(session_id, str) and _SESSION_ID.fullmatch(session_id) is not None


def check_session_id(session_id: object) -> str:
    """``session_id`` when it obeys ``is_session_id``'s rule; ValueError saying what to choose otherwise."""
    if not is_session_id(session_id):
        shown = session_id[:80] if isinstance(session_id, str) else session_id
        raise ValueError(
            f"session id {shown!r} is not 8 to 64 of A-Z, a-z, 0-9, '_' and '-' ({SESSION_ID_RULE}); choose one "
            "such id (a UUID's hex digits, for one)"
        )
    return session_id  # type: ignore[return-value]
