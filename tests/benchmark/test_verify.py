"""The cross-case check: each case against the reference of its own layout."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rayload.benchmark.layouts import EP, TP, load_options, plan_layout
from rayload.benchmark.runner import CaseSample
from rayload.benchmark.verify import Outcome, consistency, reference_tensors
from rayload.benchmark.worker import RankSample
from rayload.loading.checkpoint import open_checkpoint

EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _refs(result: dict[str, Any]) -> dict[tuple[str, int, int], Outcome]:
    return {
        (r["layout"], r["tp_size"], r["rank"]): Outcome(r["digest"], r["tensors"], r["shard_bytes"])
        for r in result["references"]
    }


def _as_sample(case: str, sample: dict[str, Any]) -> CaseSample:
    ranks = tuple(
        RankSample(
            r["rank"], digest=r["digest"], tensors=r["tensors"], shard_bytes=r["shard_bytes"]
        )
        for r in sample["ranks"]
    )
    return CaseSample(case, sample["tp_size"], sample["cache"], 0, 0.0, ranks)


def test_every_case_matches_the_reference_of_its_layout(moe_result: dict[str, Any]) -> None:
    assert moe_result["consistency"] == []
    refs = _refs(moe_result)
    assert {layout for layout, _, _ in refs} == {"tp", "ep", "whole_experts"}
    layout_of = {"scratch_ep": "ep", "whole_experts": "whole_experts"}
    for s in moe_result["samples"]:
        if s["case"] == "limit":
            continue
        for r in s["ranks"]:
            ref = refs[(layout_of.get(s["case"], "tp"), s["tp_size"], r["rank"])]
            assert (r["digest"], r["tensors"], r["shard_bytes"]) == (
                ref.digest,
                ref.tensors,
                ref.shard_bytes,
            ), s["case"]


def test_layouts_hand_every_rank_different_tensors(moe_result: dict[str, Any]) -> None:
    """So a case compared with another layout's reference could not pass."""
    refs = _refs(moe_result)
    for tp in {tp for _, tp, _ in refs}:
        for rank in range(tp):
            digests = {refs[(layout, tp, rank)].digest for layout in ("tp", "ep", "whole_experts")}
            assert len(digests) == 3


def test_a_case_checked_against_another_layout_is_a_problem(moe_result: dict[str, Any]) -> None:
    refs = _refs(moe_result)
    [ep] = [s for s in moe_result["samples"] if (s["case"], s["tp_size"]) == ("scratch_ep", 4)][:1]
    assert consistency([_as_sample("scratch_ep", ep)], refs) == []
    problems = consistency([_as_sample("scratch", ep)], refs)  # an EP result where TP belongs
    assert len(problems) == 4  # every rank
    assert problems[0].startswith("tp=4 rank 0 (tp layout): reference ")
    assert f"but scratch#0/{ep['cache']} -> " in problems[0]


def test_a_rank_without_a_reference_is_a_problem(moe_result: dict[str, Any]) -> None:
    [ep] = [s for s in moe_result["samples"] if (s["case"], s["tp_size"]) == ("scratch_ep", 4)][:1]
    [first, *_] = consistency([_as_sample("scratch_ep", ep)], {})
    assert "(ep layout): reference no reference" in first


def test_ep_reference_holds_each_ranks_block_of_experts_whole(moe_checkpoint: Path) -> None:
    ckpt = open_checkpoint(moe_checkpoint)
    full: dict[str, torch.Tensor] = {}
    for path in ckpt.files:
        full.update(load_file(path))
    tp_plan = plan_layout(ckpt, 4, load_options(TP, ckpt))
    ep_plan = plan_layout(ckpt, 4, load_options(EP, ckpt))
    for rank in (0, 3):
        ep = reference_tensors(ep_plan.ranks[rank])
        tp = reference_tensors(tp_plan.ranks[rank])
        experts = {n for n in ep if EXPERT.search(n)}
        assert {int(m[1]) for n in experts if (m := EXPERT.search(n))} == {2 * rank, 2 * rank + 1}
        for name in experts:
            assert torch.equal(ep[name], full[name]), name
        for name in set(ep) - experts:
            assert torch.equal(ep[name], tp[name]), name
        assert set(tp) - set(ep) == {n for n in full if EXPERT.search(n)} - experts
