"""Timing whole ``rayload.load`` calls, the start-up floor and reload, on a real local Ray
(in a child interpreter, started in the background at the session's start). Figures are
checked for shape and consistency, never for speed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rayload.benchmark import write_report
from rayload.benchmark.render import start_up_table
from rayload.benchmark.startfloor import SPAWN_PARTS
from rayload.benchmark.startup import PARTS
from rayload.benchmark.summary import to_jsonable
from rayload.benchmark.targets import start_up_targets, targets
from rayload.tracing import schema
from support.background import BackgroundRuns


@pytest.fixture(scope="module")
def startup_result(background_runs: BackgroundRuns) -> dict[str, Any]:
    """The quick mode: TP 2, one repetition of each measurement, floor included, through
    ``measure_startup`` (startup_script.py, a background run: tests/conftest.py)."""
    done = background_runs.result("startup_result").run
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_measure_startup_splits_each_load_into_its_parts(startup_result: dict[str, Any]) -> None:
    result = startup_result
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


@pytest.mark.slow
def test_measure_startup_adds_the_floor_and_reload_on_the_same_ray(
    startup_result: dict[str, Any],
) -> None:
    su = startup_result["start_up"]
    assert su["tp_size"] == 2
    (run,) = su["runs"]
    assert su["ray_floor_imported_torch"]  # the floor's actors paid for torch's import
    assert run["ray_floor_s"] > 0
    assert run["reload_wall_s"] > 0
    assert run["reload_population_s"] <= run["reload_wall_s"]
    assert run["fresh_population_s"] <= run["fresh_wall_s"]
    assert run["spawn_s"] <= run["fresh_wall_s"]
    assert su["rayload_spawns"] == len(startup_result["runs"]) + 2
    parts = su["spawn_parts"]
    assert set(parts) == {schema.SPAWN_SPAN, *SPAWN_PARTS}
    assert sum(parts[k] for k in SPAWN_PARTS) <= parts[schema.SPAWN_SPAN] * 1.001


@pytest.mark.slow
def test_start_up_table_and_targets_render_in_the_report(
    startup_result: dict[str, Any], bench_result: dict[str, Any], tmp_path: Path
) -> None:
    items = start_up_targets(startup_result["start_up"])
    assert [t.threshold for t in items] == [
        "<= 1.2x floor",
        "<= 1.2x fresh weight population",
        ">= 3x faster",
    ]
    result = {**bench_result, "load_breakdown": startup_result}
    result["targets"] += to_jsonable(items)
    md = write_report(result, tmp_path)["md"].read_text()
    assert "## Start-up" in md
    assert start_up_table(startup_result["start_up"]) in md
    for t in items:
        assert f"| {t.name} | {t.threshold} | {t.measured} |" in md


def test_start_up_targets_read_the_measured_medians() -> None:
    medians = {
        "ray_floor_s": 5.5,
        "fresh_population_s": 0.5,
        "reload_wall_s": 0.5,
        "close_and_fresh_s": 6.0,
    }
    runs = [
        {"spawn_s": 6.0, "second_spawn_s": 5.0, "ray_floor_s": 5.0},
        {"spawn_s": 9.0, "second_spawn_s": 5.5, "ray_floor_s": 5.0},
    ]
    start_up = {
        "tp_size": 4,
        "medians": medians,
        "rayload_spawn_s": 6.0,
        "rayload_spawns": 4,
        "runs": runs,
    }
    spawn, reload, fresh = start_up_targets(start_up)  # per repetition: 1.2, 1.0, 1.8, 1.1
    assert (spawn.measured, spawn.met) == ("1.15x", True)
    assert "(1.20x, 1.00x, 1.80x, 1.10x)" in spawn.note
    assert (reload.measured, reload.met) == ("1.00x", True)
    assert (fresh.measured, fresh.met) == ("12.0x faster", True)
    assert targets([], tp=4, load_breakdown=None)[-1].name.startswith("tracing")


def test_start_up_targets_are_absent_when_not_measured() -> None:
    assert start_up_targets(None) == []
