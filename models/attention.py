"""Self- and cross-attention of a batched refiner forward, and the lifecycle of the K/V each forward writes.

Shape letters: R rows of the batched call, B one session's batch, N tokens, D inner dim, A heads, L prompt
length, T tokens per frame.

A batched forward carries blocks of several sessions, each with its own window, positions and prompt. The
model keeps no per-session state: for each forward the caller builds a ``ForwardWindow`` holding one
``RowWindow`` per session, passed to the blocks as diffusers' ``kv_cache`` (self-attention) and a
``PromptBatch`` passed as ``encoder_hidden_states`` (cross-attention). Every op that mixes tokens runs per
session, on exactly the shapes a solo forward uses; everything else (the linear layers, norms, the
feed-forward) runs on the stacked rows. That is what makes a session's output independent of its neighbours
(``models.determinism``).

``WindowAttnProcessor`` (attn1) does what diffusers' ``SanaWMLTX2RefinerAttnProcessor`` does, op for op, so the
output stays bit-identical to the reference; but instead of concatenating ``[sink | history | block]`` per
forward it writes the block's K/V into the session's window buffer (``models.kv``) and attends to the buffer.
``PromptAttnProcessor`` (attn2) does what ``SanaWMLTX2AudioVideoAttnProcessor`` does, per session over that
session's own unpadded prompt (padding a shorter prompt changes SDPA's bits), reading the prompt's K/V that
``PreparedPrompt`` computed once per prompt and layer (they depend on the prompt alone, never on the tokens);
given a plain tensor it *is* diffusers' processor, so the model still runs under diffusers' own forward.

The write lifecycle: each ``ForwardWindow`` owns a one-shot ``KVWrites`` record. Every layer registers its
write for every session; the forward's driver calls ``verify()`` once, right after the forward. A commit
keeps what the last forward wrote, so anything that could leave a write missing (a window made for another
mode, a record read twice or reused, a forward that short-circuited before attention, a processor that
ignores the window) raises ``CaptureError`` naming the layer, the mode, the likely cause and the fix.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal, Sequence

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMLTX2AudioVideoAttnProcessor

from .attention_op import attend
from .errors import CaptureError
from .kv import SessionKV
from .rope import RopeTables, apply_rope

# What a forward does with its session's cache:
#   sink:    no prefix; keep the sink's pre-RoPE K and its V.
#   denoise: attend to [sink | history | block]; the block's K/V are scratch.
#   commit:  the same; the block's K/V become history when the block is committed.
WindowMode = Literal["sink", "denoise", "commit"]

# The diffusers ``kv_cache_mode`` each kind of forward corresponds to (the model validates the string).
DIFFUSERS_MODE: dict[str, str] = {
    "sink": "capture_pre_rope",
    "denoise": "inject",
    "commit": "inject_and_capture_post_rope",
}

# Set by ``fullgraph()``: the per-session functions are traced by torch.compile (not disabled) and the kernel is the
# ``wm_refiner::attend`` op (``models.attention_op``), so a block compiles with fullgraph=True.
TRACEABLE = False


@contextmanager
def fullgraph() -> Iterator[None]:
    """Within it, the per-session functions run traceable and the kernel through ``attend``: a transformer block
    compiled (and run) here is one graph."""
    global TRACEABLE
    previous = TRACEABLE
    TRACEABLE = True
    try:
        yield
    finally:
        TRACEABLE = previous

_FIX = (
    "run forwards through models.step.run_batch (it builds a fresh window per forward and verifies its writes "
    "once), and keep models.attention.WindowAttnProcessor on every block's attn1 and PromptAttnProcessor on "
    "every attn2 (models.attention.install_processors(model))"
)


@dataclass(frozen=True)
class PreparedPrompt:
    """A session's prompt as cross-attention reads it, computed once per prompt (``models.step.prepare_prompt``),
    not in every layer of every forward: each layer's keys (after ``norm_k``) and values of the caption-projected
    prompt, ``kv`` (Y, 2, B, L, D), and the additive mask (B, A, 1, L) as attention takes it, or None to attend to
    every token (no mask sent, an all-ones one, or a padding mask: ``models.session.check_prompt`` then kept
    only the tokens it attends to), which leaves attention free to pick a fused kernel. Kept with
    the session (counted in its bytes, ``models.session_bytes``); a snapshot stores the prompt, and this is computed again
    from it on restore: same shapes, same kernels, same bits."""

    kv: torch.Tensor
    mask: torch.Tensor | None

    @property
    def batch(self) -> int:
        return int(self.kv.shape[2])

    @property
    def length(self) -> int:
        return int(self.kv.shape[3])


@dataclass(frozen=True)
class RowWindow:
    """One session's part of a batched forward: rows ``[row_start, row_end)`` of the stacked batch."""

    kv: SessionKV
    mode: WindowMode
    tables: RopeTables  # RoPE of the block's own tokens (queries and new keys)
    history_frames: int  # the block slot starts after this many history frames
    frames: int
    row_start: int
    row_end: int
    prompt: PreparedPrompt
    owner: object = None  # who this row belongs to (the session), for errors and fault injection in tests

    @property
    def slot(self) -> tuple[int, int]:
        """Token range this forward writes its K/V to; attention reads the window up to its end."""
        if self.mode == "sink":
            return 0, self.kv.layout.sink_tokens
        return self.kv.layout.block(self.history_frames, self.frames)


