"""``python -m bench park``: what bringing a session back costs, per state it comes back from, and its sizes.

One server in this process (the medium refiner by default, a snapshot folder on this machine's disk) holds
``--sessions`` sessions whose windows are full (sink + kv_max_frames + one block received). Each round moves every
session to one state and times its page-in on the server's own loop: ``parked`` (``Parking.activate``: tensors
back from host memory, an engine call) and ``spilled`` (``SessionStore.lookup``: the file claimed, read and checked
on a worker thread, built into a session on the engine thread). It also times a one-block HTTP chunk from each
state (page-in + the block's forwards), against a chunk of an active session. Sizes: device bytes of an active session, host bytes of a parked
one, file bytes of a spilled one. It reports; it never asserts.

It also measures what ``snapshot_signing_key`` costs (``bench.signing``): a spilled session's file (its tensors and
metadata as the server wrote them) written and read back signed and unsigned, alternating, and the HMAC's
throughput; with ``--signing-gib N`` the same for a synthetic record of N GiB (a 480p window's size class). And
the engine thread's share of adopting that session's file signed: all of ``load_record`` (as before the read moved
to a worker thread) against ``record_from_tensors`` alone (as now).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save

from bench import signing
from bench.live import ThreadServer
from models.checkpoints import PRESETS, write_checkpoint


def _payload(latents, embeds=None) -> bytes:
    tensors = {"latents": latents.contiguous()}
    if embeds is not None:
        tensors["prompt_embeds"] = embeds.contiguous()
    return save(tensors)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"bench park: {what}")


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench park", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--height", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--signing-rounds", type=int, default=5,
                        help="rounds of the signed/unsigned write and read of each record")
    parser.add_argument("--signing-gib", type=float, default=0.0,
                        help="also a synthetic record of this many GiB of tensors (0: only the session's)")
    args = parser.parse_args(argv)

    from app.core.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = write_checkpoint(tmp_path / "model", preset=args.preset)
        settings = Settings(model=str(model), device=args.device, dtype="float32", cache_dir=tmp_path / "cache",
                            snapshot_dir=tmp_path / "spill", park_after_s=3600, spill_after_s=7200,
                            torch_threads=args.threads, batching=True, max_sessions=max(args.sessions, 1) + 1)
        with ThreadServer(settings) as server, httpx.Client(base_url=server.base_url, timeout=600) as http:
            services = server.services
            store, parking = services.store, services.store.parking
            refiner = services.refiner
            config = settings.session_defaults()
            caption = refiner.info.caption_channels
            generator = torch.Generator().manual_seed(0)
            fill = config.sink_frames + config.kv_max_frames + config.block_size
            frames = fill + config.block_size * 3 * args.rounds  # a block per chunk: active, parked, spilled
            latents = torch.randn(1, refiner.info.in_channels, frames, args.height, args.width, generator=generator)
            embeds = torch.randn(1, 16, caption, generator=generator)
            ids = [http.post("/v1/sessions").json()["session_id"] for _ in range(args.sessions)]
            for sid in ids:
                _require(http.post(f"/v1/sessions/{sid}/chunks", content=_payload(latents[:, :, :fill], embeds),
                                   headers={"content-type": "application/octet-stream"}).status_code == 200,
                         "the first chunk was refused")
            position = {sid: fill for sid in ids}

            def chunk(sid: str) -> float:
                start = position[sid]
                position[sid] = start + config.block_size
                body = _payload(latents[:, :, start : start + config.block_size])
                began = time.perf_counter()
                reply = http.post(f"/v1/sessions/{sid}/chunks", content=body,
                                  headers={"content-type": "application/octet-stream"})
                elapsed = time.perf_counter() - began
                if reply.status_code != 200:
                    raise SystemExit(f"chunk refused: {reply.status_code} {reply.text}")
                return elapsed

            def on_loop(coroutine):
                return server.on_loop(coroutine).result(600)

            sizes = {}
            first = http.get(f"/v1/sessions/{ids[0]}").json()
            sizes["active device bytes"] = first["bytes"]["device"]
            figures: dict[str, list[float]] = {k: [] for k in ("page-in parked", "page-in spilled", "chunk active",
                                                              "chunk parked", "chunk spilled")}
            for _ in range(args.rounds):
                for sid in ids:
                    figures["chunk active"].append(chunk(sid))
                # Parked: page-in alone, then a chunk after parking again.
                for sid in ids:
                    handle = services.registry.existing(sid)
                    _require(on_loop(parking.park(handle, reason="bench")), "the session did not park")
                    sizes["parked host bytes"] = http.get(f"/v1/sessions/{sid}").json()["bytes"]["host"]
                    began = time.perf_counter()
                    on_loop(parking.activate(handle))
                    figures["page-in parked"].append(time.perf_counter() - began)
                    _require(on_loop(parking.park(handle, reason="bench")), "the session did not park")
                    figures["chunk parked"].append(chunk(sid))
                # Spilled: adoption alone, then a chunk after spilling again.
                for sid in ids:
                    for timed in ("page-in spilled", "chunk spilled"):
                        handle = services.registry.existing(sid)
                        _require(on_loop(parking.park(handle, reason="bench")), "the session did not park")
                        _require(on_loop(parking.spill(handle)), "the session did not spill")
                        sizes["spilled file bytes"] = parking.spilled[sid].file_bytes
                        began = time.perf_counter()
                        if timed == "page-in spilled":
                            on_loop(store.lookup(sid))
                            figures[timed].append(time.perf_counter() - began)
                        else:
                            figures[timed].append(chunk(sid))
            # Signing: the file a spill writes, as the server wrote it (unsigned: the server has no key).
            handle = services.registry.existing(ids[0])
            _require(on_loop(parking.park(handle, reason="bench")), "the session did not park")
            _require(on_loop(parking.spill(handle)), "the session did not spill")
            from app.persistence.records import snapshot_path
            from models.snapshot import read_tensors

            records = {"session": read_tensors(snapshot_path(settings.snapshot_dir, ids[0]))}
            engine_ms = signing.engine_time(
                *records["session"], ids[0], tmp_path / "signing-adopt", refiner, services.stages,
                on_engine=lambda fn: on_loop(services.engine.call(fn)), rounds=args.signing_rounds)
        if args.signing_gib > 0:
            records[f"{args.signing_gib:g} GiB"] = signing.synthetic_record(args.signing_gib)
        signing_rows = []
        for name, (tensors, metadata) in records.items():
            measured = signing.measure(tensors, metadata, tmp_path / "signing", args.signing_rounds)
            signing_rows += signing.format_rows(name, tensors, measured)
            del tensors, measured

    print(f"# bench park: {args.preset} refiner, {args.sessions} sessions, latents {args.height}x{args.width}, "
          f"{args.device}, {_cpu_model()}, torch {torch.__version__}, threads {args.threads or torch.get_num_threads()}")
    print(f"# window: sink {config.sink_frames} + history {config.kv_max_frames} + block {config.block_size} frames")
    for name, value in sizes.items():
        print(f"{name:24s} {value:>14,d}")
    print(f"{'':24s} {'p50 ms':>10s} {'max ms':>10s} {'n':>4s}")
    for name, values in figures.items():
        print(f"{name:24s} {1000 * statistics.median(values):10.2f} {1000 * max(values):10.2f} {len(values):4d}")
    print(f"# snapshot signing (p50 of {args.signing_rounds}, signed and unsigned alternating): "
          f"{'record':10s} {'tensor bytes':>14s} {'unsigned ms':>10s} {'signed ms':>10s} {'added ms':>10s} "
          f"{'ratio':>8s} {'n':>3s}")
    for row in signing_rows:
        print(row)
    print(f"# a signed session file adopted: the engine thread's time (p50 of {args.signing_rounds}): all of "
          "load_record on it (all); record_from_tensors building the session, read_record on a worker thread "
          "(build); the session built in host memory on a worker thread too, the engine only queuing its move (move)")
    for name, values in engine_ms.items():
        print(f"signing engine {name:6s} {1000 * statistics.median(values):10.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
