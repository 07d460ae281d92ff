"""The harness on a tiny checkpoint: structure and internal consistency of what it measured
(no timing assertions)."""

from __future__ import annotations

import json
import os
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch

from rayload.benchmark import BenchConfig
from rayload.benchmark.cases import CASES
from rayload.benchmark.runner import balanced_order
from rayload.loading.manifest import MANIFEST_NAME
from rayload.loading.model import MODEL_PHASE
from rayload.loading.report import PHASES

TRACING = "tracing overhead on rayload.load"


def _samples(result: dict[str, Any], case: str) -> list[dict[str, Any]]:
    return [s for s in result["samples"] if s["case"] == case]


def test_every_runnable_case_ran_every_repetition_without_failure(
    bench_result: dict[str, Any], bench_config: BenchConfig
) -> None:
    expected_skips = {"scratch_ep", "whole_experts"}  # a dense model: no experts
    if not torch.cuda.is_available():
        expected_skips.add("fastsafetensors_gdr")
    assert set(bench_result["skipped"]) == expected_skips
    for case in ("scratch_ep", "whole_experts"):
        assert "has no expert tensors" in bench_result["skipped"][case]
    ran = {s["case"] for s in bench_result["summary"]}
    assert ran == set(CASES) - expected_skips
    for s in bench_result["summary"]:
        assert (s["runs"], s["failures"], s["error"]) == (bench_config.repeat, 0, None), s


def test_cases_are_interleaved_by_repetition(bench_result: dict[str, Any]) -> None:
    reps = [s["repetition"] for s in bench_result["samples"]]
    assert reps == sorted(reps)
    assert reps[0] == 0 and reps[-1] == 1


def test_each_repetition_runs_its_row_of_the_balanced_order(bench_result: dict[str, Any]) -> None:
    def order(rep: int, cache: str, per_rank: bool) -> list[str]:
        return [
            s["case"]
            for s in bench_result["samples"]
            if (s["repetition"], s["cache"], CASES[s["case"]].per_rank) == (rep, cache, per_rank)
        ]

    for cache in ("cold", "warm"):
        for per_rank in (False, True):
            first = order(0, cache, per_rank)
            assert len(first) > 1
            table = [c for c in CASES if c in first]  # the cases in table order
            assert first == balanced_order(table, 0)
            assert order(1, cache, per_rank) == balanced_order(table, 1) != first