class KVWrites:
    """Which (layer, session) pairs one forward wrote; read once with ``verify()``."""

    def __init__(self, modes: Sequence[WindowMode], num_layers: int):
        self.modes = list(modes)
        self._written = [[False] * len(self.modes) for _ in range(num_layers)]
        self._verified = False

    @property
    def mode(self) -> str:
        kinds = sorted(set(self.modes))
        return kinds[0] if len(kinds) == 1 else "+".join(kinds)

    def mark(self, layer: int, row: int) -> None:
        if self._verified:
            raise CaptureError(
                f"layer {layer}: K/V written through a window of mode {self.mode!r} that was already verified. "
                f"Cause: a window was reused for a second forward. Fix: {_FIX}."
            )
        if self._written[layer][row]:
            raise CaptureError(
                f"layer {layer}: a second K/V write for session row {row} in one forward of mode {self.mode!r}. "
                f"Cause: a window was reused for a second forward, or a processor wrote twice. Fix: {_FIX}."
            )
        self._written[layer][row] = True

    def verify(self, processors: list[str] | None = None) -> None:
        """Raise unless every layer wrote every session's K/V exactly once in this forward."""
        if self._verified:
            raise CaptureError(
                f"the K/V writes of a forward of mode {self.mode!r} were already verified. Cause: K/V collected "
                "twice. Fix: verify each forward's window once, right after the forward."
            )
        missing = [i for i, rows in enumerate(self._written) if not all(rows)]
        if missing:
            layer = missing[0]
            found = f" (attn1 processor there: {processors[layer]})" if processors else ""
            raise CaptureError(
                f"missing captured K/V on layer {layer}{found} of {len(self._written)} for mode {self.mode!r} "
                f"(layers without K/V: {missing}). Likely causes: the forward short-circuited or failed before "
                "that layer's self-attention ran, or a custom attention processor ignores the window and its "
                f"capture. Fix: {_FIX}."
            )
        self._verified = True


class LayerWindow:
    """What one layer's self-attention reads and writes during one forward (diffusers' layer cache slot).

    It holds the forward's rows and writes, never the ``ForwardWindow`` itself: a window that held its layers and
    layers that held their window were a reference cycle, so each forward's RoPE tables and row views outlived it
    until Python's cyclic collector ran (on CUDA the device memory grew by a block's tables per block, then fell
    when a collection happened to run; seen on an H200 by ``tests/gpu/test_cuda.py``)."""

    def __init__(self, rows: list[RowWindow], writes: KVWrites, kv_cache_mode: str, index: int):
        self.rows = rows
        self.writes = writes
        self.kv_cache_mode = kv_cache_mode
        self.index = index

    def check_mode(self, kv_cache_mode: str | None) -> None:
        expected = self.kv_cache_mode
        if kv_cache_mode != expected:
            raise CaptureError(
                f"layer {self.index}: the forward ran with kv_cache_mode={kv_cache_mode!r} but its window was "
                f"created for mode {self.writes.mode!r}, which needs kv_cache_mode={expected!r}. Cause: "
                f"capture enabled in one mode and collected in another. Fix: {_FIX}."
            )


class ForwardWindow:
    """The cache view of one batched forward, passed to diffusers' blocks as ``kv_cache``."""

    def __init__(self, rows: Sequence[RowWindow], num_layers: int):
        if not rows:
            raise ValueError("a forward needs at least one session")
        for row in rows:
            if row.mode not in DIFFUSERS_MODE:
                raise ValueError(f"unknown window mode {row.mode!r}; use one of {sorted(DIFFUSERS_MODE)}")
            if row.mode != "sink" and not row.kv.has_sink:
                raise ValueError("a block forward attends to the sink: capture the sink first")
        self.rows = list(rows)
        self.writes = KVWrites([row.mode for row in rows], num_layers)
        self.sink_pe = None  # diffusers' forward reads this attribute; our rows carry their own tables
        mode = self.kv_cache_mode
        self._layers = [LayerWindow(self.rows, self.writes, mode, i) for i in range(num_layers)]

    @property
    def kv_cache_mode(self) -> str:
        modes = {row.mode for row in self.rows}
        if modes == {"sink"}:
            return DIFFUSERS_MODE["sink"]
        if modes == {"denoise"}:
            return DIFFUSERS_MODE["denoise"]
        return DIFFUSERS_MODE["commit"]

    def __len__(self) -> int:
        return len(self._layers)

    def get(self, layer: int) -> LayerWindow:
        return self._layers[layer]


