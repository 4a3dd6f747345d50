"""Windowed self-attention for the streaming refiner, and the K/V capture lifecycle.

Shape letters: B batch, N tokens, D inner dim, A heads.

The model keeps no per-session state. For each forward the caller builds a ``ForwardWindow`` from the
session's cache; it is passed as diffusers' ``kv_cache`` and its mode is fixed at creation. If the mode
captures, the window owns a ``KVCapture`` that is read exactly once through ``take()``. Everything that can
leave a capture empty (a mode mismatch, a second read, a forward that never reached attention, a processor
that ignores the window) raises ``CaptureError`` naming the layer, the mode, the likely cause and the fix.

``WindowAttnProcessor`` performs the same operations, in the same order, as diffusers'
``SanaWMLTX2RefinerAttnProcessor``, so absolute-position output is bit-identical to the reference; it adds
rebased positions (history keys kept pre-RoPE and rotated to the current window) and float64 RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from .errors import CaptureError
from .rope import RopeTables, apply_rope

# What a forward does with the cache:
#   sink:    no prefix; capture pre-RoPE K/V of the sink frames.
#   denoise: attend to [sink | history | block]; capture nothing.
#   commit:  attend to [sink | history | block]; capture the block's K/V for the history
#            (post-RoPE with absolute positions, pre-RoPE with rebased ones).
WindowMode = Literal["sink", "denoise", "commit"]

# The diffusers ``kv_cache_mode`` string each of our modes runs under (the model validates it).
DIFFUSERS_MODE: dict[str, str] = {
    "sink": "capture_pre_rope",
    "denoise": "inject",
    "commit": "inject_and_capture_post_rope",
}

_FIX = (
    "run forwards through models.forward.run_forward (it builds a fresh window per forward and reads its "
    "capture once), and keep models.attention.WindowAttnProcessor on every block's attn1 "
    "(models.attention.install_processors(model))"
)


@dataclass(frozen=True)
class LayerKV:
    """One layer's K/V, each (B, N, D). ``rotated`` says whether RoPE has been applied to ``key``."""

    key: torch.Tensor
    value: torch.Tensor
    rotated: bool


class KVCapture:
    """The K/V one forward captured, one slot per layer; read once with ``take()``."""

    def __init__(self, mode: WindowMode, num_layers: int, rotated: bool):
        self.mode = mode
        self.rotated = rotated
        self._slots: list[LayerKV | None] = [None] * num_layers
        self._taken = False

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if self._taken:
            raise CaptureError(
                f"layer {layer}: K/V stored into a capture of mode {self.mode!r} that was already read. "
                f"Cause: a window was reused for a second forward. Fix: {_FIX}."
            )
        if self._slots[layer] is not None:
            raise CaptureError(
                f"layer {layer}: a second K/V was stored into a capture of mode {self.mode!r}. Cause: a window "
                f"was reused for a second forward, or a processor captured twice. Fix: {_FIX}."
            )
        self._slots[layer] = LayerKV(key, value, self.rotated)

    def take(self, processors: list[str] | None = None) -> list[LayerKV]:
        """Every layer's K/V; raises if read before or if any layer is empty."""
        if self._taken:
            raise CaptureError(
                f"capture of mode {self.mode!r} was already read (reading clears it). Cause: K/V collected twice. "
                "Fix: keep the list returned by the first take() instead of reading again."
            )
        missing = [i for i, slot in enumerate(self._slots) if slot is None]
        if missing:
            layer = missing[0]
            found = f" (attn1 processor there: {processors[layer]})" if processors else ""
            raise CaptureError(
                f"missing captured K/V on layer {layer}{found} of {len(self._slots)} for mode {self.mode!r} "
                f"(layers without K/V: {missing}). Likely causes: the forward short-circuited or failed before "
                "that layer's self-attention ran, or a custom attention processor ignores the window and its "
                f"capture. Fix: {_FIX}."
            )
        self._taken = True
        slots = [slot for slot in self._slots if slot is not None]
        self._slots = [None] * len(self._slots)
        return slots


class LayerWindow:
    """What one layer's self-attention reads from the cache during one forward (diffusers' layer cache slot)."""

    def __init__(self, window: ForwardWindow, index: int):
        self.window = window
        self.index = index

    def check_mode(self, kv_cache_mode: str | None) -> None:
        expected = DIFFUSERS_MODE[self.window.mode]
        if kv_cache_mode != expected:
            raise CaptureError(
                f"layer {self.index}: the forward ran with kv_cache_mode={kv_cache_mode!r} but its window was "
                f"created for mode {self.window.mode!r}, which needs kv_cache_mode={expected!r}. Cause: capture "
                f"enabled in one mode and collected in another. Fix: {_FIX}."
            )


