"""Replicas behind the real router, and clients that ride out moves: the cluster tests' and the cluster soak's code.

- ``Cluster``: ``deploy/local-cluster.sh`` as a subprocess (N ``python -m app serve`` replicas sharing a snapshot
  folder, HAProxy in front), ready once ``cluster.json`` is written; ``stop`` drains everything.
- ``ws_client`` / ``http_client``: a session streamed closed-loop through the router, chunk by chunk, that
  survives its replica draining (503, 1012) or dying (connection errors, 404 until adopted) by doing what the
  docs (cluster.md, api.md) tell clients to do: reconnect with ``?resume_from=<frames received>`` and resend from the session's
  ``frames_received``; over HTTP, retry the same ``seq``, and after a crash (409: the checkpoint is behind) resend
  from the chunk the session's state names. ``Units`` keeps the refined frames in order, skipping frames it has.

These two clients speak the raw wire on purpose: they are docs/api.md's recipe for clients in other languages, run
against the real router, and they recover where ``wm_refiner_client`` cannot yet: after a ``kill -9`` whose
adopting replica's crash checkpoint is behind frames the client already got back, a raw client still holds its
input and resends it, while the library has dropped the chunks whose frames came back refined (issue 16 item 9:
it needs the server to say which frames a checkpoint covers).

``python -m bench.cluster`` is the cluster soak: sessions over WebSockets and HTTP, one replica drained and
another killed (``kill -9``) mid-run, every frame checked against the session refined alone; bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import torch

from app.core.codec import decode_response, encode
from bench.live import free_port

ROOT = Path(__file__).resolve().parents[1]
OCTET = {"content-type": "application/octet-stream"}


class Cluster:
    def __init__(self, state_dir: Path, replicas: int, *options: str):
        self.state_dir = state_dir
        self.process = subprocess.Popen(
            ["bash", str(ROOT / "deploy" / "local-cluster.sh"), "--replicas", str(replicas), "--port",
             str(free_port()), "--state-dir", str(state_dir), *options],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        deadline = time.monotonic() + 600
        info = state_dir / "cluster.json"
        while not info.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the cluster did not start:\n{self.process.stdout.read()}")
            time.sleep(0.1)
        self.info = json.loads(info.read_text())
        self.url = f"http://127.0.0.1:{self.info['router_port']}"
        self.ws_url = f"ws://127.0.0.1:{self.info['router_port']}"

    def replica(self, replica_id: str) -> dict:
        return next(r for r in self.info["replicas"] if r["replica_id"] == replica_id)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


def chunk(latents, embeds=None, mask=None) -> bytes:
    tensors = {"latents": latents.contiguous()}
    if embeds is not None:
        tensors["prompt_embeds"] = embeds.contiguous()
    if mask is not None:
        tensors["prompt_attention_mask"] = mask.contiguous()
    return encode(tensors)


class Units:
    """A client's refined frames in order: a unit it already has (sent again after a move) is skipped, a gap fails."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.received = 0
        self.duplicates = 0
        self.reconnects = 0

    def add(self, latents: torch.Tensor, start: int, end: int) -> None:
        if end <= self.received:
            self.duplicates += 1
            return
        if start != self.received:
            raise AssertionError(f"a gap: got [{start}, {end}) after {self.received} frames")
        self.parts.append(latents)
        self.received = end

    def clip(self) -> torch.Tensor:
        return torch.cat(self.parts, dim=2)


def _grid(frames: int) -> list[int]:
    """Chunk boundaries on the default block grid (sink 1, blocks of 3): each chunk completes its block."""
    return [0, 4, *range(7, frames, 3), frames]


