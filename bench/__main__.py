"""``python -m bench``: the benchmarks (see docs/benchmarks.md).

    python -m bench cache  [...]   the KV-cached step vs recomputing the window, FLOP/s, cache bytes (+ --service)
    python -m bench load   [...]   many sessions at once over WebSockets: batching on vs off, p50/p99 latency
    python -m bench attention      window attention for a batch: per session vs stacked vs padded + mask
    python -m bench vae-lookahead  bounded video look-ahead: error against the exact decode, N = 0..8
    python -m bench decode [...]   video output: refine + decode vs refine alone, shared, with a stalled watcher
    python -m bench invariance     what batch invariance by construction costs (per-row time embedding, probe)
    python -m bench checkpoint     crash checkpoints: block latency with and without, bytes per checkpoint
    python -m bench park   [...]   page-in latency of parked and spilled sessions, their sizes, and what
                                   snapshot signing costs a session file (--signing-gib N: also N GiB)
    python -m bench realtime [...] paced realtime sessions: how many each server mode keeps with no late block
    python -m bench encode [...]   encoded video (jpeg, h264): bytes and PSNR vs raw, encode ms, JPEG watchers
    python -m bench watch-mix [...] a producer's time with 8 watchers of mixed encodings vs none
    python -m bench http-retain [...] HTTP chunk latency with the units kept for a resuming watcher vs none kept
    python -m bench gpu OUT [--smoke] the GPU check's figures in one process (bench/gpu_check.sh runs it)
    python -m bench gpu-serve OUT [--smoke] the service from a released-size checkpoint on disk: ready, serve, drain
    python -m bench loadmodel [...] loading a released-width checkpoint: load_refiner vs safetensors' load_file
    python -m bench warmup [...]   compile_step's warm-up by compile_buckets and inductor cache state; padding's cost
    python -m bench.soak   [...]   the soak: sessions, drops and a restart, checked bit for bit
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "cache":
        from bench.cache import bench_command, build_parser

        return bench_command(build_parser().parse_args(rest))
    if command == "load":
        from bench.load import main as load_main

        return load_main(rest)
    if command == "attention":
        from bench.attention import main as attention_main

        return attention_main(rest)
    if command == "vae-lookahead":
        from bench.vae_lookahead import main as lookahead_main

        return lookahead_main(rest)
    if command == "invariance":
        from bench.invariance import main as invariance_main

        return invariance_main(rest)
    if command == "checkpoint":
        from bench.checkpoint import main as checkpoint_main

        return checkpoint_main(rest)
    if command == "park":
        from bench.park import main as park_main

        return park_main(rest)
    if command == "realtime":
        from bench.realtime import main as realtime_main

        return realtime_main(rest)
    if command == "decode":
        from bench.decode import main as decode_main

        return decode_main(rest)
    if command == "encode":
        from bench.encode import main as encode_main

        return encode_main(rest)
    if command == "watch-mix":
        from bench.watch_mix import main as watch_mix_main

        return watch_mix_main(rest)
    if command == "http-retain":
        from bench.http_retain import main as http_retain_main

        return http_retain_main(rest)
    if command == "warmup":
        from bench.warmup import main as warmup_main

        return warmup_main(rest)
    if command == "gpu":
        from bench.gpu import main as gpu_main

        return gpu_main(rest)
    if command == "gpu-serve":
        from bench.gpu_serve import main as gpu_serve_main

        return gpu_serve_main(rest)
    if command == "loadmodel":
        from bench.loadmodel import main as loadmodel_main

        return loadmodel_main(rest)
    print(f"unknown benchmark {command!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