class PromptBatch:
    """The prompts of a batched forward, handed to the blocks as ``encoder_hidden_states``."""

    def __init__(self, rows: Sequence[RowWindow]):
        self.rows = list(rows)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(2, (heads, -1))  # (B, N, A, D/A)


def _attend(query, key, value, heads: int, backend, parallel_config, mask=None) -> torch.Tensor:
    if TRACEABLE and backend is None and parallel_config is None:
        return attend(query, key, value, heads, mask)
    out = dispatch_attention_fn(
        _heads(query, heads),
        _heads(key, heads),
        _heads(value, heads),
        attn_mask=mask,
        dropout_p=0.0,
        is_causal=False,
        backend=backend,
        parallel_config=parallel_config,
    )
    return out.flatten(2, 3).to(query.dtype)  # (B, N, D)


def _gate(attn, hidden_states: torch.Tensor, gate_logits: torch.Tensor | None) -> torch.Tensor:
    """Per-head output gates of one session's rows (B, N, D). Applied per session: the sigmoid's vectorized and
    scalar code paths round differently, and which elements fall in the scalar tail depends on the tensor's size."""
    if gate_logits is None:
        return hidden_states
    gates = 2.0 * torch.sigmoid(gate_logits)  # (B, N, A)
    return (hidden_states.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)


def _project(attn, hidden_states: torch.Tensor) -> torch.Tensor:
    hidden_states = attn.to_out[0](hidden_states)
    return attn.to_out[1](hidden_states)


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # (R, N, D)


