"""``python -m bench warmup``'s measuring code (dynamo's eager backend here: the plumbing in seconds; the benchmark
itself compiles with inductor, in processes of its own)."""

from __future__ import annotations

import pytest
import torch

from bench.warmup import child


@pytest.mark.parametrize("choice, runs_at, shapes", [("every", 3, 4 * 3), ("powers", 4, 3 * 3)])
def test_a_case_reports_its_warm_up_and_where_a_call_of_one_row_fewer_runs(choice, runs_at, shapes):
    torch._dynamo.reset()
    figures = child("tiny", 4, choice, [(4, 4)], calls=2, backend="eager")
    # 3 token counts at 4x4 (the sink's frame = a 1-frame block, 2 and 3 frames) times the batch sizes.
    assert figures["shapes_count"] == shapes and figures["uncompiled_calls_count"] == 0
    assert (figures["call_rows_count"], figures["call_runs_at_count"]) == (3, runs_at)
    assert figures["warm_up_s"] > 0 and figures["call_s"] > 0 and figures["graphs_count"] > 0
