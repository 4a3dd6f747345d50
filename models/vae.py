"""Frames out: the LTX-2 video VAE's decoder, run as a stream, with its temporal state per session.

Shape letters: B batch, C channels, T latent frames, F pixel frames, H height, W width.

The decoder (diffusers' ``LTX2VideoDecoder3d``) is a stack of 3D convolutions whose time axis is padded by
repeating the first frame (and, unless the decoder is causal, the last), pointwise layers, residual adds, and
depth-to-space upsamplers that double the frame count (dropping the first new frame). Every temporal operator is
a short stencil, so the decoder can run frame by frame: each convolution keeps the last ``k - 1`` frames it was
fed, a residual branch waits for the (later) main branch, an upsampler maps each input frame to its output
frames. Pushing latent frames as they are refined yields every pixel frame whose inputs are all known, exactly
the frames (to rounding) that decoding the whole clip at once gives; ``finish`` pads the end as the whole-clip
decode does and yields the rest. A non-causal decoder looks ahead: a pixel frame waits for the latent frames its
receptive field reaches (``StreamingDecoder.lookahead``); a causal one does not.

The modules stay stateless and shared by every session: the state is a tree of ``_Node`` objects (one per
temporal operator) holding only tensors it replaces, never mutates, so any earlier ``DecodeState`` is a free
rollback point and the state can be saved to tensors and restored (``video_to_tensors`` / ``video_from_tensors``).

Bounded look-ahead (``lookahead=N``): a pixel frame is emitted once N latent frames past its own have been
pushed, computed as if the clip ended at the last one pushed (a finish run from the current state, which stays as it is); lower latency,
no longer equal to the whole-clip decode. ``bench/vae_lookahead.py`` measures the error for each N.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLLTX2Video

from .errors import ModelLoadError
from .loading import VAE_CLASS, pipeline_hint

# --- loading ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VaeInfo:
    """What clients need to know about the decoder (api.md, /v1/info)."""

    class_name: str
    latent_channels: int
    spatial_compression: int
    temporal_compression: int
    causal_decoder: bool
    lookahead_latent_frames: int  # latent frames a pixel frame waits for beyond its own, for an exact decode

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_vae(path: str | Path, device: torch.device, dtype: torch.dtype, latent_channels: int | None = None):
    """An ``AutoencoderKLLTX2Video`` from a local diffusers folder, on ``device`` in ``dtype``; never downloads.
    ``latent_channels``: the refiner's, which the VAE must match."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"VAE folder {str(folder)!r} has no config.json; pass a local folder in diffusers layout holding "
            "AutoencoderKLLTX2Video (`python -m app make-checkpoint --preset tiny-vae --out DIR` writes a test one)"
            + pipeline_hint(folder, (VAE_CLASS,))
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from None
    if config.get("_class_name") != VAE_CLASS:
        raise ModelLoadError(
            f"{config_path}: _class_name is {config.get('_class_name')!r}; the vae setting takes an "
            "AutoencoderKLLTX2Video folder (the LTX-2 video VAE SANA-WM decodes with)"
        )
    if latent_channels is not None and config.get("latent_channels", 128) != latent_channels:
        raise ModelLoadError(
            f"{config_path}: latent_channels={config.get('latent_channels')} but the refiner produces "
            f"{latent_channels}-channel latents; use the VAE the refiner was trained with"
        )
    try:
        # The dtype at load (diffusers keeps any module it marks float32 there; a cast by .to() afterwards warned,
        # naming none, on every start with a VAE).
        vae = AutoencoderKLLTX2Video.from_pretrained(str(folder), local_files_only=True, use_safetensors=True,
                                                     low_cpu_mem_usage=False, torch_dtype=dtype)
    except Exception as exc:
        raise ModelLoadError(f"{folder}: could not load the VAE weights: {exc}") from exc
    return vae.to(device=device).eval().requires_grad_(False)


# --- the streaming state ---------------------------------------------------------------------------------------


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    parts = [p for p in parts if p is not None and p.shape[2] > 0]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # along time


def _frames(x: torch.Tensor | None) -> int:
    return 0 if x is None else int(x.shape[2])


