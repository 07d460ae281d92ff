"""Which reference model runs which checkpoint, and the ``model=`` factory for rayload.

``MODELS`` maps ``config.json`` ``architectures[0]`` to the module class; one class per
architecture, no class re-branching on the name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rayload.loading.model import ModelContext
from rayload.models.architectures import (
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)
from rayload.models.base import CausalLM
from rayload.models.config import UnsupportedModelError
from rayload.models.gpt2 import GPT2LMHeadModel
from rayload.models.layers import TensorParallel

MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}
"""``architectures[0]`` -> reference model class."""


def model_class(config: Mapping[str, Any]) -> type[CausalLM]:
    """The class for ``config``'s ``architectures[0]``."""
    architectures = config.get("architectures") or []
    if not architectures:
        raise UnsupportedModelError(
            "config.json has no 'architectures': cannot choose a reference model "
            f"(known: {sorted(MODELS)})"
        )
    try:
        return MODELS[architectures[0]]
    except KeyError:
        raise UnsupportedModelError(
            f"no reference model for architecture {architectures[0]!r}; known: {sorted(MODELS)}"
        ) from None


def build_model(context: ModelContext) -> torch.nn.Module:
    """rayload's ``model=`` factory: the rank's reference model, built on the meta device.

    Every parameter is an uninitialized meta placeholder with the shape of the rank's
    shard (see :class:`rayload.models.base.CausalLM` for the names); the loader replaces
    each by the shard tensor on ``context.device``. ``context.process_group`` combines the
    ranks' results (None: torch's default group, needed only for ``tp_size > 1``).
    ``context.expert_parallel``: the MoE layers hold the rank's block of experts whole
    instead of a slice of every expert (ignored by dense families).
    """
    cls = model_class(context.config)
    tp = TensorParallel(
        context.rank,
        context.tp_size,
        context.process_group,
        expert_parallel=context.expert_parallel,
    )
    with torch.device("meta"):
        return cls(context.config, tp)
