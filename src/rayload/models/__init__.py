"""Reference tensor-parallel models: small eager forward passes that run on one rank's
shards, to prove that what rayload loads is what a TP engine runs on.

Not an inference engine (no KV cache, no batching of ragged sequences, no kernels): each
model's ``forward(input_ids [batch, seq])`` returns the full-vocab logits
``[batch, seq, vocab]`` on every rank, and the tests hold them to transformers' logits.

::

    from rayload.models import build_model          # a model= factory for rayload
    from rayload.models import MODELS               # "LlamaForCausalLM" -> class

    with torch.device("meta"):
        model = MODELS["LlamaForCausalLM"](config, TensorParallel(rank, tp, group))
    # replace each parameter by the rank's shard, stacked per model.stacked_params_mapping

Shards follow vLLM's convention: whole attention heads per rank (kv heads replicated when
fewer than ranks), column-parallel q/k/v, gate/up and LM head, row-parallel o/down, a
vocab-parallel embedding, everything else replicated. Experts are split like a dense MLP,
or with ``expert_parallel`` (``ModelContext.expert_parallel``, ``TensorParallel(...,
expert_parallel=True)``) divided among the ranks whole: rank ``r`` holds experts
``[r*E/tp, (r+1)*E/tp)`` under their global ids. Parameter names are the checkpoint's,
with q/k/v stacked as ``qkv_proj`` and gate/up as ``gate_up_proj`` as
``stacked_params_mapping`` lists.

Supported ``architectures``: Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen2-MoE,
Qwen3-MoE, GPT-2. A config feature they do not implement raises
:class:`UnsupportedModelError` (a ``ValueError``) naming it.
"""

from __future__ import annotations

from rayload.models.base import CausalLM, StackedParamsMapping
from rayload.models.config import UnsupportedModelError
from rayload.models.layers import TensorParallel
from rayload.models.registry import MODELS, build_model, model_class

__all__ = [
    "MODELS",
    "CausalLM",
    "StackedParamsMapping",
    "TensorParallel",
    "UnsupportedModelError",
    "build_model",
    "model_class",
]
