"""The harness on a tiny Mixtral: plain TP, expert parallel and every expert whole side by
side, what each rank holds and reads, and the expert targets (no timing assertions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rayload.benchmark import BenchConfig, write_report
from rayload.benchmark.cases import CASES

LAYOUT = {"scratch": "tp", "scratch_ep": "ep", "whole_experts": "whole_experts"}


def _plans(result: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(p["layout"], p["tp_size"]): p for p in result["checkpoint"]["layouts"]}


def test_moe_cases_run_side_by_side_in_every_cache_state(
    moe_result: dict[str, Any], moe_config: BenchConfig
) -> None:
    assert moe_result["skipped"] == {}
    ran = {(s["case"], s["tp_size"], s["cache"]) for s in moe_result["summary"]}
    assert ran == {
        (case, tp, cache)
        for case in moe_config.methods or ()
        for tp in moe_config.tp_sizes
        for cache in moe_config.caches
    } | {("limit", 1, cache) for cache in moe_config.caches}
    assert all((s["runs"], s["failures"]) == (1, 0) for s in moe_result["summary"])


def test_each_rank_holds_what_its_layout_plans(moe_result: dict[str, Any]) -> None:
    plans = _plans(moe_result)
    for s in moe_result["samples"]:
        if CASES[s["case"]].kind == "limit":
            continue
        plan = plans[(CASES[s["case"]].layout, s["tp_size"])]
        assert [r["shard_bytes"] for r in s["ranks"]] == plan["rank_bytes"], s["case"]


def test_bytes_read_follow_the_layouts(moe_result: dict[str, Any], moe_config: BenchConfig) -> None:
    plans = _plans(moe_result)
    by = {(s["case"], s["tp_size"], s["cache"]): s for s in moe_result["summary"]}
    for tp in moe_config.tp_sizes:
        every = plans[("ep", tp)]["all_expert_bytes"]
        for cache in ("cold", "warm"):
            ep, whole = by[("scratch_ep", tp, cache)], by[("whole_experts", tp, cache)]
            assert whole["rank_bytes_read"] >= every  # every expert, whole, on each rank
            assert ep["shard_bytes"] <= ep["rank_bytes_read"] < 1.1 * ep["shard_bytes"]
            assert whole["rank_bytes_read"] > 1.8 * ep["rank_bytes_read"]
    for s in moe_result["samples"]:
        for r in s["ranks"]:
            assert r["bytes_read"] >= r["shard_bytes"], (s["case"], r)


def test_expert_targets_compare_ep_with_plain_tp_and_whole_experts(
    moe_result: dict[str, Any],
) -> None:
    targets = {t["name"]: t for t in moe_result["targets"]}
    share = targets["scratch_ep expert bytes per rank (plan, tp=4)"]
    assert (share["threshold"], share["met"]) == ("= all experts' / 4", True)
    assert share["measured"].startswith("1/4.00 ")
    assert share["note"] == "experts by rank: 0-1, 2-3, 4-5, 6-7"
    read = targets["scratch_ep cold bytes read per rank / its shard"]
    assert read["threshold"] == "<= 1.05" and read["met"] in (True, False)
    summary = {(s["case"], s["cache"]): s for s in moe_result["summary"] if s["tp_size"] == 4}
    ratio = (
        summary[("whole_experts", "cold")]["rank_bytes_read"]
        / summary[("scratch_ep", "cold")]["rank_bytes_read"]
    )
    assert targets["whole_experts / scratch_ep cold bytes read per rank"]["measured"] == (
        f"{ratio:.2f}x"
    )
    for cache in ("cold", "warm"):
        for other in ("whole_experts", "scratch"):
            row = targets[f"scratch_ep {cache} vs {other}"]
            speedup = summary[(other, cache)]["wall_s"] / summary[("scratch_ep", cache)]["wall_s"]
            assert row["measured"] == f"{speedup:.2f}x faster" and row["met"] is None
    # only the rows of cases that ran: converted did not
    assert not any(name.startswith("converted") for name in targets)


def test_report_has_the_experts_table(
    moe_result: dict[str, Any], moe_config: BenchConfig, tmp_path: Path
) -> None:
    md = write_report(moe_result, tmp_path)["md"].read_text()
    section = md.split("## Experts: expert parallel, plain TP, every expert whole", 1)[1]
    section = section.split("\n## ", 1)[0]
    for case, layout in LAYOUT.items():
        for tp in moe_config.tp_sizes:
            for cache in moe_config.caches:
                assert f"| {case} | {layout} | {tp} | {cache} |" in section
    every = _plans(moe_result)[("ep", 4)]["all_expert_bytes"]
    assert f"All experts' tensors: {every / (1 << 20):.0f} MB" in section
    assert "to the reference of its layout (ep, tp, whole_experts" in md
