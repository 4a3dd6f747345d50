"""The command line's client side, on ``wm_refiner_client``: ``stream`` (a clip through a running server, resuming
by itself) and ``sessions`` (list, delete). Progress goes to stderr and only to a terminal; results and the summary
go to stdout. No torch here: a client machine needs none."""

from __future__ import annotations

import argparse
import json
import logging
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


# Retry waits at least this long are said on stderr; shorter ones (a first try's backoff) would only be noise.
SHOWN_WAIT_S = 1.0


def show_retries() -> None:
    """The client's long retry waits as lines on stderr (``POST /v1/sessions: 503 too_many_sessions ...``): a full
    server or a lost connection makes a command wait, minutes at most (docs/client.md), and the wait is said
    rather than silent: a retry's or a reconnection's line (``wait_s`` on the record) of a second or more, and any
    warning or error."""
    logger = logging.getLogger("wm_refiner_client")
    if any(getattr(handler, "wm_refiner_cli", False) for handler in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    # Its warnings and errors too (those of its WebSocket library included): with a handler of its own, the client's
    # logger no longer falls back to Python's last-resort one, which printed them.
    handler.addFilter(lambda record: record.levelno >= logging.WARNING or (
        record.name == logger.name and getattr(record, "wait_s", 0.0) >= SHOWN_WAIT_S))
    handler.wm_refiner_cli = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _server_url(text: str) -> str:
    """--server, checked as the client checks it: a typo is refused before anything is sent, with the fix."""
    from wm_refiner_client._common import check_url

    try:
        return check_url(text, "--server")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    parser.add_argument("--server", type=_server_url,
                        help="the server's URL, http://HOST:PORT (default: $WM_REFINER_URL, else http://127.0.0.1:8000)")
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
    stream.add_argument("--session-id", help="name the session (PUT): rerunning with the same id and --input continues it "
                        "(after Ctrl-C, a crash, a lost connection), keeping the frames --output already holds")
    stream.add_argument("--rate", type=float, default=0.0,
                        help="send at most this many latent frames per second, as a live source would (0: at once)")
    add_session_flags(stream)


def add_sessions_parser(commands) -> None:
    sessions = commands.add_parser("sessions", help="list a server's sessions, or delete some")
    add_client_options(sessions)
    sessions.add_argument("--delete", nargs="+", metavar="ID", help="delete these sessions")
    sessions.add_argument("--json", action="store_true", help="print the listing as JSON")


# --- stream ---------------------------------------------------------------------------------------------------------
# The output file says whose frames it holds, so that a rerun can tell its own partial output from another file.
OUTPUT_SESSION, OUTPUT_INPUT, OUTPUT_COMPLETE = "wm_refiner.session_id", "wm_refiner.input_sha256", "wm_refiner.complete"
OUTPUT_CONFIG = "wm_refiner.config"  # the session's config (JSON), for a rerun to compare its flags with
INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)


