"""``python -m bench watch-mix``: a producer's time with watchers asking for other encodings (issue 25 item 7).

One server (tiny refiner + tiny VAE, video out as uint8 to the producer, ``video_lookahead: 0``); phases
alternate between no watcher and ``--watchers`` watchers asking for mixed formats and qualities (jpeg q50, q70,
q90, h264 auto, h264 CRF 30, float32, ...), half of them never reading. Watchers past ``max_watch_encodings`` are
refused (503 over_capacity) and counted. The figure: the producer's time per block (closed loop: send a block,
wait for its unit) with the watchers against without, p50 over the phases of each kind, run on the same server in
the same process, so a machine's load shifts both. Run once with the default bound and once with
``--max-watch-encodings`` as large as the watchers (no bound: the watchers' lower-priority pool only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from bench.encode import cpu_model, produce

# What the watchers ask for, in turn (the producer gets uint8 video: none of these is its own).
QUERIES = ("video_format=jpeg&video_quality=50", "video_format=h264", "video_format=jpeg&video_quality=90",
           "video_format=h264&video_quality=30", "video_format=float32", "video_format=jpeg&video_quality=70",
           "video_format=jpeg", "video_format=h264&video_quality=40")


def run(watchers: int, blocks: int, rounds: int, max_watch_encodings: int, pixels: tuple[int, int],
        threads: int | None) -> dict[str, Any]:
    import httpx
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from bench.live import ServerProcess, free_port
    from models.checkpoints import PRESETS, write_checkpoint, write_vae_checkpoint

    height, width = pixels[0] // 32, pixels[1] // 32  # the tiny VAE's 32x
    block = 3
    phases: dict[str, list[float]] = {"none": [], "mixed": []}
    admitted, refused = [], []
    with tempfile.TemporaryDirectory(prefix="wm-watch-mix-") as tmp:
        model = write_checkpoint(Path(tmp) / "tiny", preset="tiny")
        vae = write_vae_checkpoint(Path(tmp) / "vae", "tiny-vae")
        server = ServerProcess(free_port(), Path(tmp) / "cache", None, Path(tmp) / "server.log", threads=threads,
                               model=str(model), vae=str(vae), log_level="warning", warmup_height=height,
                               warmup_width=width, max_watchers=max(8, watchers),
                               max_watch_encodings=max_watch_encodings, watch_queue_units=4)
        caption = PRESETS["tiny"]["caption_channels"]
        try:
            server.start(ready_timeout=600)
            schedule = ["none", "mixed"] * rounds + ["none"]
            for index, phase in enumerate(schedule):
                generator = torch.Generator().manual_seed(index)
                latents = torch.randn(1, 128, 1 + block * (blocks + 1), height, width, generator=generator)
                embeds = torch.randn(1, 8, caption, generator=generator)
                session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=60, json={
                    "outputs": ["video"], "video_lookahead": 0}).json()["session_id"]
                sockets, readers, taken = [], [], 0
                if phase == "mixed":
                    for n in range(watchers):
                        query = QUERIES[n % len(QUERIES)]
                        try:
                            ws = connect(f"{server.ws_url}/v1/sessions/{session_id}/watch?{query}", max_size=None,
                                         open_timeout=60)
                        except InvalidStatus as exc:
                            refused.append((query, exc.response.status_code))
                            continue
                        taken += 1
                        sockets.append(ws)
                        if n % 2 == 0:  # half of them read; the others never do
                            readers.append(threading.Thread(target=_drain, args=(ws,), daemon=True))
                    admitted.append(taken)
                for reader in readers:
                    reader.start()
                phases[phase].extend(produce(server, session_id, latents, embeds, block, blocks))
                for sock in sockets:
                    sock.close()
                for reader in readers:
                    reader.join(60)
        finally:
            server.kill()
    none_p50, mixed_p50 = (statistics.median(phases[p]) for p in ("none", "mixed"))
    return {"max_watch_encodings": max_watch_encodings, "blocks_none": len(phases["none"]),
            "blocks_mixed": len(phases["mixed"]), "p50_none_ms": none_p50 * 1000, "p50_mixed_ms": mixed_p50 * 1000,
            "ratio": mixed_p50 / none_p50, "admitted_per_phase": admitted,
            "refused": sorted({query for query, _ in refused}), "refused_status": sorted({s for _, s in refused})}


def _drain(ws) -> None:
    try:
        while True:
            message = ws.recv(timeout=600)
            if isinstance(message, str) and json.loads(message)["type"] == "done":
                return
    except Exception:
        return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench watch-mix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--watchers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=4, help="timed blocks per phase")
    parser.add_argument("--rounds", type=int, default=2, help="watcher phases (each between two without)")
    parser.add_argument("--height", type=int, default=256, help="video pixels (the tiny VAE's 32x latents)")
    parser.add_argument("--width", type=int, default=416)
    parser.add_argument("--max-watch-encodings", type=int, nargs="+", default=[2],
                        help="the bound(s) to run with, one server each (default 2, the setting's default)")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads (default: all)")
    args = parser.parse_args(argv)
    command = (f"python -m bench watch-mix --watchers {args.watchers} --blocks {args.blocks} --rounds {args.rounds} "
               f"--height {args.height} --width {args.width} --max-watch-encodings "
               f"{' '.join(map(str, args.max_watch_encodings))}" + (f" --threads {args.threads}" if args.threads else ""))
    print(f"`{command}` on {cpu_model()} ({os.cpu_count()} cores)\n")
    print("| max_watch_encodings | watchers admitted / asked | refused | producer p50 without | with | ratio |")
    print("|---|---|---|---|---|---|")
    for bound in args.max_watch_encodings:
        r = run(args.watchers, args.blocks, args.rounds, bound, (args.height, args.width), args.threads)
        print(f"| {bound} | {r['admitted_per_phase']} / {args.watchers} | {len(r['refused'])} queries "
              f"(HTTP {r['refused_status'] or '-'}) | {r['p50_none_ms']:.0f} ms | {r['p50_mixed_ms']:.0f} ms | "
              f"**{r['ratio']:.2f}x** |", flush=True)
    print(f"\nload average after: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
