"""``python -m bench gpu-serve OUT``: the service itself at the released size, from a checkpoint on disk to refined
latents over HTTP, as an operator starts it (``bench/gpu_check.sh`` runs it after the GPU tests).

``python -m bench gpu`` measures the library in one process with weights made on the device; what it cannot say is
what a server started with ``python -m app serve --config configs/sana-wm.yaml`` does: read 26 GB of weights from
disk, warm up (and compile, with ``compile_step``) at the configured geometries, answer ``/ready``, then serve. This
does that, in order, and writes ``OUT/serve.json`` (figures named with their units) and ``OUT/serve-log.txt`` (the
server's log):

1. ``checkpoint``: the released refiner's video path (``bench.gpu.random_refiner``: random weights, bfloat16, made
   on the device) written as one safetensors file with its ``config.json`` (a release's audio tensors are never read
   by the loader, so leaving them out changes no load figure); ``write_s``, ``bytes``.
2. ``startup``: the server (``WM_REFINER_CONFIG=configs/sana-wm.yaml``, the folder above as ``model``) from its
   spawn to ``/ready`` answering 200 (``ready_s``); the load and warm-up times its log gives; ``/v1/info``'s
   ``engine.step``, batching verdict and parameters loaded.
3. ``quickstart``: ``examples/quickstart.py`` against it (HTTP chunks, a WebSocket stream and one shot, compared
   bit for bit: exit status 0 when identical).
4. ``stream``: one session at the warm-up geometry (720p latents, 22x40) over HTTP chunks: the sink, then blocks;
   each block's server latency (``latency_ms``, chunk read to unit ready) and the client's round trip.
5. ``metrics``: ``/metrics``' ``refiner_`` sample count and compile failures; then SIGTERM: the drain's exit status.
6. ``compiled_startup``: a second server with ``compile_step`` on (``compile_mode: default``, what ``bench gpu``'s
   ``step_modes`` recommended; ``batching: false``, so only batch size 1 is compiled: the first H200 run found
   batching worth at most 2% there, and every batch size, 48 shapes, not ready after 132 s) until ``/ready`` or the
   run's end, with its log's compile line and ``/ready``'s reasons as they came; ready, ``compiled_stream``: the
   stream of step 4 on it (``--no-compiled-startup`` skips both; ``gpu_check.sh --smoke`` does, as compiling costs
   a minute on a CPU). Its log follows the first's in serve-log.txt.

``--smoke``: the same on the CPU with the ``tiny`` preset and a small geometry (CI, through ``gpu_check.sh --smoke``).
Every step fails soft into ``errors``; the server is always stopped.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from .live import ROOT, ServerProcess, free_port, metric_samples


def write_released(folder: Path, smoke: bool) -> dict[str, Any]:
    """The checkpoint the server loads: the released video path on the GPU (the tiny preset with ``smoke``)."""
    started = time.perf_counter()
    if smoke:
        from models.checkpoints import write_checkpoint

        write_checkpoint(folder, preset="tiny")
    else:
        from safetensors.torch import save_file

        from .gpu import random_refiner

        refiner = random_refiner(None, torch.device("cuda"), torch.bfloat16)
        model = refiner.model
        config = {"_class_name": type(model).__name__,
                  **{k: v for k, v in model.config.items() if not k.startswith("_")}}
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=list))
        save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
                  str(folder / "diffusion_pytorch_model.safetensors"))
        del refiner, model
        torch.cuda.empty_cache()  # the server process needs the device to itself
    size = sum(path.stat().st_size for path in folder.iterdir())
    return {"write_s": time.perf_counter() - started, "bytes": size}


class ReadyReasons(threading.Thread):
    """Polls a server's ``/ready`` every second on a thread of its own and keeps each distinct reason it gave, with
    the seconds since ``started_after`` when it first appeared (``summary``)."""

    def __init__(self, started_after: float):
        super().__init__(daemon=True)
        self.started_after, self.url, self.reasons = started_after, None, {}
        self._done = threading.Event()

    def follow(self, base_url: str) -> None:
        self.url = f"{base_url}/ready"

    def run(self) -> None:
        while not self._done.wait(1.0):
            if self.url is None:
                continue
            try:
                body = httpx.get(self.url, timeout=5).json()
            except (httpx.HTTPError, ValueError):
                continue
            reason = body.get("error", {}).get("message") or body.get("status")
            self.reasons.setdefault(str(reason), round(time.time() - self.started_after, 1))

    def stop(self) -> None:
        self._done.set()
        self.join(10)

    def summary(self) -> str:
        return "; ".join(f"{reason!r} from {at} s" for reason, at in self.reasons.items()) or "none"


def _log_seconds(log: str, pattern: str) -> float | None:
    found = re.findall(pattern, log)
    return float(found[-1]) if found else None


def run(out: Path, smoke: bool, end_at: float, then_compiled: bool = True) -> dict[str, Any]:
    summary: dict[str, Any] = {"smoke": smoke, "errors": {}}
    work = Path(tempfile.mkdtemp(prefix="wm-gpu-serve-"))
    log_path = work / "server.log"
    server: ServerProcess | None = None

    def step(name: str, fn) -> None:
        if time.time() > end_at - 5:
            summary["errors"][name] = "skipped: the run's end (--end-at) is near"
            return
        started = time.perf_counter()
        try:
            summary[name] = fn()
        except Exception:  # noqa: BLE001 -- each step fails soft: the next still runs, the error is reported
            summary["errors"][name] = traceback.format_exc(limit=6)
        summary.setdefault("time", {})[f"{name}_s"] = round(time.perf_counter() - started, 3)
        (out / "serve.json").write_text(json.dumps(summary, indent=2, default=str))

    def settings(compiled: bool) -> dict[str, Any]:
        values: dict[str, Any] = {"model": str(work / "model"), "compile_step": compiled}
        if smoke:  # the tiny preset on the CPU, at a toy warm-up geometry
            values.update(device="cpu", dtype="float32", warmup_height=4, warmup_width=4,
                          max_batch_rows=2)
        else:
            values["config"] = str(ROOT / "configs" / "sana-wm.yaml")
        if compiled:
            # compile_mode default: what bench gpu's step_modes recommended. One session per call (batching: false,
            # so batch size 1 alone is compiled: 6 shapes at sana-wm.yaml's two sizes, not 48): on an H200 batching
            # bought at most 2% and every batch size did not compile within 132 s (4 December 2026).
            values.update(compile_mode="default", batching=False)
        return values

    def started(compiled: bool, log: Path, follow=None) -> tuple[ServerProcess, float]:
        process = ServerProcess(free_port(), work / "cache", None, log, threads=None, **settings(compiled))
        if follow is not None:
            follow(process.base_url)
        begun = time.perf_counter()
        process.start(ready_timeout=max(10.0, end_at - 30 - time.time()))
        return process, time.perf_counter() - begun

    def start() -> dict[str, Any]:
        nonlocal server
        server, ready = started(False, log_path)
        info = httpx.get(f"{server.base_url}/v1/info", timeout=30).json()
        log = server.log_path.read_text()
        return {"ready_s": ready,
                "warmup_s": _log_seconds(log, r"warm-up done in ([0-9.]+) s"),
                "engine": info.get("engine"), "model": info.get("model"), "memory": info.get("memory")}

    def quickstart() -> dict[str, Any]:
        import runpy

        quickstart_main = runpy.run_path(str(ROOT / "examples" / "quickstart.py"))["main"]
        return {"exit_status": quickstart_main(["--server", server.base_url])}

    def stream() -> dict[str, Any]:
        from wm_refiner_client import Client

        height, width = (4, 4) if smoke else (22, 40)
        blocks = 3 if smoke else 6
        with Client(server.base_url, timeout=600) as client:
            info = client.info()["model"]
            rng = np.random.default_rng(0)
            latents = rng.standard_normal((1, info["channels"], 1 + 3 * blocks, height, width), dtype=np.float32)
            prompt = rng.standard_normal((1, 300 if not smoke else 8, info["caption_channels"]), dtype=np.float32)
            session = client.create_session(seed=0)
            round_trips, latencies = [], []
            sink = session.send(latents[:, :, :1], prompt=prompt)
            for block in range(blocks):
                started = time.perf_counter()
                unit = session.send(latents[:, :, 1 + 3 * block: 4 + 3 * block])
                round_trips.append(time.perf_counter() - started)
                latencies.append(unit.latency_ms / 1000 if unit.latency_ms is not None else None)
                assert unit.latents is not None and np.isfinite(unit.latents).all(), "a block is not finite"
            session.delete()
        steady = [s for s in latencies[2:] if s is not None]
        return {"latent_height_width": f"{height}x{width}", "sink_latency_s": (sink.latency_ms or 0) / 1000,
                "block_latency_s": latencies, "block_round_trip_s": round_trips,
                "steady_block_latency_median_s": statistics.median(steady) if steady else None}

    def metrics() -> dict[str, Any]:
        text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        samples = [line for line in text.splitlines() if line.startswith("refiner_")]
        failed = metric_samples(text, "refiner_compile_failed")
        return {"refiner_samples_count": len(samples), "compile_failed": failed}

    def compiled_startup() -> dict[str, Any]:
        """A second server, compile_step on (``settings(True)``: compile_mode default, batch size 1 at each token
        count of each warm-up size): until /ready or the run's end; its log's compile line says what was compiled
        in how long. Cut short, the error names the last reason /ready gave (``compiling the batched step: k of N
        shapes``): how far it got. Ready, the stream below runs on it too (``compiled_stream``)."""
        nonlocal server
        second = work / "server-compiled.log"
        seen = ReadyReasons(started_after=time.time())
        seen.start()
        try:
            server, ready = started(True, second, seen.follow)
        except Exception as exc:
            raise RuntimeError(f"{exc.__class__.__name__}; /ready's reasons seen meanwhile: {seen.summary()}") from exc
        finally:
            seen.stop()
            if second.exists():  # after the first server's log in serve-log.txt (a loan brings back 8 files)
                shutil.copy(second, out / "serve-compiled-log.part")
        log = second.read_text()
        info = httpx.get(f"{server.base_url}/v1/info", timeout=30).json()
        return {"ready_s": ready, "engine": info.get("engine"), "ready_reasons_s": seen.reasons,
                "warmup_s": _log_seconds(log, r"warm-up done in ([0-9.]+) s"),
                "compile_line": next((line for line in log.splitlines() if "compiled the batched step" in line), None)}

    try:
        step("checkpoint", lambda: write_released(work / "model", smoke))
        step("startup", start)
        if server is not None and server.process is not None and server.process.poll() is None:
            step("quickstart", quickstart)
            step("stream", stream)
            step("metrics", metrics)
            step("drain", lambda: {"exit_status": server.terminate(timeout=120)})
        if then_compiled:
            step("compiled_startup", compiled_startup)
            if "compiled_startup" in summary:  # ready: the same stream, compiled
                step("compiled_stream", stream)
    finally:
        if server is not None:
            server.kill()
        with (out / "serve-log.txt").open("w") as merged:
            for title, path in (("the server", log_path), ("the compiled server", out / "serve-compiled-log.part")):
                if path.exists():
                    merged.write(f"===== {title}\n{path.read_text()}\n")
        (out / "serve-compiled-log.part").unlink(missing_ok=True)
        (out / "serve.json").write_text(json.dumps(summary, indent=2, default=str))
        shutil.rmtree(work, ignore_errors=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gpu-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for serve.json and serve-log.txt")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU (CI)")
    parser.add_argument("--end-at", type=float, default=None, help="epoch second to end by (default: 15 min on)")
    parser.add_argument("--no-compiled-startup", action="store_true",
                        help="skip the second server (compile_step on) that only measures its start-up")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = run(args.out, args.smoke, args.end_at or time.time() + 900, not args.no_compiled_startup)
    print(json.dumps({k: v for k, v in summary.items() if k != "errors"}, indent=1, default=str)[:4000])
    for name, error in summary["errors"].items():
        print(f"== {name}: {error}")
    return 1 if summary["errors"] else 0