class WindowAttnProcessor:
    """Self-attention of each session's block queries over that session's ``[sink | history | block]``.

    The per-token work (projections, norms, output) runs on the stacked rows; the per-session part is one
    function, ``_window_attention``, kept out of ``torch.compile`` (``models.compiled``) so that a compiled step
    sees only tensors of fixed shapes and never retraces for another mix of sessions."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: RopeTables | None = None,
        key_rotary_emb: RopeTables | None = None,
        sink_rotary_emb: RopeTables | None = None,
        kv_cache: LayerWindow | None = None,
        kv_cache_mode: str | None = None,
    ) -> torch.Tensor:
        del encoder_hidden_states, attention_mask, key_rotary_emb, sink_rotary_emb
        plain = kv_cache is None and kv_cache_mode is None
        if not plain and not isinstance(kv_cache, LayerWindow):
            raise CaptureError(
                f"attn1 got a kv_cache of type {type(kv_cache).__name__}, not a models.attention.ForwardWindow "
                f"layer (mode {kv_cache_mode!r}). Fix: {_FIX}."
            )
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        query = attn.norm_q(attn.to_q(hidden_states))  # (R, N, D)
        key = attn.norm_k(attn.to_k(hidden_states))  # (R, N, D)
        value = attn.to_v(hidden_states)  # (R, N, D)
        if plain:
            # No cache at all: plain full self-attention over the tokens given (diffusers' forward without a
            # cache, as the benchmark's no-cache baseline runs it).
            query = apply_rope(query, query_rotary_emb, attn.rope_type)
            key = apply_rope(key, query_rotary_emb, attn.rope_type)
            hidden = _attend(query, key, value, attn.heads, self._attention_backend, self._parallel_config)
            return _project(attn, _gate(attn, hidden, gate_logits))
        window_attention = _window_attention.__wrapped__ if TRACEABLE else _window_attention
        hidden = window_attention(attn, kv_cache, kv_cache_mode, query, key, value, gate_logits,
                                  self._attention_backend, self._parallel_config)
        return _project(attn, hidden)


@torch.compiler.disable
def _window_attention(attn, layer: LayerWindow, kv_cache_mode, query, key, value, gate_logits, backend, parallel):
    """Each session's rows of one layer: write the block's K/V into its window, attend, gate. (R, N, D); rows
    past the last session (a compiled step's padding) are zeros."""
    layer.check_mode(kv_cache_mode)
    outputs = []
    for index, row in enumerate(layer.rows):
        rows = slice(row.row_start, row.row_end)
        kv = row.kv
        start, end = row.slot
        row_key = key[rows]
        if row.mode == "sink":
            kv.sink_key[layer.index].copy_(row_key)  # pre-RoPE: each block rotates it to where the sink sits then
        elif kv.history_key is not None:
            sink = kv.layout.sink_tokens
            kv.history_key[layer.index, :, start - sink : end - sink] = row_key  # pre-RoPE: re-rotated per block
        row_query = apply_rope(query[rows], row.tables, attn.rope_type)
        row_key = apply_rope(row_key, row.tables, attn.rope_type)
        keys, values = kv.key(layer.index), kv.value(layer.index)  # (B, N_window, D)
        keys[:, start:end] = row_key
        values[:, start:end] = value[rows]
        hidden = _attend(row_query, keys[:, :end], values[:, :end], attn.heads, backend, parallel)
        outputs.append(_gate(attn, hidden, None if gate_logits is None else gate_logits[rows]))
        layer.writes.mark(layer.index, index)
    return _assemble(outputs, query)


class PromptAttnProcessor:
    """Cross-attention of each session's tokens over that session's own prompt.

    Given a ``PromptBatch`` it runs per session (``_prompt_attention``, kept out of ``torch.compile`` like the
    window attention); given a tensor (diffusers' own forward) it is diffusers'
    ``SanaWMLTX2AudioVideoAttnProcessor``."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: int = 0):
        self.layer = layer  # which layer's prompt K/V (``PreparedPrompt.kv[layer]``) this block reads
        self._plain = SanaWMLTX2AudioVideoAttnProcessor()

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states=None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: RopeTables | None = None,
        key_rotary_emb: RopeTables | None = None,
    ) -> torch.Tensor:
        prompts = encoder_hidden_states
        if not isinstance(prompts, PromptBatch):
            return self._plain(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                               key_rotary_emb)
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        query = attn.norm_q(attn.to_q(hidden_states))  # (R, N, D)
        prompt_attention = _prompt_attention.__wrapped__ if TRACEABLE else _prompt_attention
        # The processor itself, not ``self.layer``: an int read here would be a constant of the compiled piece,
        # guarded, so each of the 48 layers would compile its own copy of the same graph (measured: one more
        # graph per layer and forward kind, past dynamo's cache limit at the released depth). Read inside the
        # function that stays out of the graph, it costs no guard.
        hidden = prompt_attention(attn, self, prompts, query, gate_logits, self._attention_backend,
                                  self._parallel_config)
        return _project(attn, hidden)


@torch.compiler.disable
def _prompt_attention(attn, processor: PromptAttnProcessor, prompts: PromptBatch, query, gate_logits, backend,
                      parallel):
    """Each session's rows over its own prompt's K/V of ``processor.layer``; (R, N, D), padding rows zero. The K/V were
    projected once per prompt on that session's own (B, L, D) shape (``models.step.prepare_prompt``), never stacked
    with other sessions' prompts: a GEMM's rounding depends on M, and a stacked M would be the sum of the neighbours'
    prompt lengths (measured on an AMD EPYC: a row's bits then depended on who shared the call)."""
    layer = processor.layer
    outputs = []
    for row in prompts.rows:
        key, value = row.prompt.kv[layer]  # (B, L, D) each
        rows = slice(row.row_start, row.row_end)
        hidden = _attend(query[rows], key, value, attn.heads, backend, parallel, row.prompt.mask)
        outputs.append(_gate(attn, hidden, None if gate_logits is None else gate_logits[rows]))
    return _assemble(outputs, query)


def _assemble(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The sessions' outputs stacked in row order, zero rows after them up to ``like``'s row count."""
    stacked = _stack(parts)  # (R_sessions, N, D)
    missing = like.shape[0] - stacked.shape[0]
    if missing:
        stacked = torch.cat([stacked, stacked.new_zeros(missing, *stacked.shape[1:])])  # (R, N, D)
    return stacked


def install_processors(model: torch.nn.Module) -> None:
    """Put our stateless processors on every block's self- and cross-attention (shared by all sessions)."""
    for index, block in enumerate(model.transformer_blocks):
        block.attn1.set_processor(WindowAttnProcessor())
        block.attn2.set_processor(PromptAttnProcessor(index))


def processor_names(model: torch.nn.Module) -> list[str]:
    return [type(block.attn1.processor).__name__ for block in model.transformer_blocks]


def check_processors(model: torch.nn.Module, mode: str) -> None:
    """Fail before any compute if a layer's attention would ignore the window or the per-session prompts."""
    for index, block in enumerate(model.transformer_blocks):
        processor = block.attn1.processor
        if not isinstance(processor, WindowAttnProcessor):
            raise CaptureError(
                f"layer {index}: attn1 uses {type(processor).__name__}, which ignores the window for mode "
                f"{mode!r} (its K/V would never be captured or its prefix never attended). Cause: a custom "
                f"attention processor that ignores the capture flag. Fix: {_FIX}."
            )
        cross = block.attn2.processor
        if not isinstance(cross, PromptAttnProcessor):
            raise CaptureError(
                f"layer {index}: attn2 uses {type(cross).__name__}, which cannot read each session's own prompt "
                f"in a batched forward. Fix: {_FIX}."
            )