def _conv3d(conv: torch.nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)``, on a CPU always through oneDNN. PyTorch picks its native kernel for a float32 input with
    ``B * C * T * H <= 20480`` (``use_mkldnn`` in ATen's Convolution.cpp), which is 5-10x slower for the few frames
    a stream pushes at a time (measured: 3 ms vs 0.3-0.6 ms per frame for 8 channels at 64x64); the whole-clip
    decode, with its many frames, gets oneDNN anyway. Same arithmetic up to rounding."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and isinstance(conv.padding, tuple)):
        return conv(x)
    padding = conv.padding
    if conv.padding_mode != "zeros":  # as Conv3d does it: pad first, then convolve without padding
        x = torch.nn.functional.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
        padding = (0, 0, 0)
    return torch.mkldnn_convolution(x.contiguous(), conv.weight, conv.bias, padding, conv.stride, conv.dilation,
                                    conv.groups)


class _Node:
    """One temporal operator's state. ``push(x, final)`` takes new frames (B, C, n, H, W) or None and returns the
    output frames now final (or None); ``final`` says no frame will follow. Returns a new node: never mutates."""

    def push(self, x, final: bool):
        raise NotImplementedError

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {}

    def meta(self) -> Any:
        return None

    def load(self, tensors: dict[str, torch.Tensor], prefix: str, meta: Any) -> _Node:
        return self


class _Pointwise(_Node):
    def __init__(self, fn):
        self.fn = fn

    def push(self, x, final):
        return (self, None if x is None else self.fn(x))


class _Conv(_Node):
    """``LTX2VideoCausalConv3d``: its time padding done here, frame by frame."""

    def __init__(self, module, causal: bool, buffer=None, seen: int = 0, done: bool = False):
        self.module, self.causal = module, causal
        self.buffer, self.seen, self.done = buffer, seen, done
        k = module.kernel_size[0]
        self.left = k - 1 if causal else (k - 1) // 2
        self.right = 0 if causal else (k - 1) // 2
        self.k = k

    def _with(self, buffer, seen, done):
        return _Conv(self.module, self.causal, buffer, seen, done)

    def push(self, x, final):
        if self.done:
            if x is not None and x.shape[2]:
                raise RuntimeError("frames pushed after the stream was finished")
            return self, None
        parts = [self.buffer]
        if self.seen == 0 and x is not None and x.shape[2]:
            parts.append(x[:, :, :1].repeat(1, 1, self.left, 1, 1))  # the start, as the whole-clip decode pads it
        parts.append(x)
        seen = self.seen + _frames(x)
        if final and seen:
            last = x[:, :, -1:] if _frames(x) else self.buffer[:, :, -1:]
            parts.append(last.repeat(1, 1, self.right, 1, 1))  # the end
        window = _cat(parts)
        have = _frames(window)
        if have < self.k:
            return self._with(window, seen, final), None
        out = _conv3d(self.module.conv, window)  # (B, C', have - k + 1, H, W)
        keep = None if final else window[:, :, have - (self.k - 1) :]
        return self._with(keep, seen, final), out

    def tensors(self, prefix):
        return {} if self.buffer is None else {prefix: self.buffer}

    def meta(self):
        return [self.seen, self.done]

    def load(self, tensors, prefix, meta):
        return self._with(tensors.get(prefix), int(meta[0]), bool(meta[1]))


class _Seq(_Node):
    def __init__(self, nodes: list[_Node]):
        self.nodes = nodes

    def push(self, x, final):
        nodes = []
        for node in self.nodes:
            node, x = node.push(x, final)
            nodes.append(node)
        return _Seq(nodes), x

    def tensors(self, prefix):
        out = {}
        for i, node in enumerate(self.nodes):
            out.update(node.tensors(f"{prefix}.{i}"))
        return out

    def meta(self):
        return [node.meta() for node in self.nodes]

    def load(self, tensors, prefix, meta):
        return _Seq([node.load(tensors, f"{prefix}.{i}", m) for i, (node, m) in enumerate(zip(self.nodes, meta))])


class _Residual(_Node):
    """``main(x) + shortcut(x)``, frame by frame: the shortcut's frames wait for the main branch's (later) ones."""

    def __init__(self, main: _Node, shortcut, waiting=None):
        self.main, self.shortcut, self.waiting = main, shortcut, waiting

    def push(self, x, final):
        waiting = _cat([self.waiting, None if x is None else self.shortcut(x)])
        main, out = self.main.push(x, final)
        n = _frames(out)
        if n == 0:
            return _Residual(main, self.shortcut, waiting), None
        out = out + waiting[:, :, :n]
        rest = waiting[:, :, n:] if _frames(waiting) > n else None
        return _Residual(main, self.shortcut, rest), out

    def tensors(self, prefix):
        out = self.main.tensors(f"{prefix}.main")
        if self.waiting is not None:
            out[f"{prefix}.waiting"] = self.waiting
        return out

    def meta(self):
        return self.main.meta()

    def load(self, tensors, prefix, meta):
        return _Residual(self.main.load(tensors, f"{prefix}.main", meta), self.shortcut, tensors.get(f"{prefix}.waiting"))


class _Upsample(_Node):
    """``LTX2VideoUpsampler3d``: each input frame becomes ``stride_t`` output frames (depth to space); the first
    ``stride_t - 1`` output frames of the stream are dropped, as the whole-clip decode drops them."""

    def __init__(self, module, conv: _Conv, waiting=None, emitted: int = 0):
        self.module, self.conv = module, conv
        self.waiting, self.emitted = waiting, emitted  # waiting: residual input frames not matched yet

    def _space(self, x):
        b, _, t, h, w = x.shape
        s = self.module.stride
        x = x.reshape(b, -1, s[0], s[1], s[2], t, h, w)
        return x.permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)  # (B, C', s0*t, ...)

    def push(self, x, final):
        module = self.module
        waiting = _cat([self.waiting, x]) if module.residual else None
        conv, out = self.conv.push(x, final)
        n = _frames(out)
        if n == 0:
            return _Upsample(module, conv, waiting, self.emitted), None
        hidden = self._space(out)
        if module.residual:
            repeats = (module.stride[0] * module.stride[1] * module.stride[2]) // module.upscale_factor
            hidden = hidden + self._space(waiting[:, :, :n]).repeat(1, repeats, 1, 1, 1)
            waiting = waiting[:, :, n:] if _frames(waiting) > n else None
        drop = max(module.stride[0] - 1 - self.emitted, 0)
        hidden = hidden[:, :, drop:]
        return _Upsample(module, conv, waiting, self.emitted + drop + _frames(hidden)), hidden

    def tensors(self, prefix):
        out = self.conv.tensors(f"{prefix}.conv")
        if self.waiting is not None:
            out[f"{prefix}.waiting"] = self.waiting
        return out

    def meta(self):
        return [self.conv.meta(), self.emitted]

    def load(self, tensors, prefix, meta):
        return _Upsample(self.module, self.conv.load(tensors, f"{prefix}.conv", meta[0]),
                         tensors.get(f"{prefix}.waiting"), int(meta[1]))


