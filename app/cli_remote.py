"""The command line's client side, on ``wm_refiner_client``: ``stream`` (a clip through a running server, resuming
by itself) and ``sessions`` (list, delete). Progress goes to stderr and only to a terminal; results and the summary
go to stdout. No torch here: a client machine needs none."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from wm_refiner_client import spec


def add_session_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] = spec.NAMES, *,
                      defaults: bool = False) -> None:
    """A flag per session field (``--sink-frames``, ``--outputs latents,video``, ...), read as a query parameter
    is. ``defaults``: the flag defaults to the spec's value (a local run); else it is unset and the server's default
    applies."""
    for name in names:
        field = spec.BY_NAME[name]
        shown = field.to_text(field.default)
        default = shown if defaults else f"the server's; {shown} out of the box"
        parser.add_argument(
            field.flag, dest=name, type=_flag_reader(field), metavar=field.name.upper(),
            choices=field.choices if field.kind == spec.CHOICE else None,
            default=field.default_json() if defaults else None,
            help=f"{field.doc} (default: {default})",
        )


def _flag_reader(field: spec.SessionField):
    def read(text: str):
        try:
            return field.from_text(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    read.__name__ = field.name  # argparse names the flag's type in its messages
    return read


def session_flags(args: argparse.Namespace, names: tuple[str, ...] = spec.NAMES) -> dict[str, Any]:
    """The session fields the command line set."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", help="the server's URL (default: $WM_REFINER_URL, else http://127.0.0.1:8000)")
    parser.add_argument("--api-key", help="bearer key (default: $WM_REFINER_API_KEY)")


def add_stream_parser(commands) -> None:
    stream = commands.add_parser(
        "stream", help="stream a clip through a running server (WebSocket), resuming after drops and restarts"
    )
    add_client_options(stream)
    stream.add_argument("--input", required=True, help="safetensors with latents, prompt_embeds[, prompt_attention_mask]")
    stream.add_argument("--output", required=True, help="safetensors to write the refined latents to (float32)")
    stream.add_argument("--chunk-frames", type=int, default=3, help="latent frames per message (default 3)")
    stream.add_argument("--video", help="also write the video (row 0) to this .mp4: the server's H.264 segments as "
                        "they come, no re-encoding (the server needs a vae; quality: --video-quality, the CRF)")
    stream.add_argument("--session-id", help="name the session (PUT): rerunning with the same id continues it")
    stream.add_argument("--rate", type=float, default=0.0,
                        help="send at most this many latent frames per second, as a live source would (0: at once)")
    add_session_flags(stream)


def add_sessions_parser(commands) -> None:
    sessions = commands.add_parser("sessions", help="list a server's sessions, or delete some")
    add_client_options(sessions)
    sessions.add_argument("--delete", nargs="+", metavar="ID", help="delete these sessions")
    sessions.add_argument("--json", action="store_true", help="print the listing as JSON")


# --- stream ---------------------------------------------------------------------------------------------------------
def stream_command(args: argparse.Namespace) -> int:
    from wm_refiner_client import Client, concat

    if args.chunk_frames < 1:
        raise ValueError(f"--chunk-frames must be >= 1, got {args.chunk_frames}")
    config = session_flags(args)
    if "latents" not in config.get("outputs", ["latents"]):
        raise ValueError(f"--output writes the refined latents, but --outputs {','.join(config['outputs'])} asks for "
                         "none; add latents to --outputs or leave it unset")
    if args.video:
        if "video" not in config.setdefault("outputs", ["latents", "video"]):
            raise ValueError(f"--video writes the session's video, but --outputs {','.join(config['outputs'])} asks "
                             "for none; add video to --outputs or leave it unset")
        # The server encodes (once, for this stream and every watcher) and the file takes its segments as they are.
        if config.setdefault("video_format", "h264") != "h264":
            raise ValueError(f"--video writes the server's H.264 segments; leave --video-format unset or h264 (got "
                             f"{config['video_format']})")
    latents, prompt, mask = read_clip(Path(args.input))
    total = int(latents.shape[2])
    with Client(args.server, args.api_key) as client:
        session = client.session(args.session_id, **config) if args.session_id else client.create_session(**config)
        already = session.frames_returned
        if already:
            raise ValueError(f"session {session.id} has already returned {already} frames; use a new --session-id")
        stream = session.stream(paced(latents, args.chunk_frames, args.rate), prompt=prompt, prompt_mask=mask)
        progress = Progress(total, stream.stats)
        video = SegmentFile(Path(args.video), float(session.config.get("fps", 16.0))) if args.video else None
        units = []
        try:
            for unit in stream:
                units.append(unit)
                if video is not None:
                    video.write(unit)
                progress.update()
        finally:
            progress.close()
            if video is not None:
                video.close()
    refined = concat(units).astype(np.float32)  # (B, C, T, H, W)
    write_latents(Path(args.output), refined)
    stats = stream.stats
    print(f"refined {refined.shape[2]} frames in {stats.units} units -> {args.output} (session {session.id}, "
          f"{stats.reconnects} reconnects)" + (f"; {video.frames} video frames -> {args.video}" if video else ""))
    return 0


