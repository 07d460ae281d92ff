"""Timing the tracing work of a load on real rank reports (no Ray: ranks run in-process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rayload.benchmark.targets import targets
from rayload.benchmark.tracecost import STEPS, cost_fractions, tracing_cost
from rayload.loading import load_rank
from rayload.loading.report import RankReport


@pytest.fixture(scope="module")
def reports(bench_checkpoint: Path) -> list[RankReport]:
    return [load_rank(bench_checkpoint, rank, 2)[1] for rank in range(2)]


def test_tracing_cost_times_every_step_on_all_spans_of_the_load(
    reports: list[RankReport],
) -> None:
    cost = tracing_cost(reports, repeat=3)
    assert all(cost[step] > 0 for step in STEPS)
    assert cost["critical_path_s"] == pytest.approx(sum(cost[s] for s in STEPS))
    assert cost["rank_payload_s"] <= cost["rank_payload_max_s"]
    # root, prepare, connect, placement, one spawn per rank; rank.load + phases per rank
    assert cost["spans"] == 4 + 2 + sum(1 + len(r.phases) for r in reports)


def test_tracing_cost_refuses_a_load_without_reports() -> None:
    with pytest.raises(ValueError, match="rank reports"):
        tracing_cost([])


def test_cost_fractions_divide_the_critical_path_by_load_and_model_loading() -> None:
    fractions = cost_fractions(
        {"critical_path_s": 0.02}, {"wall_s": 8.0, "total_model_loading_seconds": 0.4}
    )
    assert fractions == pytest.approx({"pct_of_load": 0.25, "pct_of_model_loading": 5.0})


def _breakdown(pct_of_load: float) -> dict[str, Any]:
    return {
        "trace_overhead_pct": 6.0,
        "wall_s_spread_without": [7.0, 14.0],
        "without_trace_files": {"wall_s": 8.0},
        "tracing": {
            "critical_path_s": 0.02,
            "pct_of_load": pct_of_load,
            "pct_of_model_loading": 5.0,
        },
    }


@pytest.mark.parametrize("pct, met", [(0.25, True), (3.5, False)])
def test_tracing_target_is_judged_on_the_timed_work_not_the_noisy_difference(
    pct: float, met: bool
) -> None:
    found = {t.name: t for t in targets([], tp=2, load_breakdown=_breakdown(pct))}
    assert found["tracing overhead on rayload.load"].met is met
    cross = found["trace files on vs off, whole rayload.load (cross-check)"]
    assert (cross.met, cross.measured) == (None, "+6.0%")
    assert "88%" in cross.note  # (14 - 7) / 8