@pytest.mark.parametrize("n", range(1, 9))
def test_balanced_order_puts_every_case_after_every_other_equally_often(n: int) -> None:
    """A Williams design: over n repetitions (2n when n is odd) each ordered pair of cases
    is adjacent equally often, and each case holds each position equally often."""
    items = list("abcdefgh"[:n])
    reps = 2 * n if n % 2 else n
    orders = [balanced_order(items, rep) for rep in range(reps)]
    assert all(sorted(o) == items for o in orders)
    pairs = Counter(pair for o in orders for pair in pairwise(o))
    assert set(pairs) == {(a, b) for a in items for b in items if a != b}
    assert len(set(pairs.values())) <= 1
    positions = Counter((case, i) for o in orders for i, case in enumerate(o))
    assert set(positions.values()) == {reps // n}
    assert balanced_order(items, reps) == orders[0]  # and then it starts over


def test_all_cases_hand_each_rank_identical_tensors(bench_result: dict[str, Any]) -> None:
    assert bench_result["consistency"] == []
    refs = {(r["layout"], r["rank"]): r["digest"] for r in bench_result["references"]}
    assert set(refs) == {("tp", 0), ("tp", 1)}  # one layout ran: every case is of "tp"
    digests = {
        (s["case"], r["rank"]): r["digest"]
        for s in bench_result["samples"]
        if CASES[s["case"]].kind != "limit"
        for r in s["ranks"]
    }
    assert all(digests.values())
    assert {d for (case, rank), d in digests.items() if rank == 0} == {refs[("tp", 0)]}
    assert digests[("scratch", 0)] != digests[("scratch", 1)]


def test_rank_shard_bytes_match_the_plan(bench_result: dict[str, Any]) -> None:
    plan = bench_result["checkpoint"]["plan_rank_bytes"]["2"]
    for s in bench_result["samples"]:
        if CASES[s["case"]].kind != "limit":
            assert [r["shard_bytes"] for r in s["ranks"]] == plan, s["case"]


def test_cold_cases_start_uncached_and_warm_cases_cached(bench_result: dict[str, Any]) -> None:
    for s in bench_result["samples"]:
        assert s["cached_before"] == (0.0 if s["cache"] == "cold" else 1.0), s["case"]


def test_limits_read_every_checkpoint_byte_once(bench_result: dict[str, Any]) -> None:
    ckpt = bench_result["checkpoint"]
    assert ckpt["bytes"] == sum(os.path.getsize(f) for f in ckpt["files"])
    limits = ("limit", "limit_alloc", "limit_parallel")
    for s in [s for name in limits for s in _samples(bench_result, name)]:
        (rank,) = s["ranks"]
        # rchar also counts the few hundred bytes of reading /proc/self/io itself
        assert ckpt["bytes"] <= rank["rchar_bytes"] < ckpt["bytes"] + 16_384
        assert rank["mapped_bytes"] == 0
    for s in _samples(bench_result, "limit_alloc"):
        assert s["ranks"][0]["rss_peak_delta"] >= ckpt["bytes"]  # new memory for every byte


def test_rank_files_limit_reads_each_ranks_converted_files_once(
    bench_result: dict[str, Any], bench_config: BenchConfig
) -> None:
    [tp] = bench_config.tp_sizes
    name = f"{Path(str(bench_config.checkpoint)).name}-converted-tp{tp}"
    manifest = json.loads((Path(bench_config.workdir) / name / MANIFEST_NAME).read_text())
    rank_bytes = {
        int(rank): sum(manifest["files"][f]["size"] for f in files)
        for rank, files in manifest["ranks"].items()
    }
    samples = _samples(bench_result, "limit_rank_files")
    assert len(samples) == 2 * bench_config.repeat  # cold and warm
    for s in samples:
        assert [r["rank"] for r in s["ranks"]] == list(range(tp))
        for r in s["ranks"]:
            want = rank_bytes[r["rank"]]
            assert want <= r["rchar_bytes"] < want + 16_384, r  # + the manifest and /proc


def test_bytes_read_cover_what_each_reader_must_read(bench_result: dict[str, Any]) -> None:
    ckpt_bytes = bench_result["checkpoint"]["bytes"]
    for s in bench_result["samples"]:
        for r in s["ranks"]:
            assert r["bytes_read"] >= r["shard_bytes"], (s["case"], r)
    for case in ("safe_open_slice", "load_file_slice"):
        for s in _samples(bench_result, case):
            assert all(r["mapped_bytes"] > 0 for r in s["ranks"]), case
    for s in _samples(bench_result, "fastsafetensors_whole"):
        assert all(r["rchar_bytes"] >= ckpt_bytes * 0.99 for r in s["ranks"])


def test_peak_rss_covers_the_resident_shard(bench_result: dict[str, Any]) -> None:
    for s in bench_result["samples"]:
        for r in s["ranks"]:
            assert r["host_shard_bytes"] == r["shard_bytes"], (s["case"], r)  # a CPU run
            assert r["rss_peak_delta"] >= r["shard_bytes"] - 4096, (s["case"], r)
    assert bench_result["baseline_rss"] > 50 << 20  # python + torch


def test_rayload_cases_report_the_method_that_ran(bench_result: dict[str, Any]) -> None:
    for s in bench_result["summary"]:
        if CASES[s["case"]].kind == "rayload":
            assert s["effective"] == [CASES[s["case"]].method]
        else:
            assert s["effective"] == []


def test_rayload_ranks_report_their_phases_within_their_wall_time(
    bench_result: dict[str, Any],
) -> None:
    for s in bench_result["samples"]:
        for r in s["ranks"]:
            if CASES[s["case"]].kind != "rayload":
                assert r["phases"] == {}
                continue
            extra = [MODEL_PHASE] if s["case"] == "scratch_model" else []
            assert list(r["phases"]) == [*PHASES, *extra], s["case"]
            assert 0 < sum(r["phases"].values()) <= r["seconds"]


def test_ratios_refer_to_the_limit_and_peers_of_the_same_cache(
    bench_result: dict[str, Any],
) -> None:
    by = {(s["case"], s["tp_size"], s["cache"]): s for s in bench_result["summary"]}
    for (case, tp, cache), s in by.items():
        limit, alloc = by[("limit", 1, cache)], by[("limit_alloc", 1, cache)]
        assert abs(s["x_limit"] - s["wall_s"] / limit["wall_s"]) < 1e-9
        assert abs(s["x_limit_alloc"] - s["wall_s"] / alloc["wall_s"]) < 1e-9
        if CASES[case].per_rank and case != "safe_open_slice":
            peer = by[("safe_open_slice", tp, cache)]
            assert abs(s["speedup"]["safe_open_slice"] - peer["wall_s"] / s["wall_s"]) < 1e-9
        assert s["wall_s_min"] <= s["wall_s"] <= s["wall_s_max"]


def test_targets_are_evaluated_for_the_largest_tp(bench_result: dict[str, Any]) -> None:
    names = {t["name"]: t for t in bench_result["targets"]}
    assert names["scratch cold vs limit"]["met"] in (True, False)
    assert names["converted warm peak RSS per rank"]["met"] in (True, False)
    assert all(t["measured"] != "not measured" for t in names.values() if t["name"] != TRACING)
    assert names[TRACING]["met"] is None  # startup=False here


def test_peer_targets_say_how_much_faster_the_fastest_limit_ran(
    bench_result: dict[str, Any],
) -> None:
    """A missed speedup target comes with the speedup the disk itself allowed that run."""
    cold = [s for s in bench_result["summary"] if s["cache"] == "cold"]
    fastest = min((s for s in cold if CASES[s["case"]].kind == "limit"), key=lambda s: s["wall_s"])
    tp = max(s["tp_size"] for s in cold)
    names = {t["name"]: t for t in bench_result["targets"]}
    for peer in ("safe_open_slice", "fastsafetensors_whole"):
        [p] = [s for s in cold if (s["case"], s["tp_size"]) == (peer, tp)]
        said = f"{fastest['case']} ran {p['wall_s'] / fastest['wall_s']:.2f}x faster than {peer}"
        assert names[f"scratch cold vs {peer}"]["note"] == said


def test_cold_limit_targets_say_what_plain_reads_in_parallel_took(
    bench_result: dict[str, Any],
) -> None:
    """A reader running N streams at once cannot beat N plain streams: the cold target
    against the one-stream limit carries what the disk gave such streams in that run."""
    cold = {(s["case"], s["tp_size"]): s for s in bench_result["summary"] if s["cache"] == "cold"}
    tp = max(t for _, t in cold)
    names = {t["name"]: t for t in bench_result["targets"]}
    for case, own in (("scratch", ("limit_parallel", 1)), ("converted", ("limit_rank_files", tp))):
        said = f"{own[0]} took {cold[own]['x_limit']:.2f}x limit"
        assert names[f"{case} cold vs limit"]["note"] == said


def test_amplification_by_kind_covers_both_kinds_and_rayload_cases(
    bench_result: dict[str, Any],
) -> None:
    rows = bench_result["amplification_by_kind"]
    assert {(r["kind"], r["case"]) for r in rows} >= {
        (kind, case)
        for kind in ("split 0 + replicated", "split 1")
        for case in ("scratch", "converted")
    }
    for r in rows:
        assert r["error"] is None, r
        assert len(r["bytes_read"]) == len(r["plan_bytes"]) == r["tp_size"]
        assert all(got >= need for got, need in zip(r["bytes_read"], r["plan_bytes"], strict=True))
        assert r["amplification"] == round(
            max(g / n for g, n in zip(r["bytes_read"], r["plan_bytes"], strict=True)), 4
        )
    names = {t["name"] for t in bench_result["targets"]}
    assert "scratch read amplification, split 0 + replicated (tp=2)" in names
