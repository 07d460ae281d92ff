"""rayload.integrations.batches: an engine's rank load in batches of whole files (vLLM's
``load_format="rayload"`` drives it in tests/vllm); the batches, loaded one after the
other, give each rank exactly what one whole load gives it."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from rayload.integrations.batches import file_batches, load_in_batches, merged_report
from rayload.loading import open_checkpoint
from rayload.loading.checkpoint import Checkpoint
from rayload.loading.convert import convert_checkpoint
from rayload.loading.plan import RankPlan
from rayload.loading.rank import load_rank
from rayload.loading.synthetic import write_checkpoint

TP = 2


@pytest.fixture(scope="module")
def five_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("batches") / "ckpt", num_files=5)


def _shares(checkpoint: Checkpoint) -> dict[str, float]:
    shares = dict.fromkeys(checkpoint.files, 0.0)
    for info in checkpoint.tensors.values():
        shares[info.file] += info.nbytes / TP
    return shares


def test_batches_are_runs_of_whole_files_in_order_within_the_budget(five_files: Path) -> None:
    checkpoint = open_checkpoint(five_files)
    shares = _shares(checkpoint)
    sizes = list(shares.values())
    budget = math.ceil(min(a + b for a, b in itertools.pairwise(sizes)))  # two fit, once
    batches = file_batches(checkpoint, TP, budget)
    assert 1 < len(batches) < len(checkpoint.files)
    assert [f for b in batches for f in sorted(b, key=checkpoint.files.index)] == list(
        checkpoint.files
    )
    for batch in batches:
        assert len(batch) == 1 or sum(shares[f] for f in batch) <= budget
    # Adjacent batches could not have been one.
    for before, after in itertools.pairwise(batches):
        assert sum(shares[f] for f in before | after) > budget


def test_no_budget_a_tiny_one_and_a_converted_checkpoint(five_files: Path, tmp_path: Path) -> None:
    checkpoint = open_checkpoint(five_files)
    assert file_batches(checkpoint, TP, 0) == [frozenset(checkpoint.files)]
    assert file_batches(checkpoint, TP, 1) == [frozenset({f}) for f in checkpoint.files]
    converted = open_checkpoint(convert_checkpoint(five_files, tmp_path / "tp2", TP))
    assert file_batches(converted, TP, 1) == [frozenset(converted.files)]


@pytest.mark.parametrize("rank", range(TP))
def test_the_batches_one_after_the_other_load_what_one_load_does(
    five_files: Path, rank: int
) -> None:
    whole, whole_report = load_rank(five_files, rank, TP, "scratch", "cpu")
    checkpoint = open_checkpoint(five_files)
    batches = file_batches(checkpoint, TP, 1)
    adjusted: list[RankPlan] = []

    def adjust(plan: RankPlan, _: Checkpoint) -> RankPlan:
        adjusted.append(plan)
        return plan

    tensors: dict[str, torch.Tensor] = {}
    reports = []
    loads = load_in_batches(
        five_files, rank, TP, 1, method="scratch", device="cpu", adjust_plan=adjust
    )
    for (loaded, report, plan), files in zip(loads, batches, strict=True):
        assert set(loaded).isdisjoint(tensors)
        assert set(loaded) == {s.name for s in plan.shards}
        assert {checkpoint.tensors[name].file for name in loaded} <= files
        tensors |= loaded
        reports.append(report)
    assert len(adjusted) == 1  # planned once, by the first batch; the others cut that plan
    assert tensors.keys() == whole.keys()
    assert all(torch.equal(tensors[n], whole[n]) for n in whole)
    merged = merged_report(reports)
    assert (merged.bytes_read, merged.tensors) == (whole_report.bytes_read, len(whole))
    assert sorted(merged.files) == sorted(whole_report.files)
    assert merged.start_ns == reports[0].start_ns and merged.end_ns == reports[-1].end_ns
    assert [p.name for p in merged.phases].count("rank.read") == len(batches)
    assert [
        p.attributes.get("headers_read") for p in merged.phases if p.name == "rank.resolve"
    ] == [True] + [False] * (len(batches) - 1)  # the checkpoint opened once
    assert merged.method == whole_report.method