def stream_command(args: argparse.Namespace) -> int:
    """One clip through a running server. Rerun with the same ``--session-id`` (after Ctrl-C, a crash, a lost
    network), it continues: the input frames the session has are not sent again, the output file's frames are kept
    and the server's units from there on are added (replayed from its retained units when the interrupted run
    never got them), and the file is rewritten whole, so it ends as one uninterrupted run's (docs/client.md)."""
    from wm_refiner_client import Client, ResumeUnavailableError
    from wm_refiner_client.client import Session

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
    if args.video:
        require_video_libraries()
    latents, prompt, mask = read_clip(Path(args.input))
    total = int(latents.shape[2])
    digest = clip_digest(latents, prompt, mask)
    output = Path(args.output)
    if args.session_id and finished_before(output, args.session_id, digest, total, config, args.video):
        # Said from the file alone: the server may have released the session long ago (410 session_evicted).
        print(f"session {args.session_id} is complete: {args.output} already holds its {total} refined frames")
        return 0
    with Client(args.server, args.api_key) as client:
        # PUT: a session of that id with another config is refused, naming the fields that differ.
        session = client.session(args.session_id, **config) if args.session_id else client.create_session(**config)
        state = session.state()
        kept = continue_from(output, session.id, digest, state, latents, args)
        if kept.shape[2] == total and state.flushed:
            print(f"session {session.id} is complete: {args.output} already holds its {total} refined frames")
            return 0
        grace = client.info().get("limits", {}).get("ws_reattach_grace_s")
        handle = Session(client, session.id, session.config, frames_returned=int(kept.shape[2]))
        stream = handle.stream(paced(latents, args.chunk_frames, args.rate, skip=state.frames_received),
                               prompt=prompt, prompt_mask=mask, from_session_start=True)
        progress = Progress(total, stream.stats)
        video = SegmentFile(Path(args.video), float(session.config.get("fps", 16.0))) if args.video else None
        units = []
        interrupted = False
        again = "the same command" if args.session_id else f"this command with --session-id {session.id}"
        within = f" within {grace:g} s (the server's ws_reattach_grace_s)" if isinstance(grace, (int, float)) else ""

        def write(complete: bool) -> np.ndarray:
            refined = np.concatenate([kept, *(unit.latents.astype(np.float32) for unit in units)], axis=2)
            write_latents(output, refined, {OUTPUT_SESSION: session.id, OUTPUT_INPUT: digest,
                                            OUTPUT_COMPLETE: "true" if complete else "false",
                                            OUTPUT_CONFIG: json.dumps(session.config, sort_keys=True)})
            return refined  # (B, C, T, H, W)

        try:
            for unit in stream:
                units.append(unit)
                if video is not None:
                    video.write(unit)
                progress.update()
        except KeyboardInterrupt:
            interrupted = True
        except ResumeUnavailableError as exc:
            raise ResumeUnavailableError(
                f"{args.output} lacks refined frames from {kept.shape[2]} on that session {session.id} returned to an "
                f"earlier run and no longer keeps ({exc.message}); put that run's output back, or start over with a "
                "new --session-id", status=exc.status) from None
        except Exception as exc:
            if units:  # what came back is kept for a rerun (the error itself is app.cli.commands's line)
                refined = write(complete=False)
                print(f"wrote refined frames [0, {refined.shape[2]}) of {total} to {args.output}; once the cause "
                      f"below is fixed, run {again}{within} to continue session {session.id}", file=sys.stderr)
            elif not args.session_id:
                let_go_if_empty(client, session, exc)
            raise
        finally:
            stream.close()
            progress.close()
            if video is not None:
                video.close()
    refined = write(complete=not interrupted)
    if interrupted:
        print(f"interrupted: wrote refined frames [0, {refined.shape[2]}) of {total} to {args.output}; run {again}"
              f"{within} to continue session {session.id}", file=sys.stderr)
        return INTERRUPTED
    stats = stream.stats
    print(f"refined {refined.shape[2]} frames in {stats.units} units -> {args.output} (session {session.id}, "
          f"{stats.reconnects} reconnects)" + (f"; {video.frames} video frames -> {args.video}" if video else ""))
    return 0


def let_go_if_empty(client, session, error: Exception) -> None:
    """Delete the session this run created when the server refused its input before taking a frame (a 4xx: the
    frames' dtype, size, ...): nothing in it is worth a rerun, and it would hold one of the server's max_sessions
    places until it expired. Only after an answer from the server (one that cannot be reached is not asked again),
    and quietly: the refusal is what the user is told."""
    from wm_refiner_client import APIError

    if not isinstance(error, APIError) or not 400 <= (error.status or 0) < 500:
        return
    try:
        if session.state().frames_received == 0:
            client.delete_session(session.id)
    except Exception:  # noqa: BLE001 -- the server's own idle expiry ends it then
        pass


def require_video_libraries() -> None:
    """--video needs PyAV on this machine (a unit the server sent as raw frames, or one a resume repeats in part, is
    encoded here; the last units usually are): checked before anything is sent, so a base install is told the fix
    at once rather than after streaming most of the clip."""
    try:
        import av  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"--video needs PyAV, which does not import here ({exc}); install it with "
                           "pip install -e '.[video]' (from the checkout), or leave --video out") from None


