"""Prometheus metrics on a registry owned by one app, so several apps in one process never share counters.

Names follow Prometheus conventions: ``refiner_`` prefix, base units (seconds, bytes), ``_total`` counters.
No label carries a session id: cardinality stays bounded however many sessions come and go.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# From a tiny model on a CPU (milliseconds) to a 48-layer refiner at 720p (seconds).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.blocks_refined = Counter("refiner_blocks_refined", "Refined blocks delivered to clients", registry=r)
        self.block_latency = Histogram(
            "refiner_block_latency_seconds",
            "Per block: from its first forward being scheduled to its latents being on the host",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_block = Histogram(
            "refiner_time_to_first_block_seconds",
            "Per session: from the arrival of the chunk that completes its first block to that block being final",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.frames_in = Counter("refiner_frames_in", "Latent frames accepted from clients", registry=r)
        self.frames_out = Counter("refiner_frames_out", "Latent frames returned to clients", registry=r)
        self.active_sessions = Gauge("refiner_active_sessions", "Sessions currently held", registry=r)
        self.kv_cache_bytes = Gauge("refiner_kv_cache_bytes", "KV cache (and video decoder state) bytes held by all sessions", registry=r)
        self.batch_rows = Histogram(
            "refiner_batch_rows",
            "Rows (sessions' batches summed) per model call of the engine",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
            registry=r,
        )
        self.model_call_seconds = Histogram(
            "refiner_model_call_seconds",
            "Device time per model call (one forward of every session in the batch): CUDA events on a GPU, read once "
            "the GPU passed them (so a call is observed a call or two late), wall time on a CPU",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_seconds = Histogram(
            "refiner_decode_step_seconds",
            "Engine-thread time per decode step (one pending unit of every session with video; on CUDA the time to "
            "queue it, not the GPU's)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.watch_units_dropped = Counter(
            "refiner_watch_units_dropped", "Units watchers lost because they fell behind", registry=r
        )
        self.checkpoint_seconds = Histogram(
            "refiner_checkpoint_write_seconds", "Per crash checkpoint: serializing and writing it (off the engine)",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.checkpoint_bytes = Counter("refiner_checkpoint_bytes", "Bytes written by crash checkpoints", registry=r)
        self.request_body_bytes_in_flight = Gauge(
            "refiner_request_body_bytes_in_flight",
            "Request-body bytes held across connections while bodies arrive (max_inflight_body_bytes bounds it)",
            registry=r,
        )
        self.engine_queue_depth = Gauge(
            "refiner_engine_queue_depth", "Jobs submitted to the engine and not finished", registry=r
        )
        self.late_blocks = Counter(
            "refiner_late_blocks",
            "Blocks of real-time sessions committed after their deadline (last input frame's arrival + the block's "
            "playback time)", registry=r,
        )
        self.paced_blocks = Counter(
            "refiner_paced_blocks", "Blocks of real-time sessions whose deadline was tracked", registry=r
        )
        self.rejected_requests = Counter(
            "refiner_rejected_requests", "Requests and messages refused, by error code", ["reason"], registry=r
        )
        self.http_request_duration = Histogram(
            "refiner_http_request_duration_seconds",
            "HTTP request latency by route template",
            ["route", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.page_in_seconds = Histogram(
            "refiner_page_in_seconds",
            "Per page-in: from a request finding its session parked or spilled to its copies to the device queued (on "
            "CUDA its next forward waits for them on the device)",
            ["state"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.session_moves = Counter(
            "refiner_session_moves", "Sessions moved between memory states, by the state they moved to", ["to"],
            registry=r,
        )

        self.uncompiled_calls = Counter(
            "refiner_uncompiled_model_calls",
            "With compile_step: model calls at a shape the warm-up did not compile, run eagerly (a latent size not "
            "in warmup_geometries, a block_size/sink_frames other than the defaults, a batch wider than the largest "
            "compiled)", registry=r,
        )

        self.compile_failed = Gauge(
            "refiner_compile_failed",
            "1 when compile_step is on and compiling failed: the step runs eagerly (compile_fallback: eager) or the "
            "server stays unready (fail); 0 otherwise", registry=r,
        )

        self._memory = _MemoryCollector(dict, dict, dict)
        r.register(self._memory)

    def track_memory(self, totals: Callable[[], dict[tuple[str, str], int]], counts: Callable[[], dict[str, int]],
                     report: Callable[[], dict[str, Any]]) -> None:
        """Per-state session bytes (``refiner_session_bytes{state,where}``), counts (``refiner_sessions{state}``)
        and ``/v1/info``'s ``memory`` figures (``report``: the device budget, the device bytes used, the host
        bytes), read at scrape time."""
        self._memory._totals, self._memory._counts, self._memory._report = totals, counts, report

    def track(self, sessions: Callable[[], int], cache_bytes: Callable[[], int], queue: Callable[[], int]) -> None:
        """Read the live values at scrape time instead of keeping gauges in step by hand."""
        self.active_sessions.set_function(sessions)
        self.kv_cache_bytes.set_function(cache_bytes)
        self.engine_queue_depth.set_function(queue)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _MemoryCollector:
    def __init__(self, totals, counts, report):
        self._totals, self._counts, self._report = totals, counts, report

    def describe(self):
        return []

    def collect(self):
        size = GaugeMetricFamily("refiner_session_bytes", "Bytes the sessions hold, by memory state (active, parked, "
                                 "spilled) and where (device, host, disk)", labels=["state", "where"])
        for (state, where), value in sorted(self._totals().items()):
            size.add_metric([state, where], value)
        yield size
        count = GaugeMetricFamily("refiner_sessions", "Sessions by memory state", labels=["state"])
        for state, value in self._counts().items():
            count.add_metric([state], value)
        yield count
        report = self._report()
        families = {
            "device_budget": GaugeMetricFamily("refiner_device_memory_budget_bytes", "device_memory_budget, in bytes "
                                               "(no sample without a budget: a CPU server's default)"),
            "device_used": GaugeMetricFamily("refiner_device_memory_used_bytes", "Device bytes the sessions hold or "
                                             "have reserved (and clips being refined): what admission counts against "
                                             "the budget"),
            "host_used": GaugeMetricFamily("refiner_host_memory_used_bytes", "Host bytes the sessions hold off the "
                                           "device (parked sessions, units kept for a reattach or a repeated seq)"),
        }
        for name, family in families.items():
            if report.get(name) is not None:
                family.add_metric([], report[name])
            yield family
