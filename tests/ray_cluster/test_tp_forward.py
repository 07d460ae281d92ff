"""The shards are a working TP model: ``rayload.load(..., model=build_model)`` fills the
reference TP model on every rank actor, one forward runs over the load's gloo process
group, and its logits equal ``transformers``' own unsharded forward of the same checkpoint.

The reference is a model, not a slice: checkpoints are written by ``transformers``
(``save_pretrained``), the logits come from ``from_pretrained`` on the same directory.
Families: Llama with GQA (2 KV heads, so tp 4 replicates each over 2 ranks), Qwen2 (q/k/v
biases), Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``), GPT-2 (Conv1D) and Mixtral
(experts), each at tp 2 and 4, and Llama at tp 1 too (every family's tp 1 logits are
checked in one process by tests/models/test_reference_models.py: over actors, tp 1 adds
only the actor path, which one family shows).
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
from rayload.models import build_model
from support.transformers_models import Reference

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

# The rank actors cannot import this test module: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAMILIES = ("llama_gqa", "qwen2", "phi3", "gpt2", "mixtral")
TOLERANCE = 1e-4


def _forward(state: RankState, input_ids: torch.Tensor) -> dict[str, Any]:
    """One TP forward on this rank (every rank runs it at once: the collectives pair up)."""
    with torch.no_grad():
        logits = state.model(input_ids)
    return {"rank": state.rank, "logits": logits, "inside": _shards_inside_model(state)}


def _shards_inside_model(state: RankState) -> bool:
    """Every loaded tensor lives in the model's parameters (no second copy of the weights)."""
    storages = {p.untyped_storage().data_ptr() for p in state.model.parameters()}
    return all(t.untyped_storage().data_ptr() in storages for t in state.tensors.values())


CASES = [("llama_gqa", 1)] + [(family, tp) for family in FAMILIES for tp in (2, 4)]


@pytest.mark.parametrize(("family", "tp"), CASES, ids=[f"{f}-tp{t}" for f, t in CASES])
def test_tp_forward_over_rank_actors_equals_transformers(
    reference: Callable[[str], Reference], family: str, tp: int, no_leaks: object
) -> None:
    ref = reference(family)
    with rayload.load(
        ref.path, tp_size=tp, method="scratch", device="cpu", model=build_model, timeout=180
    ) as result:
        assert result.process_group == "gloo"
        outputs = result.apply(_forward, ref.input_ids)
    assert [o["rank"] for o in outputs] == list(range(tp))
    for output in outputs:
        diff = (output["logits"] - ref.logits).abs().max().item()
        assert diff <= TOLERANCE, f"{family} tp={tp} rank {output['rank']}: max |diff| {diff}"
        assert output["inside"], f"{family} tp={tp}: a shard outside the model"
