"""Expert parallel over the rank actors: ``rayload.load(..., expert_parallel=True,
model=build_model)`` gives each rank only its block of whole experts, the reference model
built with ``context.expert_parallel`` runs one forward over the load's gloo group, and
its logits equal ``transformers``' unsharded forward of the same checkpoint.

Both checkpoints have 4 experts: 2 per rank at tp 2, 1 at tp 4. Besides the logits, each
rank's tensors name only its experts, its expert bytes are 1/tp of all experts' (counted
from the checkpoint's header, not from the plan), everything else is planned exactly as
under tensor parallel, and the scratch reader read what the plan says (plus at most the
gaps between the strided rows it gathers).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import ray
import torch

import rayload
from rayload.actors.messages import RankState
from rayload.loading import open_checkpoint, plan_shards
from rayload.loading.plan import RankPlan, TensorShard
from rayload.models import build_model
from support.transformers_models import EXPERTS, Reference, expert_id

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

# The rank actors cannot import this test module: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAMILIES = ("mixtral", "qwen3_moe")
TOLERANCE = 1e-4


def _forward(state: RankState, input_ids: torch.Tensor) -> dict[str, Any]:
    """One forward on this rank (every rank runs it at once: the collectives pair up), and
    the bytes of each tensor the rank holds."""
    with torch.no_grad():
        logits = state.model(input_ids)
    held = {n: t.numel() * t.element_size() for n, t in state.tensors.items()}
    return {"rank": state.rank, "logits": logits, "held": held}


def _span(shard: TensorShard) -> int:
    """The file bytes from the shard's first byte to its last (its rows and the gaps)."""
    return max(r.offset + r.length for r in shard.ranges) - min(r.offset for r in shard.ranges)


def _dense_bytes(rank: RankPlan) -> int:
    """The plan's bytes for the rank's tensors that are no routed expert's."""
    return sum(s.nbytes for s in rank.shards if expert_id(s.name) is None)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_forward_over_rank_actors_equals_transformers(
    reference: Callable[[str], Reference], family: str, tp: int, no_leaks: object
) -> None:
    ref = reference(family)
    with rayload.load(
        ref.path,
        tp_size=tp,
        method="scratch",
        device="cpu",
        model=build_model,
        expert_parallel=True,
        timeout=180,
    ) as result:
        outputs = result.apply(_forward, ref.input_ids)
        plan, reports = result.plan, result.ranks
    per = EXPERTS // tp
    all_expert_bytes = sum(
        t.nbytes for n, t in open_checkpoint(ref.path).tensors.items() if expert_id(n) is not None
    )
    tp_plan = plan_shards(ref.path, tp)
    assert [o["rank"] for o in outputs] == list(range(tp))
    for rank, output in enumerate(outputs):
        diff = (output["logits"] - ref.logits).abs().max().item()
        assert diff <= TOLERANCE, f"{family} tp={tp} rank {rank}: max |diff| {diff}"
        experts = {n: size for n, size in output["held"].items() if expert_id(n) is not None}
        assert {expert_id(n) for n in experts} == set(range(rank * per, (rank + 1) * per))
        assert sum(experts.values()) * tp == all_expert_bytes
        dense = _dense_bytes(plan.ranks[rank])
        assert plan.ranks[rank].nbytes - dense == sum(experts.values())
        assert dense == _dense_bytes(tp_plan.ranks[rank])
        planned = sum(s.nbytes for s in plan.ranks[rank].shards)
        assert planned == plan.ranks[rank].nbytes
        gathered = sum(_span(s) for s in plan.ranks[rank].shards)
        assert planned <= reports[rank].bytes_read <= gathered, (
            f"rank {rank} read {reports[rank].bytes_read} bytes, planned {planned}"
        )
