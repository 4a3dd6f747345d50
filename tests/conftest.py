"""Fixtures shared by every test package."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

# torch.compile's kernel cache (by default shared by every process of the user) keys its entries without the ISA that
# ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA select: a run under an emulated AVX2-only CPU then loads kernels built for
# AVX-512 (or the other way round) and gets NaNs or a crash (seen here). Each test run compiles into a folder of its
# own; servers the tests start inherit it.
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="wm-refiner-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE


def pytest_unconfigure(config):
    shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)


# What ``-m "not slow"`` leaves out of the inner loop (the README's test command and CI still run everything): by
# folder, file or test (``path::name``, all its parameters), with why. Chosen by ``--durations=0`` on 2 cores
# (docs/benchmarks.md, "The test suite").
SLOW_FILES = {
    "tests/bench/": "benchmarks and soaks (real servers, many blocks)",
    "tests/deploy/test_cluster.py": "HAProxy in front of real replicas",
    "tests/app/cli/test_serve_command.py": "starts `python -m app serve` processes",
    "tests/app/runtime/test_restart.py": "restarts real server processes",
    "tests/app/api/test_view_browser.py": "headless Chromium",
    "tests/app/api/test_js_client.py": "headless Chromium",
    "tests/app/api/test_cors.py": "headless Chromium",
    "tests/app/api/test_js_types.py": "tsc and node in subprocesses, headless Chromium",
    "tests/app/api/test_fuzz.py": "schemathesis over every operation",
    "tests/client/test_cli.py": "the CLI in subprocesses and a pseudo-terminal",
    "tests/client/test_packaging.py": "builds wheels",
    "tests/models/test_batching.py": "batch invariance over many mixes of sessions",
    "tests/models/test_invariance.py": "batch invariance over a family of refiner shapes, and under emulated AVX2",
    "tests/models/test_compiled.py": "torch.compile",
    "tests/app/sessions/test_watch.py": "watchers over real streams",
    "tests/app/persistence/test_leases.py": "waits for leases to expire",
    "tests/app/sessions/test_parking.py": "waits for park and spill timers",
    "tests/app/api/test_hardening.py": "hostile clients",
    "tests/app/api/test_hardening_ws.py": "hostile WebSocket clients",
    "tests/app/sessions/test_hardening_v2.py": "hostile clients, 2,000 spilled sessions, writers killed mid-write",
    "tests/app/engine/test_concurrent_sessions.py": "many concurrent sessions against the reference",
    "tests/client/test_durable.py": "kill -9 of server processes",
    "tests/client/test_readme.py": "runs the guides against a live server",
    "tests/client/test_restart.py": "restarts real server processes",
    "tests/client/test_client.py::test_units_over_a_mebibyte_need_max_size_none": "streams units of over 1 MiB",
    "tests/app/engine/test_batching_modes.py::test_sessions_batched_on_a_server_equal_each_alone_for_other_widths":
        "a server per model width",
    "tests/models/test_attention_op.py::test_the_engines_step_compiles_whole_and_its_graph_specialises_on_the_mix":
        "torch.compile of the whole step, once per mix",
    "tests/models/test_plan.py::test_the_released_refiner_is_planned_without_weights": "the released config on meta",
    "tests/app/api/test_spec.py::test_serve_stops_at_start_up_on_a_bad_replica_id": "starts `python -m app serve`",
    "tests/models/test_parity.py::test_cli_refine_equals_reference": "runs `python -m app refine` in a subprocess",
    "tests/models/test_rebased.py::test_rebased_does_not_drift_past_one_hour_in_float32": "an hour of positions",
}


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        test = f"{path}::{item.originalname}"
        if any(path == name or test == name or (name.endswith("/") and path.startswith(name)) for name in SLOW_FILES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP workers spinning against each
    # other make a millisecond forward take seconds.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