def finished_before(output: Path, session_id: str, digest: str, total: int, flags: dict[str, Any],
                    video: str | None) -> bool:
    """Whether ``output`` is a complete run of this clip in this session, with these session flags: then a rerun has
    nothing to do, and says so without asking the server (which forgets a finished session after its retention,
    and would answer 410). Anything else (another session or clip, a flag the file's config does not have, a file
    without its config, a --video file that is gone) goes to the server as before."""
    previous = read_output(output)
    if previous is None:
        return False
    refined, metadata = previous
    if (metadata.get(OUTPUT_SESSION), metadata.get(OUTPUT_INPUT), metadata.get(OUTPUT_COMPLETE)) != (
            session_id, digest, "true") or refined.shape[2] != total:
        return False
    try:
        config = json.loads(metadata[OUTPUT_CONFIG])
    except (KeyError, ValueError):
        return False
    # The flags as JSON values (a tuple of sigmas is the config's list).
    if any(json.loads(json.dumps(value)) != config.get(name) for name, value in flags.items()):
        return False
    return video is None or Path(video).is_file()


def clip_digest(latents, prompt, mask) -> str:
    """sha256 of a clip's tensors (dtypes, shapes and bytes): a rerun continues only the same clip."""
    import hashlib

    digest = hashlib.sha256()
    for tensor in (latents, prompt, mask):
        if tensor is None:
            digest.update(b"none;")
            continue
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)};".encode())
        if isinstance(tensor, np.ndarray):
            digest.update(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data)
        else:  # a torch tensor (bfloat16, which numpy lacks)
            import torch

            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def continue_from(output: Path, session_id: str, digest: str, state, latents, args) -> np.ndarray:
    """The refined frames (B, C, K, H, W) a rerun keeps: those ``output`` holds when an earlier run of this clip in
    this session wrote it (else none, and the server sends them again). ValueError when the session cannot be
    this clip's, or ``output`` is this session's from another clip."""
    batch, channels, total, height, width = (int(n) for n in latents.shape)
    none = np.zeros((batch, channels, 0, height, width), np.float32)
    received = state.frames_received
    if received > total:
        raise ValueError(f"session {session_id} has {received} input frames, more than the {total} of {args.input}: "
                         "it was streamed from another clip; pass that clip, or a new --session-id")
    if state.flushed and received != total:
        raise ValueError(f"session {session_id} was flushed after {received} input frames, but {args.input} has "
                         f"{total}: it was streamed from another clip; pass that clip, or a new --session-id")
    if not received:
        return none
    if args.video:
        raise ValueError(f"session {session_id} already has {received} input frames, but --video writes a clip's "
                         "whole video in one run; continue without --video (the latents), or start over with a new "
                         "--session-id")
    previous = read_output(output)
    if previous is None or previous[1].get(OUTPUT_SESSION) != session_id:
        return none
    refined, metadata = previous
    if metadata.get(OUTPUT_INPUT) != digest:
        raise ValueError(f"{output} holds session {session_id}'s frames of another input than {args.input}; pass "
                         "the same --input to continue it, or a new --session-id")
    if refined.shape[:2] != (batch, channels) or refined.shape[3:] != (height, width) or refined.shape[2] > total:
        return none  # not a partial output of this clip after all: the server sends every frame again
    return refined.astype(np.float32, copy=False)


