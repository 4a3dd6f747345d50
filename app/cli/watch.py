"""``python -m app watch SESSION``: follow a running session from a terminal, read-only (``WS .../watch``).

One line per refined block on stdout (its frames and latency, as the live view charts them); with ``--output`` the
refined latents from the moment the watch began go to a safetensors file, with ``--video`` the session's video
(row 0) to a fragmented .mp4 from the server's H.264 segments. It ends with the session's flush, or Ctrl-C (130),
writing what it got either way; a drain of the session's replica (close 1012/1001) is ridden out (``_follow``). A
watcher never slows a session: one that falls behind loses units (the server's ``watch_queue_units``); the files
then hold the frames before the gap, and the command ends with exit 2 saying so, rather than writing a clip with
frames missing from its middle. A restart costs no units when the server still keeps them: the watch reconnects
with ``resume_from`` = the frames it holds, and the session's kept units (its last ``ws_resume_units``, saved with it
by the drain) come first. When they are no longer kept, the frames refined while the watch was away (the session's
``frames_returned`` when it answers again, or the ``done`` event's count past the last unit) are a gap, named by
its frames.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.cli.remote import INTERRUPTED, SegmentFile, add_client_options, require_video_libraries, write_latents
from wm_refiner_client.retry import RetryPolicy

OUTPUT_FIRST_FRAME = "wm_refiner.frame_start"  # the session's frame the file's first latent frame is


def add_watch_parser(commands) -> None:
    watch = commands.add_parser("watch", help="follow a session on a running server: a line per block, and "
                                              "optionally its latents or video to files (read-only)")
    add_client_options(watch)
    watch.add_argument("session_id", metavar="SESSION", help="the session's id (python -m app sessions lists them)")
    watch.add_argument("--output", help="write the refined latents from now on to this safetensors file (float32)")
    watch.add_argument("--video", help="write the session's video (row 0) from now on to this .mp4 (the server's "
                                       "H.264 segments; the session needs video among its outputs)")


def watch_command(args: argparse.Namespace) -> int:
    from wm_refiner_client import BlockEvent, Client, DroppedEvent, WmRefinerError

    outputs = [kind for kind, wanted in (("latents", args.output), ("video", args.video)) if wanted]
    if args.video:
        require_video_libraries()
    with Client(args.server, args.api_key) as client:
        session = client.get_session(args.session_id)  # a 404 names the id before anything is watched
        video = None
        if args.video:
            video = SegmentFile(Path(args.video), float(session.config.get("fps", 16.0)))
        latents: list[np.ndarray] = []
        first = end = None  # the frames the files hold: [first, end)
        video_end = None  # and the pixel frames, up to the last unit's video_frame_end
        interrupted = False
        gap: str | None = None
        blocks = 0
        events = _follow(session, outputs or None, "h264" if args.video else None, client.retry.restart_timeout_s)
        try:
            print(f"watching session {session.id} (Ctrl-C to stop)", file=sys.stderr)
            for event in events:
                if isinstance(event, Rejoined):
                    if end is not None and event.frames_returned > end:
                        gap = (f"frames [{end}, {event.frames_returned}) were refined while the watch reconnected "
                               "and the server no longer keeps them (its ws_resume_units)")
                        break
                    continue
                if isinstance(event, Finished):
                    if end is not None and event.frames is not None and event.frames > end:
                        gap = (f"frames [{end}, {event.frames}) never came (the session returned {event.frames} "
                               "frames in all)")
                    break
                if isinstance(event, DroppedEvent):
                    gap = (f"this watcher fell behind and the server dropped {event.units} units (its "
                           "watch_queue_units): the files stop before the gap; watch again, or from a machine that "
                           "reads faster")
                    break
                if isinstance(event, BlockEvent):
                    blocks += 1
                    latency = "-" if event.latency_ms is None else f"{event.latency_ms:.0f} ms"
                    print(f"frames [{event.frame_start}, {event.frame_end}) latency {latency}", flush=True)
                    continue
                if end is not None and event.frame_start > end:  # a unit lost without a dropped event
                    gap = f"frames [{end}, {event.frame_start}) never came"
                    break
                if end is not None and event.frame_start < end:  # frames the files hold, sent again (a replica
                    # that adopted an older checkpoint refined them once more): only what follows them is new
                    if event.frame_end <= end and (event.video_frame_end is None or video_end is None
                                                   or event.video_frame_end <= video_end):
                        continue
                    event = event.after(end, video_end)
                if first is None:
                    first = event.frame_start
                end = max(end or 0, event.frame_end)
                if event.video_frame_end is not None:
                    video_end = max(video_end or 0, event.video_frame_end)
                if args.output and event.latents is not None:
                    latents.append(np.asarray(event.latents, dtype=np.float32))
                if video is not None:
                    video.write(event)
        except KeyboardInterrupt:
            interrupted = True
        except WmRefinerError:
            if latents or (video is not None and video.frames):
                _write(args, latents, first, video)
            raise
        finally:
            events.close()  # a gap's break: the watch's connection closes now
            if video is not None:
                video.close()
    written = _write(args, latents, first, video)
    held = "no frames" if first is None else f"frames [{first}, {end})"
    summary = f"{blocks} blocks, {held}" + (f" -> {written}" if written else "")
    if gap is not None:
        print(f"error: {gap}; wrote {summary}", file=sys.stderr)
        return 2
    if interrupted:
        print(f"interrupted: watched {summary}", file=sys.stderr)
        return INTERRUPTED
    print(f"session {session.id} is flushed: watched {summary}")
    return 0


# Close codes of a replica that stops (a drain: 1012 once it saved the session, 1001 going away): the session lives
# on, adopted by the replica the router picks next, so the watch connects again rather than ending as an error.
RESTART_CLOSE_CODES = frozenset({1001, 1012})
# What a restarting session answers until it is served again: 503 while its replica loads and warms up (not_ready),
# drains or another replica holds its lease (session_moved), 404 between replicas, 502/504 from a router.
RESTARTING_STATUSES = frozenset({404, 502, 503, 504})
RECONNECT_FOR_S = RetryPolicy().restart_timeout_s  # the client's own bound: a restart of the released model
# (weights, warm-up, probes) takes minutes


@dataclass(frozen=True)
class Rejoined:
    """The session answered again after a restart: the frames it had returned by then, whether it was flushed."""

    frames_returned: int
    flushed: bool


@dataclass(frozen=True)
class Finished:
    """The session's flush ended the watch: the frames it returned in all (the ``done`` event's; None: not said)."""

    frames: int | None


def _follow(session, outputs, video_format, reconnect_for_s: float = RECONNECT_FOR_S):
    """``session.watch(...)``'s events, across the restarts (drains) of the session's replica: the watch connects
    again through the same URL (behind a router, to the replica that adopts the session), for up to
    ``reconnect_for_s`` from the close, while the session or its watch answers as a restarting server does
    (``RESTARTING_STATUSES``), and ends with ``Finished``. Once it holds units it reconnects with ``resume_from``
    = the end of the last one, so the server first sends again the units finalized while it was away (those it
    still keeps: a drain saves them with the session); a unit straddling that end comes whole (``watch_command``
    keeps what follows the frames it has). When the server no longer keeps them (``resume_unavailable``; or the
    kept units are not in the watch's video encoding), or before any unit came, it watches from now on after a
    ``Rejoined`` (where the session stood then: a flushed one is not watched again), against which
    ``watch_command`` names the gap."""
    import time

    from wm_refiner_client import APIError, TransportError, Unit

    deadline: float | None = None  # set while the session's replica is restarting
    held: int | None = None  # where the last unit received ends: what a resume asks from
    resume = False  # the next watch resumes from ``held``
    while True:
        try:
            watch = session.watch(outputs, video_format=video_format, resume_from=held if resume else None)
            try:
                for event in watch:
                    deadline = None
                    if isinstance(event, Unit):
                        held = max(held or 0, event.frame_end)
                    yield event
            finally:
                watch.close()  # this generator closed early (a gap, Ctrl-C): the connection closes now, not at exit
            yield Finished(watch.frames)
            return
        except TransportError as exc:
            code = exc.close_code
            if code in RESTART_CLOSE_CODES:
                print(f"the session's replica is restarting (close {code}); the session was saved: watching it "
                      "again", file=sys.stderr)
                deadline = time.monotonic() + reconnect_for_s
            elif deadline is None or exc.final or time.monotonic() > deadline:
                raise
        except APIError as exc:  # the watch's handshake refused: still restarting, or not; or its resume refused
            if resume and exc.code in RESUME_REFUSALS:
                print(f"the units since frame {held} cannot be sent again ({exc.code}): watching from now on",
                      file=sys.stderr)
                resume = False
                state = session.state()
                yield Rejoined(state.frames_returned, state.flushed)
                if state.flushed:
                    return
                continue
            if deadline is None or exc.status not in RESTARTING_STATUSES or time.monotonic() > deadline:
                raise
        while True:  # until the session answers again (the router may still send to the draining replica)
            time.sleep(1.0)
            try:
                state = session.state()
                break
            except (APIError, TransportError) as exc:
                if time.monotonic() > deadline or getattr(exc, "status", 503) not in RESTARTING_STATUSES:
                    raise
        if held is not None:
            resume = True  # what was finalized meanwhile comes first, flushed or not
            continue
        yield Rejoined(state.frames_returned, state.flushed)
        if state.flushed:
            return


# A resumed watch refused in-band: the units from where the watch stands are no longer kept, or are kept in a video
# encoding other than the one it asks (the --video file's H.264 of a session that encodes otherwise).
RESUME_REFUSALS = frozenset({"resume_unavailable", "invalid_request"})


def _write(args: argparse.Namespace, latents: list[np.ndarray], first: int | None, video) -> str:
    """Writes the latents file (the video file is written as it comes); says what was written."""
    written = []
    if args.output and latents:
        write_latents(Path(args.output), np.concatenate(latents, axis=2), {OUTPUT_FIRST_FRAME: str(first)})
        written.append(args.output)
    if video is not None and video.frames:
        written.append(f"{args.video} ({video.frames} video frames)")
    return ", ".join(written)
