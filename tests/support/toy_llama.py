"""A parameter-only Llama skeleton for ``model=`` tests: the module a TP engine would build
for one rank (vocab-parallel embedding and head, stacked ``qkv_proj`` and
``gate_up_proj``, row-parallel ``o_proj`` and ``down_proj``), no forward pass.

Shapes follow the rules rayload shards a Llama checkpoint with (and vLLM's layers), so
``fill_model`` must fill it exactly from a rank's shards. Ray tests register this module
for pickling by value (``ray.cloudpickle.register_pickle_by_value``): Ray's workers do not
have ``tests/`` on their path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rayload.loading.model import ModelContext

STACKED_PARAMS_MAPPING = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", "0"),
    (".gate_up_proj", ".up_proj", "1"),
)


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class _Linear(nn.Module):
    def __init__(self, rows: int, cols: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(rows, cols, dtype=dtype)


class _Norm(nn.Module):
    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(size, dtype=dtype)


class _Layer(nn.Module):
    def __init__(self, config: Mapping[str, Any], tp: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        kv_heads, inter = config["num_key_value_heads"], config["intermediate_size"]
        head_dim = hidden // heads
        q_rows = heads // tp * head_dim
        kv_rows = max(kv_heads // tp, 1) * head_dim  # KV heads fewer than tp: replicated
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = _Linear(q_rows + 2 * kv_rows, hidden, dtype)
        self.self_attn.o_proj = _Linear(hidden, q_rows, dtype)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = _Linear(2 * (inter // tp), hidden, dtype)
        self.mlp.down_proj = _Linear(hidden, inter // tp, dtype)
        self.input_layernorm = _Norm(hidden, dtype)
        self.post_attention_layernorm = _Norm(hidden, dtype)


class ToyLlama(nn.Module):
    """One rank's parameters of a Llama for ``tp`` ranks (``model.*`` and ``lm_head``)."""

    stacked_params_mapping = STACKED_PARAMS_MAPPING

    def __init__(self, config: Mapping[str, Any], tp: int, dtype: torch.dtype) -> None:
        super().__init__()
        vocab, hidden = config["vocab_size"], config["hidden_size"]
        self.model = nn.Module()
        # Not nn.Embedding: its init on meta imports torch's meta kernels (~1 s per process).
        self.model.embed_tokens = _Linear(vocab // tp, hidden, dtype)
        self.model.layers = nn.ModuleList(
            _Layer(config, tp, dtype) for _ in range(config["num_hidden_layers"])
        )
        self.model.norm = _Norm(hidden, dtype)
        self.lm_head = _Linear(vocab // tp, hidden, dtype)


def toy_llama_on_meta(context: ModelContext) -> ToyLlama:
    """A ``model=`` factory: the rank's :class:`ToyLlama` on the meta device, in bf16 (the
    dtype of the ``tiny_llama`` checkpoint)."""
    layers = context.config["num_hidden_layers"]
    with context.phase("build_skeleton", layers=layers), torch.device("meta"):
        return ToyLlama(context.config, context.tp_size, torch.bfloat16)


def toy_llama_on_device(context: ModelContext) -> ToyLlama:
    """A ``model=`` factory building real (uninitialized) parameters on the rank's device."""
    with torch.device(context.device):
        return ToyLlama(context.config, context.tp_size, torch.bfloat16)