def read_output(path: Path) -> tuple[np.ndarray, dict[str, str]] | None:
    """The latents and metadata of an earlier run's output, or None when there is no such file (or it is not one)."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="np") as file:
            metadata = file.metadata() or {}
            if OUTPUT_SESSION not in metadata or "latents" not in file.keys():
                return None
            return file.get_tensor("latents"), metadata
    except Exception:  # unreadable or not safetensors: not ours, and --output overwrites it as a first run does
        return None


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
    check_clip(path, tensors)
    return tensors["latents"], tensors["prompt_embeds"], tensors.get("prompt_attention_mask")


# The tensors a clip file holds, with the axes each must have (as a chunk's payload: docs/api.md).
CLIP_TENSORS = {"latents": "(B, C, T, H, W)", "prompt_embeds": "(B, L, caption_channels)",
                "prompt_attention_mask": "(B, L)"}


def check_clip(path: Path, tensors: dict[str, Any]) -> None:
    """ValueError, before anything is sent or loaded, when a clip file is not what ``refine`` and ``stream`` read:
    a tensor missing, one of another rank, or a name neither reads (a misspelt prompt_attention_mask would
    otherwise be left out without a word, as the server refuses it: docs/api.md)."""
    unknown = sorted(set(tensors) - set(CLIP_TENSORS))
    if unknown:
        raise ValueError(f"{path} holds tensor(s) {unknown} that this command does not read; a clip file holds only "
                         f"{list(CLIP_TENSORS)}: rename or remove them")
    for name in ("latents", "prompt_embeds"):
        if name not in tensors:
            raise ValueError(f"{path} has no {name!r} tensor (found {sorted(tensors)}); a clip file holds latents "
                             f"{CLIP_TENSORS['latents']} and prompt_embeds {CLIP_TENSORS['prompt_embeds']}")
    for name, tensor in tensors.items():
        axes = CLIP_TENSORS[name]
        if len(tensor.shape) != axes.count(",") + 1:
            raise ValueError(f"{name} in {path} must have rank {axes.count(',') + 1} {axes}, got shape "
                             f"{tuple(tensor.shape)}; add the batch/time axes as needed")


def paced(latents, chunk_frames: int, rate: float, skip: int = 0):
    """The clip in messages of ``chunk_frames``, no faster than ``rate`` latent frames per second (0: at once);
    the first ``skip`` frames (the session has them: the stream skips them) without waiting."""
    start = time.monotonic()
    for first in range(0, int(latents.shape[2]), chunk_frames):
        if rate > 0 and first >= skip:
            delay = start + (first - skip) / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        yield latents[:, :, first : first + chunk_frames]  # (B, C, n, H, W)


def write_latents(path: Path, latents: np.ndarray, metadata: dict[str, str] | None = None) -> None:
    """Written beside and renamed over ``path``: an interrupted write leaves the previous file whole."""
    import os

    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({"latents": np.ascontiguousarray(latents)}, str(partial), metadata=metadata)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


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
        self.path = path
        self.file = None  # opened at the first segment: a stream that fails before it leaves no empty file
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
                self._write(encoded.segment(0, init=self.frames == 0))
                self.frames += unit.video_frames
            return
        frames = unit.decode_video().video if encoded is not None else unit.video
        if frames is None or not frames.shape[1]:
            return
        self._encode_here(np.asarray(frames[:1], dtype=np.uint8), int(unit.video_frame_end) - frames.shape[1])

    def _encode_here(self, frames: np.ndarray, start: int) -> None:
        try:
            from app.outputs.encoders import encode_h264
        except ImportError as exc:
            raise RuntimeError(f"a unit came without H.264 video and encoding it here needs PyAV ({exc}): "
                               "pip install 'wm-refiner[video]'") from None
        from wm_refiner_client import EncodedVideo

        crf = self.quality if self.quality is not None else 23
        own = encode_h264(frames, crf, start, self.fps)
        video = EncodedVideo("h264", own.codec, crf, ((own.data,),), tuple(int(v) for v in own.init_sizes))
        self._write(video.segment(0, init=self.frames == 0))
        self.frames += frames.shape[1]

    def _write(self, data: bytes) -> None:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = self.path.open("wb")
        self.file.write(data)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# --- sessions -------------------------------------------------------------------------------------------------------
def sessions_command(args: argparse.Namespace) -> int:
    from wm_refiner_client import Client

    from wm_refiner_client import APIError

    with Client(args.server, args.api_key) as client:
        if args.delete:
            refused = 0
            for session_id in args.delete:  # each one, whatever became of the others (exit 2 if any was refused)
                if not spec.is_session_id(session_id):
                    print(f"error: {session_id[:80]!r} is no session id (8 to 64 of A-Z, a-z, 0-9, '_' and '-'); "
                          "`python -m app sessions` lists the ids", file=sys.stderr)
                    refused += 1
                    continue
                try:
                    client.delete_session(session_id)
                except APIError as exc:
                    print(f"error: {session_id}: {exc}", file=sys.stderr)
                    refused += 1
                    continue
                print(f"deleted {session_id}")
            return 2 if refused else 0
        sessions = client.sessions()
    if args.json:
        print(json.dumps([session.raw for session in sessions], indent=2))
        return 0
    if not sessions:
        print("no sessions")
        return 0
    header = ("session", "state", "created", "frames in", "frames out", "flushed", "streaming", "watchers")
    rows = [(s.session_id, str(s.raw.get("state", "")), s.created_at, str(s.frames_received), str(s.frames_returned),
             "yes" if s.flushed else "no", "yes" if s.streaming else "no", str(s.raw.get("watchers", "")))
            for s in sessions]
    if any("replica" in s.raw for s in sessions):  # which replica holds each one (behind a router: several)
        header = (*header, "replica")
        rows = [(*row, str(s.raw.get("replica", ""))) for row, s in zip(rows, sessions)]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0