class ForwardWindow:
    """The cache view of one forward, passed to diffusers as ``kv_cache``: fixed mode, optional capture.

    ``sink`` holds pre-RoPE sink K/V per layer (rotated here with ``sink_tables``); ``history`` holds the
    history K/V per layer, post-RoPE (absolute) or pre-RoPE (rebased, rotated with ``history_tables``).
    """

    def __init__(
        self,
        mode: WindowMode,
        num_layers: int,
        sink: list[LayerKV] | None = None,
        sink_tables: RopeTables | None = None,
        history: list[LayerKV] | None = None,
        history_tables: RopeTables | None = None,
        capture_rotated: bool = True,
    ):
        if mode not in DIFFUSERS_MODE:
            raise ValueError(f"unknown window mode {mode!r}; use one of {sorted(DIFFUSERS_MODE)}")
        if mode == "sink" and (sink or history):
            raise ValueError("a sink capture runs without a prefix: pass neither sink nor history")
        if sink is not None and sink_tables is None:
            raise ValueError("sink K/V is stored pre-RoPE: pass sink_tables to rotate it")
        if history and not history[0].rotated and history_tables is None:
            raise ValueError("pre-RoPE history K/V needs history_tables")
        self.mode = mode
        self.sink = sink
        self.sink_pe = sink_tables  # the attribute diffusers' forward reads and hands to every layer
        self.history = history
        self.history_tables = history_tables
        rotated = capture_rotated if mode == "commit" else False
        self.capture = KVCapture(mode, num_layers, rotated) if mode != "denoise" else None
        self._layers = [LayerWindow(self, i) for i in range(num_layers)]

    @property
    def kv_cache_mode(self) -> str:
        return DIFFUSERS_MODE[self.mode]

    def __len__(self) -> int:
        return len(self._layers)

    def get(self, layer: int) -> LayerWindow:
        return self._layers[layer]


class WindowAttnProcessor:
    """Self-attention of the active block's queries over ``[sink | history | block]`` keys and values."""

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
        layer = kv_cache
        if layer is not None:
            if not isinstance(layer, LayerWindow):
                raise CaptureError(
                    f"attn1 got a kv_cache of type {type(layer).__name__}, not a models.attention.ForwardWindow "
                    f"layer (mode {kv_cache_mode!r}). Fix: {_FIX}."
                )
            layer.check_mode(kv_cache_mode)
        elif kv_cache_mode is not None:
            raise CaptureError(f"kv_cache_mode={kv_cache_mode!r} was set without a window. Fix: {_FIX}.")
        window = layer.window if layer is not None else None

        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        query = attn.norm_q(attn.to_q(hidden_states))  # (B, N, D)
        key = attn.norm_k(attn.to_k(hidden_states))  # (B, N, D)
        value = attn.to_v(hidden_states)  # (B, N, D)

        capture = window.capture if window is not None else None
        if capture is not None and not capture.rotated:
            capture.store(layer.index, key, value)

        query = apply_rope(query, query_rotary_emb, attn.rope_type)
        key = apply_rope(key, query_rotary_emb, attn.rope_type)

        if capture is not None and capture.rotated:
            capture.store(layer.index, key, value)

        if window is not None and window.mode != "sink":
            prefix_k: list[torch.Tensor] = []
            prefix_v: list[torch.Tensor] = []
            if window.sink is not None:
                sink = window.sink[layer.index]
                prefix_k.append(apply_rope(sink.key.to(key.dtype), window.sink_pe, attn.rope_type))
                prefix_v.append(sink.value.to(value.dtype))
            if window.history:
                history = window.history[layer.index]
                history_k = history.key.to(key.dtype)
                if not history.rotated:
                    history_k = apply_rope(history_k, window.history_tables, attn.rope_type)
                prefix_k.append(history_k)
                prefix_v.append(history.value.to(value.dtype))
            if prefix_k:
                key = torch.cat([*prefix_k, key], dim=1)  # (B, N_sink + N_history + N, D)
                value = torch.cat([*prefix_v, value], dim=1)

        query = query.unflatten(2, (attn.heads, -1))  # (B, N, A, D/A)
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=None,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)  # (B, N, D)
        if gate_logits is not None:
            gates = 2.0 * torch.sigmoid(gate_logits)  # (B, N, A)
            hidden_states = (hidden_states.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


def install_processors(model: torch.nn.Module) -> None:
    """Put a ``WindowAttnProcessor`` on every block's self-attention (stateless; shared by all sessions)."""
    for block in model.transformer_blocks:
        block.attn1.set_processor(WindowAttnProcessor())


def processor_names(model: torch.nn.Module) -> list[str]:
    return [type(block.attn1.processor).__name__ for block in model.transformer_blocks]


def check_processors(model: torch.nn.Module, mode: WindowMode) -> None:
    """Fail before any compute if a layer's self-attention would ignore the window."""
    for index, block in enumerate(model.transformer_blocks):
        processor = block.attn1.processor
        if not isinstance(processor, WindowAttnProcessor):
            raise CaptureError(
                f"layer {index}: attn1 uses {type(processor).__name__}, which ignores the window for mode "
                f"{mode!r} (its K/V would never be captured or its prefix never attended). Cause: a custom "
                f"attention processor that ignores the capture flag. Fix: {_FIX}."
            )
