"""The command line's client side, on ``wm_refiner_client``: ``stream`` (a clip through a running server, resuming
by itself) and ``sessions`` (list, delete). Progress goes to stderr and only to a terminal; results and the summary
go to stdout. No torch here: a client machine needs none."""

from __future__ import annotations

import argparse
import json
import sys
import time
from fractions import Fraction
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
    stream.add_argument("--video", help="also write the decoded video (row 0) to this .mp4 (the server needs a vae)")
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
        if config.setdefault("video_format", "uint8") != "uint8":
            raise ValueError(f"--video encodes uint8 frames; leave --video-format unset or uint8 (got "
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
        video = VideoFile(Path(args.video), float(session.config.get("fps", 16.0))) if args.video else None
        units = []
        try:
            for unit in stream:
                units.append(unit)
                if video is not None and unit.video is not None:
                    video.write(unit.video[0])  # (F, H_px, W_px, 3), row 0
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


class VideoFile:
    """uint8 RGB frames (F, H, W, 3) into an H.264 .mp4 (PyAV), as they come."""

    def __init__(self, path: Path, fps: float):
        try:
            import av
        except ImportError:
            raise RuntimeError("--video needs PyAV: pip install 'wm-refiner[video]' (or pip install av)") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        self.av = av
        self.container = av.open(str(path), mode="w")
        self.rate = Fraction(fps).limit_denominator(1000)
        self.stream = None
        self.frames = 0

    def write(self, frames: np.ndarray) -> None:
        for frame in frames:
            # yuv420p needs even sides: repeat the last row/column of an odd-sized frame.
            height, width = frame.shape[0] + frame.shape[0] % 2, frame.shape[1] + frame.shape[1] % 2
            if (height, width) != frame.shape[:2]:
                frame = np.pad(frame, ((0, height - frame.shape[0]), (0, width - frame.shape[1]), (0, 0)), mode="edge")
            if self.stream is None:
                self.stream = self.container.add_stream("libx264", rate=self.rate)
                self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, "yuv420p"
                self.stream.options = {"crf": "18"}  # x264's "visually lossless" end of the scale
            picture = self.av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            self.container.mux(self.stream.encode(picture))
            self.frames += 1

    def close(self) -> None:
        if self.stream is not None:
            self.container.mux(self.stream.encode())
        self.container.close()


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