def _resnet(block, causal: bool) -> _Node:
    act = block.nonlinearity
    main = _Seq([
        _Pointwise(lambda x: act(block.norm1(x))),
        _Conv(block.conv1, causal),
        _Pointwise(lambda x: act(block.norm2(x))),
        _Conv(block.conv2, causal),
    ])

    def shortcut(x):
        if block.norm3 is not None:
            x = block.norm3(x.movedim(1, -1)).movedim(-1, 1)
        if block.conv_shortcut is not None:
            x = block.conv_shortcut(x)
        return x

    return _Residual(main, shortcut)


def _graph(decoder, causal: bool) -> _Node:
    """The decoder's forward as a tree of stream nodes, op for op (``LTX2VideoDecoder3d.forward``)."""
    nodes: list[_Node] = [_Conv(decoder.conv_in, causal)]
    nodes += [_resnet(block, causal) for block in decoder.mid_block.resnets]
    for up in decoder.up_blocks:
        if up.conv_in is not None:
            nodes.append(_resnet(up.conv_in, causal))
        for upsampler in up.upsamplers or ():
            nodes.append(_Upsample(upsampler, _Conv(upsampler.conv, causal)))
        nodes += [_resnet(block, causal) for block in up.resnets]
    nodes.append(_Pointwise(lambda x: decoder.conv_act(decoder.norm_out(x))))
    nodes.append(_Conv(decoder.conv_out, causal))
    p = decoder.patch_size

    def unpatchify(x):
        b, _, t, h, w = x.shape
        x = x.reshape(b, -1, 1, p, p, t, h, w)
        return x.permute(0, 1, 5, 2, 6, 4, 7, 3).flatten(6, 7).flatten(4, 5).flatten(2, 3)  # (B, 3, t, H*p, W*p)

    nodes.append(_Pointwise(unpatchify))
    return _Seq(nodes)


@dataclass(frozen=True)
class DecodeState:
    """One stream's decoder state: immutable; ``push`` returns a new one."""

    graph: _Node
    latents_in: int = 0  # latent frames pushed
    frames_out: int = 0  # pixel frames emitted (before any drop)
    finished: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.graph.tensors("g").values())


