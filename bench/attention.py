"""``python -m bench attention``: how a batched forward should attend to the sessions' windows.

Each session's window (``[sink | history | block]`` K/V) already sits in its own preallocated buffer
(``models.kv``). Three ways to run one layer's self-attention for a batch of sessions:

- **per session** (what ``models.attention`` does): one SDPA per session over a view of its buffer, no copy;
- **grouped**: sessions whose windows have the same length are stacked (a copy of their windows) and share one
  SDPA call; one call per distinct length;
- **padded**: every window is copied into one tensor padded to the longest, with an additive mask hiding the
  padding, and one SDPA call runs for all.

Measured at the medium refiner's attention shape (6 heads x 64) for equal windows (every session in steady
state) and for mixed ones (sessions whose histories are still filling). Numbers only; nothing is asserted. Padding
also changes a session's bits (the softmax sums over a longer, masked key axis in another order), which is a
second reason the service does not use it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _time(fn, reps: int, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    samples = []
    for _ in range(reps):
        sync()
        began = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def measure(windows_frames: list[int], tokens_per_frame: int = 64, block_frames: int = 3, heads: int = 6,
            head_dim: int = 64, reps: int = 20, device: str = "cpu", dtype: torch.dtype = torch.float32
            ) -> dict[str, float]:
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    dim = heads * head_dim
    capacity = (max(windows_frames) + 1) * tokens_per_frame

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    queries = [rand(1, heads, block_frames * tokens_per_frame, head_dim) for _ in windows_frames]
    buffers = [(rand(1, capacity, dim), rand(1, capacity, dim)) for _ in windows_frames]
    lengths = [frames * tokens_per_frame for frames in windows_frames]

    def heads_first(x):  # (1, N, D) -> (1, A, N, D/A)
        return x.unflatten(2, (heads, -1)).transpose(1, 2)

    def per_session():
        for q, (k, v), n in zip(queries, buffers, lengths):
            F.scaled_dot_product_attention(q, heads_first(k[:, :n]), heads_first(v[:, :n]))

    def grouped():
        by_length: dict[int, list[int]] = {}
        for index, n in enumerate(lengths):
            by_length.setdefault(n, []).append(index)
        for n, members in by_length.items():
            q = torch.cat([queries[i] for i in members])
            k = torch.cat([buffers[i][0][:, :n] for i in members])  # the copy grouping costs
            v = torch.cat([buffers[i][1][:, :n] for i in members])
            F.scaled_dot_product_attention(q, heads_first(k), heads_first(v))

    longest = max(lengths)

    def padded():
        rows = len(lengths)
        k = torch.zeros(rows, longest, dim, device=device, dtype=dtype)
        v = torch.zeros(rows, longest, dim, device=device, dtype=dtype)
        mask = torch.zeros(rows, 1, 1, longest, device=device, dtype=dtype)
        for row, ((bk, bv), n) in enumerate(zip(buffers, lengths)):
            k[row, :n] = bk[0, :n]
            v[row, :n] = bv[0, :n]
            mask[row, ..., n:] = float("-inf")
        F.scaled_dot_product_attention(torch.cat(queries), heads_first(k), heads_first(v), attn_mask=mask)

    return {name: _time(fn, reps, device) for name, fn in (("per session", per_session), ("grouped", grouped),
                                                            ("padded", padded))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens-per-frame", type=int, default=64, help="64 = 8x8 latents; 880 = 720p")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    full = 14  # sink 1 + history 10 + block 3 frames
    cases = {
        "equal windows (steady state)": [full] * args.sessions,
        "mixed windows (histories filling)": [[4, 7, 10, 13, 14][i % 5] for i in range(args.sessions)],
    }
    print(f"## Window attention for {args.sessions} sessions, one layer (6 heads x 64, {args.tokens_per_frame} "
          f"tokens per frame, {args.device} {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads)\n")
    print("| windows | per session | grouped | padded + mask |")
    print("|---|---|---|---|")
    for label, frames in cases.items():
        times = measure(frames, tokens_per_frame=args.tokens_per_frame, device=args.device, dtype=dtype)
        base = times["per session"]
        cells = [f"{times[name] * 1000:.2f} ms ({times[name] / base:.2f}x)" for name in ("per session", "grouped",
                                                                                          "padded")]
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0