def ws_client(cluster: Cluster, session_id: str, latents, embeds, mask, units: Units, progress: threading.Event,
              deadline_s: float = 120.0, pause_s: float = 0.05) -> None:
    from websockets.exceptions import ConnectionClosed, InvalidHandshake
    from websockets.sync.client import connect

    frames = latents.shape[2]
    bounds = _grid(frames)
    deadline = time.monotonic() + deadline_s

    def read_until(ws, frame: int) -> None:
        while units.received < frame:
            message = ws.recv(timeout=30)
            if isinstance(message, str):
                event = json.loads(message)
                # A message refused because the replica is draining was not taken: the close (1012) follows, and
                # the session event after the reconnect says what to send again.
                if event["type"] == "error" and event["error"]["code"] != "draining":
                    raise AssertionError(message)
                continue
            tensors, meta = decode_response(message)
            units.add(tensors["latents"], int(meta["frame_start"]), int(meta["frame_end"]))
            if units.received >= 4:
                progress.set()

    while True:
        if time.monotonic() > deadline:
            raise AssertionError(f"{session_id}: gave up at {units.received} frames")
        try:
            url = f"{cluster.ws_url}/v1/sessions/{session_id}/stream?resume_from={units.received}"
            with connect(url, open_timeout=10, max_size=None) as ws:
                event = json.loads(ws.recv(timeout=30))
                assert event["type"] == "session", event
                cursor = event["frames_received"]
                for start, end in zip(bounds, bounds[1:]):
                    if start < cursor:
                        continue
                    ws.send(chunk(latents[:, :, start:end], *((embeds, mask) if start == 0 else ())))
                    cursor = end
                    read_until(ws, cursor)
                    time.sleep(pause_s)
                read_until(ws, frames)
                ws.send(json.dumps({"type": "flush"}))
                while not (isinstance(message := ws.recv(timeout=30), str) and json.loads(message)["type"] == "done"):
                    pass
                return
        except (ConnectionClosed, InvalidHandshake, OSError, TimeoutError):
            units.reconnects += 1
            time.sleep(0.2)  # draining (503), moving (404 until adopted), or gone: try again through the router


def http_client(cluster: Cluster, session_id: str, latents, embeds, mask, units: Units, progress: threading.Event,
                deadline_s: float = 120.0, pause_s: float = 0.05) -> None:
    frames = latents.shape[2]
    bounds = _grid(frames)
    deadline = time.monotonic() + deadline_s
    last = None
    with httpx.Client(base_url=cluster.url, timeout=30) as http:
        index = 0  # the chunk to send, whose seq is its index
        while index < len(bounds) - 1:
            start, end = bounds[index], bounds[index + 1]
            body = chunk(latents[:, :, start:end], *((embeds, mask) if start == 0 else ()))
            if time.monotonic() > deadline:
                raise AssertionError(f"{session_id}: gave up at seq {index}; last answer "
                                     f"{last and (last.status_code, last.headers.get('x-replica'), last.text[:200])}")
            try:
                reply = http.post(f"/v1/sessions/{session_id}/chunks", params={"seq": index, "flush": end == frames},
                                  content=body, headers=OCTET)
            except httpx.HTTPError:
                units.reconnects += 1
                time.sleep(0.2)
                continue
            last = reply
            if reply.status_code in (503, 404):  # draining, or the session is on its way to another replica
                time.sleep(0.2)
                continue
            if reply.status_code == 409 and reply.json()["error"]["code"] == "seq_conflict":
                # Adopted from a crash checkpoint that is behind this client: resend from where the session is.
                state = http.get(f"/v1/sessions/{session_id}").json()
                index = bounds.index(state["frames_received"])
                units.reconnects += 1
                continue
            if reply.status_code != 200:
                raise AssertionError(f"{session_id}: {reply.status_code} {reply.text[:300]}")
            tensors, meta = decode_response(reply.content)
            if tensors["latents"].shape[2]:
                units.add(tensors["latents"], int(meta["frame_start"]), int(meta["frame_end"]))
            if units.received >= 4:
                progress.set()
            index += 1
            time.sleep(pause_s)