class StreamingDecoder:
    """The shared, stateless part: the VAE and how to run its decoder as a stream."""

    def __init__(self, vae):
        decoder = vae.decoder
        if decoder.patch_size_t != 1:
            raise ModelLoadError(f"VAE decoder patch_size_t={decoder.patch_size_t}; LTX-2 VAEs use 1")
        if decoder.time_embedder is not None:
            raise ModelLoadError(
                "VAE decoder has timestep_conditioning=true; the refiner's reference decodes without a timestep, so "
                "use a decoder with timestep_conditioning=false"
            )
        for module in decoder.modules():
            if getattr(module, "per_channel_scale1", None) is not None:
                raise ModelLoadError("VAE decoder injects noise (decoder_inject_noise); use one that does not")
        self.vae = vae
        self.causal = bool(decoder.is_causal)
        self.temporal_compression = 2 ** sum(
            1 for up in decoder.up_blocks for u in (up.upsamplers or ()) if u.stride[0] == 2
        )
        self.lookahead = self._measure_lookahead()
        height = self._probe_height()
        self.spatial_compression = height // 2
        self.info = VaeInfo(
            class_name=type(vae).__name__,
            latent_channels=int(vae.config.latent_channels),
            spatial_compression=self.spatial_compression,
            temporal_compression=self.temporal_compression,
            causal_decoder=self.causal,
            lookahead_latent_frames=self.lookahead,
        )

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    def new_state(self) -> DecodeState:
        return DecodeState(_graph(self.vae.decoder, self.causal))

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Refined latents -> what the decoder takes, as the reference pipeline maps them."""
        vae = self.vae
        latents = latents.to(device=self.device, dtype=self.dtype)
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents)
        return latents / vae.config.scaling_factor * std + mean

    def push(self, state: DecodeState, latents: torch.Tensor | None, final: bool = False):
        """(new state, pixel frames now final (B, 3, f, H, W) in [-1, 1], or None)."""
        if state.finished:
            raise RuntimeError("the decode stream was already finished")
        x = None if latents is None or latents.shape[2] == 0 else self.denormalize(latents)
        with torch.no_grad():
            graph, out = state.graph.push(x, final)
        new = DecodeState(graph, state.latents_in + _frames(x), state.frames_out + _frames(out), final)
        return new, out

    def pixel_frames(self, latent_frames: int) -> int:
        """Pixel frames a clip of ``latent_frames`` decodes to."""
        return 0 if latent_frames == 0 else self.temporal_compression * (latent_frames - 1) + 1

    def _measure_lookahead(self) -> int:
        """Push a 2x2 latent one frame at a time: the most latent frames any pixel frame waited for, once the
        stream is past its start (the look-ahead is bounded by the depth: 64 frames cover any LTX-2 decoder)."""
        generator = torch.Generator().manual_seed(0)
        channels = int(self.vae.config.latent_channels)
        state, waits = self.new_state(), []
        for index in range(64):
            latent = torch.randn(1, channels, 1, 2, 2, generator=generator)
            state, _ = self.push(state, latent)
            covered = self._latents_covered(state.frames_out)
            waits.append(index + 1 - covered)
            if covered and len(waits) > 2 * waits[-1] + 4 and len(set(waits[-4:])) == 1:
                break  # steady: every new latent frame completes one
        if not self._latents_covered(state.frames_out):
            raise ModelLoadError("the VAE decoder emitted no frame for 64 latent frames; it cannot stream")
        return max(waits)

    def _latents_covered(self, pixel_frames: int) -> int:
        """Latent frames whose every pixel frame has been emitted."""
        if pixel_frames == 0:
            return 0
        return 1 + (pixel_frames - 1) // self.temporal_compression

    def _probe_height(self) -> int:
        channels = int(self.vae.config.latent_channels)
        state, out = self.push(self.new_state(), torch.zeros(1, channels, 1, 2, 2), final=True)
        return int(out.shape[3])


# --- a session's video -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoChunk:
    """Pixel frames of a session's video: ``frames`` (B, 3, n, H, W) in [-1, 1], video frames [start, start + n)."""

    frames: torch.Tensor | None
    start: int

    @property
    def count(self) -> int:
        return _frames(self.frames)

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class VideoStream:
    """One session's video: the decoder's state and what was emitted. Immutable; ``push`` returns a new one.

    Video frame 0 is the first pixel frame after the ``drop`` dropped ones (the reference drops ``sink_frames``
    pixel frames). ``lookahead``: None for the exact decode, else N (see the module docstring)."""

    state: DecodeState
    drop: int
    lookahead: int | None
    emitted: int = 0  # pixel frames emitted (dropped ones included)
    ready: torch.Tensor | None = None  # exact pixel frames computed, not yet due (bounded look-ahead only)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + (0 if self.ready is None else self.ready.nbytes)