def read_clip(path: Path) -> tuple[Any, Any, Any]:
    """latents, prompt_embeds, prompt_attention_mask (or None) of a clip file, as numpy arrays (torch tensors for
    bfloat16, which numpy lacks)."""
    from safetensors import SafetensorError

    if not path.is_file():
        raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    try:
        from safetensors.numpy import load_file

        tensors = load_file(str(path))
    except (TypeError, ValueError):  # bfloat16
        from safetensors.torch import load_file as load_torch

        tensors = load_torch(str(path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a safetensors file ({exc}); write it with safetensors' save_file") from None
    for name in ("latents", "prompt_embeds"):
        if name not in tensors:
            raise ValueError(f"{path} has no {name!r} tensor (found {sorted(tensors)})")
    return tensors["latents"], tensors["prompt_embeds"], tensors.get("prompt_attention_mask")


def paced(latents, chunk_frames: int, rate: float):
    """The clip in messages of ``chunk_frames``, no faster than ``rate`` latent frames per second (0: at once)."""
    start = time.monotonic()
    for first in range(0, int(latents.shape[2]), chunk_frames):
        if rate > 0:
            delay = start + first / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        yield latents[:, :, first : first + chunk_frames]  # (B, C, n, H, W)


def write_latents(path: Path, latents: np.ndarray) -> None:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"latents": np.ascontiguousarray(latents)}, str(path))


class Progress:
    """One line on stderr while a terminal watches: frames refined of the clip, frames sent, blocks per second, the
    last block's latency, reconnects. Quiet when stderr is not a terminal (tqdm's ``disable=None``)."""

    def __init__(self, total: int, stats):
        from tqdm import tqdm

        self.stats = stats
        self.started = time.monotonic()
        self.bar = tqdm(total=total, unit="frame", desc="refined", file=sys.stderr, disable=None, dynamic_ncols=True)

    def update(self) -> None:
        stats = self.stats
        self.bar.n = min(stats.frames_refined, self.bar.total)
        elapsed = max(time.monotonic() - self.started, 1e-9)
        latency = "-" if stats.last_latency_ms is None else f"{stats.last_latency_ms:.0f}ms"
        self.bar.set_postfix_str(
            f"sent={stats.frames_sent} blocks/s={stats.units / elapsed:.1f} latency={latency} "
            f"reconnects={stats.reconnects}"
        )

    def close(self) -> None:
        self.bar.close()


class SegmentFile:
    """A session's H.264 video (row 0) as a fragmented .mp4: the first unit's init segment, then every unit's media
    segment as it comes (api.md "Encoded video"). A unit the server could not encode (it came as uint8 with
    ``video_error``) or that repeats frames already written (a resumed stream) is encoded here, at the same
    settings, so the file stays one timeline."""

    def __init__(self, path: Path, fps: float):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("wb")
        self.fps = fps
        self.frames = 0
        self.quality: int | None = None

    def write(self, unit) -> None:
        encoded = unit.encoded_video
        if encoded is not None and encoded.format != "h264":
            raise ValueError(f"the server sent {encoded.format} video; --video writes h264")
        if encoded is not None:
            self.quality = encoded.quality
        if encoded is not None and encoded.skip == 0:
            if encoded.pieces[0]:
                self.file.write(encoded.segment(0, init=self.frames == 0))
                self.frames += unit.video_frames
            return
        frames = unit.decode_video().video if encoded is not None else unit.video
        if frames is None or not frames.shape[1]:
            return
        self._encode_here(np.asarray(frames[:1], dtype=np.uint8), int(unit.video_frame_end) - frames.shape[1])

    def _encode_here(self, frames: np.ndarray, start: int) -> None:
        try:
            from app.stages.encode import encode_h264
        except ImportError as exc:
            raise RuntimeError(f"a unit came without H.264 video and encoding it here needs PyAV ({exc}): "
                               "pip install 'wm-refiner[video]'") from None
        from wm_refiner_client import EncodedVideo

        crf = self.quality if self.quality is not None else 23
        own = encode_h264(frames, crf, start, self.fps)
        video = EncodedVideo("h264", own.codec, crf, ((own.data,),), tuple(int(v) for v in own.init_sizes))
        self.file.write(video.segment(0, init=self.frames == 0))
        self.frames += frames.shape[1]

    def close(self) -> None:
        self.file.close()


# --- sessions -------------------------------------------------------------------------------------------------------
def sessions_command(args: argparse.Namespace) -> int:
    from wm_refiner_client import Client

    with Client(args.server, args.api_key) as client:
        if args.delete:
            for session_id in args.delete:
                client.delete_session(session_id)
                print(f"deleted {session_id}")
            return 0
        sessions = client.sessions()
    if args.json:
        print(json.dumps([session.raw for session in sessions], indent=2))
        return 0
    if not sessions:
        print("no sessions")
        return 0
    header = ("session", "created", "frames in", "frames out", "flushed", "streaming")
    rows = [(s.session_id, s.created_at, str(s.frames_received), str(s.frames_returned), "yes" if s.flushed else "no",
             "yes" if s.streaming else "no") for s in sessions]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0
