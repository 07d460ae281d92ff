"""Timing whole ``rayload.load`` calls on a real local Ray (in a child interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayload.benchmark.startup import PARTS, measure_startup


@pytest.mark.slow
def test_measure_startup_splits_each_load_into_its_parts(bench_checkpoint: Path) -> None:
    result = measure_startup(str(bench_checkpoint), 2, repeat=1)
    assert result["ray_start_s"] > 0
    runs = result["runs"]
    assert [r["trace_files"] for r in runs] == [False, True]
    for run in runs:
        assert all(run[k] >= 0 for k in PARTS)
        assert run["weight_population_seconds"] <= run["total_model_loading_seconds"]
        parts = (
            run["placement_seconds"]
            + run["actor_startup_seconds"]
            + run["total_model_loading_seconds"]
        )
        assert parts <= run["wall_s"]
        assert run["other_s"] == pytest.approx(run["wall_s"] - parts)
        tracing = run["tracing"]
        assert tracing["pct_of_load"] == pytest.approx(
            100 * tracing["critical_path_s"] / run["wall_s"]
        )
    assert result["tracing"]["critical_path_s"] > 0
    off, on = result["without_trace_files"], result["with_trace_files"]
    assert result["trace_overhead_pct"] == pytest.approx(
        100 * (on["wall_s"] - off["wall_s"]) / off["wall_s"]
    )
