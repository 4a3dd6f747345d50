"""What ``snapshot_signing_key`` costs a session file: write, read + verify, and the HMAC's throughput.

Used by ``python -m bench park`` (its "snapshot signing" rows): the tensors and metadata of a real spilled session
(the preset's size) and, with ``--signing-gib``, a synthetic record of that many GiB of bfloat16 tensors (the size
class of a 480p window on the released model; the service path on this CPU cannot make one that big). Each is
written with ``app.persistence.records.write_record`` (temporary file, fsync, rename, as a spill writes it) and read
back with ``models.snapshot.read_tensors``, then checked with ``verify`` when signed: the two steps of
``load_record`` that signing changes. Signed and unsigned alternate within each round (the first of a round takes
turns), so a drift of the disk or the page cache falls on both. The file just written is read from the page cache:
the read figure is the hash's share at its largest. safetensors maps the file: an unsigned read touches none of
its bytes (a load pages them in later, as the session is used), a signed one reads every byte to verify it, so
"what signing adds" to a read is the page-in plus the hash. It reports; it never asserts.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from app.persistence.records import host_session, load_record, read_record, record_from_tensors, write_record
from models.snapshot import read_tensors, signature, verify

BENCH_KEY = b"bench-signing-key-of-32-or-more-characters"
RECORD_ID = "bench-signing-record"  # a valid session id (spec.check_session_id): write_record names the file so


def record_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of tensor data in a record (what the HMAC reads besides its small JSON header)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def synthetic_record(gib: float, layers: int = 28) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``gib`` GiB of bfloat16 tensors shaped like a KV cache: a key and a value per layer, (tokens, channels)
    each. Random bits: nothing in the hash or the file depends on the values, and zeros could compress on a
    file system that does."""
    channels = 2048
    per_tensor = int(gib * 2**30) // (2 * layers)  # bytes of one layer's key (or value)
    tokens = max(1, per_tensor // (channels * 2))  # bfloat16: 2 bytes an element
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for part in ("key", "value"):
            # (tokens, channels) int16 random bits viewed as bfloat16: randint is cheaper than randn at 1 GiB
            bits = torch.randint(-(2**15), 2**15, (tokens, channels), dtype=torch.int16, generator=generator)
            tensors[f"cache.{layer}.{part}"] = bits.view(torch.bfloat16)
    return tensors, {"format": "bench-synthetic"}


def measure(tensors: dict[str, torch.Tensor], metadata: dict[str, str], folder: Path, rounds: int
            ) -> dict[str, dict[str, list[float]]]:
    """Seconds per write and per read (+ verify), signed and unsigned, and per HMAC alone, over ``rounds``."""
    figures = {kind: {"write": [], "read": []} for kind in ("unsigned", "signed")}
    hashing: list[float] = []
    for round_index in range(rounds):
        order = (None, BENCH_KEY) if round_index % 2 == 0 else (BENCH_KEY, None)
        for key in order:
            kind = "unsigned" if key is None else "signed"
            began = time.perf_counter()
            path = write_record(folder, RECORD_ID, tensors, metadata, key=key)
            figures[kind]["write"].append(time.perf_counter() - began)
            began = time.perf_counter()
            read, read_metadata = read_tensors(path)
            if key is not None:
                verify(key, read, read_metadata, path.name)
            figures[kind]["read"].append(time.perf_counter() - began)
            del read
        began = time.perf_counter()
        signature(BENCH_KEY, tensors, metadata)
        hashing.append(time.perf_counter() - began)
    figures["hmac"] = {"sign": hashing}
    return figures


def format_rows(name: str, tensors: dict[str, torch.Tensor], figures: dict[str, dict[str, list[float]]]) -> list[str]:
    """Rows of the "snapshot signing" table for one record: p50 ms of each step unsigned and signed, what signing
    adds (ms) and the ratio; then the HMAC alone (``signature``): its p50 ms in the signed column and its
    throughput (tensor bytes / that time) in GB/s."""
    size = record_bytes(tensors)
    p50 = {kind: {step: statistics.median(values) for step, values in steps.items()}
           for kind, steps in figures.items()}
    hmac_s = p50["hmac"]["sign"]
    rows = []
    for step in ("write", "read"):
        unsigned, signed = p50["unsigned"][step], p50["signed"][step]
        label = "write" if step == "write" else "read+verify"
        rows.append(f"signing {label:11s} {name:10s} {size:>14,d} {1000 * unsigned:10.2f} {1000 * signed:10.2f} "
                    f"{1000 * (signed - unsigned):+10.2f} {signed / unsigned:7.2f}x {len(figures['signed'][step]):3d}")
    rows.append(f"signing hmac        {name:10s} {size:>14,d} {'':10s} {1000 * hmac_s:10.2f} "
                f"{size / hmac_s / 1e9:10.2f} GB/s")
    return rows


def engine_time(tensors: dict[str, torch.Tensor], metadata: dict[str, str], session_id: str, folder: Path, refiner,
                stages, on_engine, rounds: int) -> dict[str, list[float]]:
    """Seconds the engine thread spends adopting the session file ``tensors``/``metadata`` signed, three ways, each
    a step of its history: ``all``, all of ``load_record`` on it (read, verify, build: the first adoption);
    ``build``, only ``record_from_tensors`` there, building the session from what ``read_record`` (read + verify)
    read first on this thread (the adoption after "Snapshot signing"); ``move``, the session built in host memory
    on this thread too (``host_session``), the engine thread only checking the record and queuing the move to the
    model's device (the adoption now; nothing to move on the CPU). ``on_engine(fn)``: runs ``fn`` on the engine
    thread and returns its result. In turn, the order rotating each round, as ``measure`` alternates."""
    path = write_record(folder, session_id, tensors, metadata, key=BENCH_KEY)
    kinds = ("all", "build", "move")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_index in range(rounds):
        for kind in kinds[round_index % 3:] + kinds[:round_index % 3]:
            if kind == "all":
                began = time.perf_counter()
                on_engine(lambda: load_record(path, refiner, stages, session_id, key=BENCH_KEY))
            else:
                read, read_metadata = read_record(path, refiner, key=BENCH_KEY)
                built = host_session(refiner, read, read_metadata) if kind == "move" else None
                began = time.perf_counter()
                on_engine(lambda: record_from_tensors(path, read, read_metadata, refiner, stages, session_id, built))
            times[kind].append(time.perf_counter() - began)
    return times
