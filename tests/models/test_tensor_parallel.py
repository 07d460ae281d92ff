"""The headline check: tp 2 and 4 real rank processes (gloo), each holding only the shards
rayload's ``load_rank`` gives it, filled into the reference model by rayload's
``fill_model``, produce transformers' logits, and the same full-vocab logits on every rank.

tp 4 on ``llama_gqa``, ``qwen2`` and ``phi3`` (2 kv heads) is the case where each kv head
is replicated over two ranks. The MoE families also run expert parallel: each rank holds
its block of whole experts (4 experts: 2 per rank at tp 2, 1 at tp 4) and the ranks' routed
outputs are summed (with Qwen2-MoE's split shared expert) in the block's all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from models.tp_processes import RankPool
from support.transformers_models import FAMILIES, MOE_FAMILIES, Reference

TOLERANCE = 1e-4

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rank_processes_match_transformers(
    family: str,
    tp: int,
    reference: Callable[[str], Reference],
    rank_pool: Callable[[int], RankPool],
) -> None:
    ref = reference(family)
    logits = rank_pool(tp).run(ref.path, ref.input_ids)
    assert (logits[0] - ref.logits).abs().max().item() <= TOLERANCE
    for rank_logits in logits[1:]:
        assert rank_logits.equal(logits[0])


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_parallel_rank_processes_match_transformers(
    family: str,
    tp: int,
    reference: Callable[[str], Reference],
    rank_pool: Callable[[int], RankPool],
) -> None:
    ref = reference(family)
    logits = rank_pool(tp).run(ref.path, ref.input_ids, expert_parallel=True)
    assert (logits[0] - ref.logits).abs().max().item() <= TOLERANCE
    for rank_logits in logits[1:]:
        assert rank_logits.equal(logits[0])
