"""``python -m bench.ctrl_c``: how long ``python -m app stream`` takes to exit after Ctrl-C (SIGINT), with the
client's WebSocket ``close_timeout`` (``wm_refiner_client._common.CLOSE_TIMEOUT_S``) against websockets' default of
10 s, in the same run against the same server.

A medium refiner at 16x16 latents on one torch thread makes a block take long enough that the server's reader is
busy with the last message when the client closes: the close frame then waits for it, and the client waits for the
server's answer to its close, up to ``close_timeout``. Each run streams ``--input`` of 60 frames in messages of 6
with ``--session-id`` and is interrupted once the session has returned 4 frames. It reports; it never asserts.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.live import ROOT, ThreadServer


def exit_after_sigint(server, clip: Path, out_dir: Path, session_id: str, close_timeout: float | None) -> float:
    from wm_refiner_client import Client

    patch = "" if close_timeout is None else f"import wm_refiner_client.client as c; c.CLOSE_TIMEOUT_S = {close_timeout}; "
    script = patch + "import sys; from app.cli.commands import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_REFINER_")}
    env["PYTHONPATH"] = str(ROOT)
    child = subprocess.Popen(
        [sys.executable, "-c", script, "stream", "--server", server.base_url, "--input", str(clip), "--output",
         str(out_dir / f"{session_id}.safetensors"), "--session-id", session_id, "--chunk-frames", "6"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    with Client(server.base_url) as client:
        while time.monotonic() < deadline:
            try:
                if client.get_session(session_id).frames_returned >= 4:
                    break
            except Exception:  # not created yet
                pass
            time.sleep(0.05)
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    child.wait(timeout=120)
    return time.monotonic() - sent


def main(rounds: int = 3) -> int:
    from safetensors.numpy import save_file

    from app.core.settings import Settings
    from models.checkpoints import write_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-ctrl-c-"))
    checkpoint = write_checkpoint(tmp / "medium", preset="medium")
    generator = np.random.default_rng(0)
    clip = tmp / "in.safetensors"
    save_file({"latents": generator.standard_normal((1, 128, 60, 16, 16), dtype=np.float32),  # (B, C, T, H, W)
               "prompt_embeds": generator.standard_normal((1, 6, 128), dtype=np.float32)}, str(clip))
    settings = Settings(model=str(checkpoint), device="cpu", dtype="float32", cache_dir=tmp / "cache", torch_threads=1,
                        log_level="warning")
    times: dict[str, list[float]] = {"default": [], "client": []}
    with ThreadServer(settings) as server:
        for run in range(rounds):  # interleaved, so the machine's load falls on both alike
            times["default"].append(exit_after_sigint(server, clip, tmp, f"ctrl-c-default-{run}", 10.0))
            times["client"].append(exit_after_sigint(server, clip, tmp, f"ctrl-c-client-{run}", None))
    default, client = statistics.median(times["default"]), statistics.median(times["client"])
    print(f"exit after SIGINT, median of {rounds}: close_timeout 10 s {default:.2f} s "
          f"({', '.join(f'{t:.2f}' for t in times['default'])}); the client's {client:.2f} s "
          f"({', '.join(f'{t:.2f}' for t in times['client'])}); ratio {default / client:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