def new_video(decoder: StreamingDecoder, drop: int, lookahead: int | None = None) -> VideoStream:
    if lookahead is not None and lookahead < 0:
        raise ValueError(f"video look-ahead must be >= 0 latent frames, got {lookahead}")
    return VideoStream(decoder.new_state(), drop, lookahead)


def push_video(decoder: StreamingDecoder, video: VideoStream, latents: torch.Tensor | None,
               final: bool = False) -> tuple[VideoStream, VideoChunk]:
    """Feed the next refined latent frames (B, C, t, H, W); returns the new stream and the video frames now due."""
    before = video.state.frames_out
    state, exact = decoder.push(video.state, latents, final=final)
    available = _cat([video.ready, exact])  # pixel frames [emitted, state.frames_out) when nothing is speculative
    first = video.emitted if video.ready is not None else before
    if final or video.lookahead is None:
        target = state.frames_out
    else:
        covered = max(state.latents_in - video.lookahead, 0)  # latent frames whose frames are due now
        target = decoder.pixel_frames(covered)
    if target > state.frames_out:  # due before the exact decode has them: finish a copy, as if the clip ended here
        _, tail = decoder.push(state, None, final=True)
        available = _cat([available, tail])
    # ``available`` starts at pixel ``first``; frames before ``video.emitted`` were already sent (speculatively).
    skip = video.emitted - first
    due = max(target - video.emitted, 0)
    out = None if available is None else available[:, :, skip : skip + due]
    exact_end = state.frames_out
    leftover = None
    if available is not None and video.emitted + due < exact_end:
        leftover = available[:, :, skip + due : skip + due + (exact_end - video.emitted - due)]
    emitted = video.emitted + _frames(out)
    new = VideoStream(state, video.drop, video.lookahead, emitted, leftover if _frames(leftover) else None)
    # The first ``drop`` pixel frames are not part of the video.
    start = video.emitted - video.drop
    if out is not None and start < 0:
        out = out[:, :, -start:] if _frames(out) > -start else None
        start = 0
    return new, VideoChunk(out, max(start, 0))


def video_tensor(frames: torch.Tensor | None, fmt: str, batch: int, height: int, width: int) -> torch.Tensor:
    """Decoded frames (B, 3, n, H, W) in [-1, 1] as the wire formats: ``float32`` (B, n, 3, H, W) in [0, 1], as
    diffusers' video post-processing gives them, or ``uint8`` (B, n, H, W, 3) RGB."""
    if frames is None:
        shape = (batch, 0, 3, height, width) if fmt == "float32" else (batch, 0, height, width, 3)
        return torch.zeros(shape, dtype=torch.float32 if fmt == "float32" else torch.uint8)
    unit = (frames.float() * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)  # (B, n, 3, H, W)
    if fmt == "float32":
        return unit
    return (unit * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2)  # (B, n, H, W, 3)


def video_to_tensors(video: VideoStream, prefix: str = "video") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON-able fields) that ``video_from_tensors`` rebuilds the stream from (a snapshot)."""
    state = video.state
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.graph.tensors(prefix).items()}
    if video.ready is not None:
        tensors[f"{prefix}.ready"] = video.ready.detach().to("cpu").contiguous()
    fields = {
        "graph": state.graph.meta(),
        "latents_in": state.latents_in,
        "frames_out": state.frames_out,
        "finished": state.finished,
        "drop": video.drop,
        "lookahead": video.lookahead,
        "emitted": video.emitted,
    }
    return tensors, fields


def video_from_tensors(decoder: StreamingDecoder, tensors: dict[str, torch.Tensor], fields: dict[str, Any],
                       prefix: str = "video") -> VideoStream:
    device = decoder.device
    on_device = {name: t.to(device=device, dtype=decoder.dtype) for name, t in tensors.items() if name.startswith(prefix)}
    graph = decoder.new_state().graph.load(on_device, prefix, fields["graph"])
    state = DecodeState(graph, int(fields["latents_in"]), int(fields["frames_out"]), bool(fields["finished"]))
    lookahead = fields["lookahead"]
    return VideoStream(state, int(fields["drop"]), None if lookahead is None else int(lookahead),
                       int(fields["emitted"]), on_device.get(f"{prefix}.ready"))