# --- the cluster soak -------------------------------------------------------------------------------------------
def run_cluster_soak(workdir: Path, replicas: int = 3, sessions: int = 8, frames: int = 100,
                     deadline_s: float = 240.0, every: int = 1) -> dict[str, Any]:
    """Sessions (half WebSocket, half HTTP) through the router; at a third of the frames one replica is drained, at
    two thirds another is killed; every session must end bit-identical to itself refined alone."""
    from models import SessionConfig, load_refiner, refine_clip

    began = time.monotonic()
    cluster = Cluster(workdir / "cluster", replicas, "--checkpoint-every-blocks", str(every))  # its own bound
    started = time.monotonic()  # ``deadline_s`` is the soak's, from a cluster that is up (slow CI starts vary)
    clients, owners, units, clips, progress = [], {}, {}, {}, {}
    events: list[tuple[str, str, float]] = []
    try:
        with httpx.Client(base_url=cluster.url, timeout=30) as http:
            for index in range(sessions):
                created = http.post("/v1/sessions", json={"seed": index})
                created.raise_for_status()
                session_id = created.json()["session_id"]
                owners[session_id] = created.headers["x-replica"]
                generator = torch.Generator().manual_seed(1000 + index)
                clips[session_id] = (torch.randn(1, 128, frames, 2, 2, generator=generator),
                                     torch.randn(1, 6, 32, generator=generator), None)
                units[session_id], progress[session_id] = Units(), threading.Event()
                target = ws_client if index % 2 == 0 else http_client
                clients.append(threading.Thread(
                    target=target, args=(cluster, session_id, *clips[session_id], units[session_id],
                                         progress[session_id], deadline_s), daemon=True))
        failures: list[BaseException] = []
        for thread in clients:
            run = thread.run

            def guarded(run=run):
                try:
                    run()
                except BaseException as exc:  # reported below
                    failures.append(exc)

            thread.run = guarded
            thread.start()
        alive = list(Counter(owners.values()))
        total = sessions * frames

        def share() -> float:
            return sum(u.received for u in units.values()) / total

        for fraction, sig, name in ((1 / 3, signal.SIGTERM, "drain"), (2 / 3, signal.SIGKILL, "kill -9")):
            while share() < fraction and any(t.is_alive() for t in clients):
                if time.monotonic() - started > deadline_s:
                    raise AssertionError("the soak did not reach its moves in time")
                time.sleep(0.05)
            victim = max(alive, key=lambda r: sum(1 for o in owners.values() if o == r))
            alive.remove(victim)
            os.kill(cluster.replica(victim)["pid"], sig)
            events.append((name, victim, round(share(), 3)))
        for thread in clients:
            thread.join(max(deadline_s - (time.monotonic() - started), 1))
        if failures:
            raise failures[0]
        if any(t.is_alive() for t in clients):
            raise AssertionError("sessions unfinished at the deadline")
    finally:
        cluster.stop()
    refiner = load_refiner(workdir / "cluster" / "cache" / "tiny", device="cpu", dtype="float32")
    checked = 0
    for index, (session_id, (latents, embeds, mask)) in enumerate(clips.items()):
        want = refine_clip(refiner, latents, embeds, mask, SessionConfig(seed=index))
        got = units[session_id].clip()
        if got.shape != want.shape or not torch.equal(got, want):
            raise AssertionError(f"session {index}: output differs from its uninterrupted run")
        checked += got.shape[2]
    return {
        "replicas": replicas,
        "sessions": sessions,
        "frames_per_session": frames,
        "frames_checked": checked,
        "moves": events,
        "reconnects_or_resyncs": sum(u.reconnects for u in units.values()),
        "units_received_twice_and_skipped": sum(u.duplicates for u in units.values()),
        "seconds": round(time.monotonic() - started, 1),
        "startup_seconds": round(started - began, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--deadline-s", type=float, default=240.0)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="wm-cluster-soak-") as tmp:
        figures = run_cluster_soak(args.workdir or Path(tmp), args.replicas, args.sessions, args.frames,
                                   args.deadline_s)
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
