"""The layouts a case can have: what each divides, and the rules behind ``whole_experts``."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayload.benchmark.layouts import (
    EP,
    TP,
    WHOLE_EXPERTS,
    expert_tensors,
    load_options,
    plan_layout,
    summarize_layout,
)
from rayload.errors import ConfigError
from rayload.loading.checkpoint import open_checkpoint


def test_expert_tensors_are_the_w1_w2_w3_of_every_expert(moe_checkpoint: Path) -> None:
    names = expert_tensors(open_checkpoint(moe_checkpoint))
    assert len(names) == 2 * 8 * 3  # layers x experts x (w1, w2, w3)
    assert all(".block_sparse_moe.experts." in n for n in names)


@pytest.mark.parametrize("tp", [2, 4])
def test_whole_experts_replicates_exactly_the_experts(moe_checkpoint: Path, tp: int) -> None:
    ckpt = open_checkpoint(moe_checkpoint)
    experts = expert_tensors(ckpt)
    whole = plan_layout(ckpt, tp, load_options(WHOLE_EXPERTS, ckpt)).splits
    plain = plan_layout(ckpt, tp, load_options(TP, ckpt)).splits
    assert {n for n, split in whole.items() if split != plain[n]} == experts
    assert all(whole[n] is None for n in experts)
    assert {plain[n] for n in experts} == {0, 1}  # without it: every expert split


def test_layout_plans_give_each_rank_its_share_of_the_experts(moe_checkpoint: Path) -> None:
    ckpt = open_checkpoint(moe_checkpoint)
    tp = 4
    plans = {
        layout: summarize_layout(layout, ckpt, tp, load_options(layout, ckpt))
        for layout in (TP, EP, WHOLE_EXPERTS)
    }
    every = plans[TP].all_expert_bytes
    assert every == sum(ckpt.tensors[n].nbytes for n in expert_tensors(ckpt))
    assert plans[TP].expert_bytes == plans[EP].expert_bytes == (every // tp,) * tp
    assert plans[WHOLE_EXPERTS].expert_bytes == (every,) * tp
    assert plans[EP].experts == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plans[EP].rank_bytes == plans[TP].rank_bytes  # 1/tp either way, cut differently
    extra = every - every // tp
    assert plans[WHOLE_EXPERTS].rank_bytes == tuple(b + extra for b in plans[TP].rank_bytes)


@pytest.mark.parametrize("layout", [EP, WHOLE_EXPERTS])
def test_expert_layouts_on_a_dense_model_say_why_not(bench_checkpoint: Path, layout: str) -> None:
    with pytest.raises(ConfigError, match="has no expert tensors"):
        load_options(layout, open_checkpoint(bench_checkpoint))
