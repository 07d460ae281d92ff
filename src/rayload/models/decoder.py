"""The Llama-style decoder every supported family but GPT-2 shares: pre-norm RMSNorm
blocks, rotary attention with grouped kv heads, a gated MLP or a sparse mixture of experts.

What differs between families is data, a :class:`DecoderSpec` each architecture reads
from ``config.json`` (``architectures.py``), not a branch on the architecture's name here.

Module tree (= parameter names): ``model.embed_tokens``, ``model.layers.N.{input_layernorm,
self_attn.{qkv_proj,o_proj[,q_norm,k_norm]}, post_attention_layernorm, mlp | <moe block>}``,
``model.norm``, and ``lm_head`` unless the embedding is tied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from rayload.models.base import GATE_UP_MAPPING, QKV_MAPPING, CausalLM, StackedParamsMapping
from rayload.models.config import (
    Activation,
    AttentionHeads,
    activation,
    config_dtype,
    require,
    tie_word_embeddings,
)
from rayload.models.feedforward import GatedMLP, MoeSpec, SparseMoe
from rayload.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    causal_attention,
    logits_from,
)
from rayload.models.rotary import Rotary, apply_rotary


@dataclass(frozen=True)
class DecoderSpec:
    """What one architecture's decoder has beyond Llama's defaults.

    ``qkv_bias`` / ``o_bias``: biases on the q, k, v (split like their weights) and o
    (replicated, added after the all-reduce) projections; ``mlp_bias``: biases on
    gate / up (split) and down (replicated); ``qk_norm``: Qwen3's per-head RMSNorm of q and
    k before RoPE; ``moe``: the experts, None for a dense MLP in every layer;
    ``moe_block``: the name of a sparse layer's block (``mlp``, or Mixtral's
    ``block_sparse_moe``).
    """

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    moe: MoeSpec | None = None
    moe_block: str = "mlp"


@dataclass(frozen=True)
class _Dims:
    """The sizes every layer needs, read once from the config."""

    hidden: int
    intermediate: int
    heads: AttentionHeads
    eps: float
    act: Activation
    dtype: torch.dtype


class Attention(nn.Module):
    """Rotary self-attention over the rank's heads: ``qkv_proj`` stacks the rank's q, k
    and v rows; ``o_proj`` holds the rank's columns and is all-reduced."""

    def __init__(self, dims: _Dims, spec: DecoderSpec, tp: TensorParallel) -> None:
        super().__init__()
        heads = dims.heads
        self.heads = heads
        self.scaling = heads.head_dim**-0.5
        self.qkv_proj = ColumnParallelLinear(
            dims.hidden, heads.q_size + 2 * heads.kv_size, bias=spec.qkv_bias, dtype=dims.dtype
        )
        self.o_proj = RowParallelLinear(
            heads.q_size, dims.hidden, tp, bias=spec.o_bias, dtype=dims.dtype
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(heads.head_dim, eps=dims.eps, dtype=dims.dtype)
            self.k_norm = RMSNorm(heads.head_dim, eps=dims.eps, dtype=dims.dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.heads
        q, k, v = self.qkv_proj(x).split([h.q_size, h.kv_size, h.kv_size], dim=-1)
        q = q.view(batch, seq, h.local_heads, h.head_dim)
        k = k.view(batch, seq, h.local_kv_heads, h.head_dim)
        v = v.view(batch, seq, h.local_kv_heads, h.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        out = causal_attention(q, k, v.transpose(1, 2), scaling=self.scaling)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``x + ffn(norm(x))``; the feed-forward block is
    registered under ``mlp`` or the spec's ``moe_block``."""

    def __init__(self, dims: _Dims, spec: DecoderSpec, tp: TensorParallel, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden, eps=dims.eps, dtype=dims.dtype)
        self.self_attn = Attention(dims, spec, tp)
        self.post_attention_layernorm = RMSNorm(dims.hidden, eps=dims.eps, dtype=dims.dtype)
        ffn: nn.Module
        if spec.moe is not None and spec.moe.is_sparse(layer):
            self.ffn_name = spec.moe_block
            ffn = SparseMoe(dims.hidden, spec.moe, tp, dims.act, dtype=dims.dtype)
        else:
            self.ffn_name = "mlp"
            ffn = GatedMLP(
                dims.hidden, dims.intermediate, tp, dims.act, bias=spec.mlp_bias, dtype=dims.dtype
            )
        self.add_module(self.ffn_name, ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        ffn = self.get_submodule(self.ffn_name)
        return x + ffn(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """``embed_tokens``, ``layers``, ``norm``: the hidden states before the LM head."""

    def __init__(
        self, dims: _Dims, spec: DecoderSpec, tp: TensorParallel, config: Mapping[str, Any]
    ) -> None:
        super().__init__()
        vocab = int(require(config, "vocab_size"))
        self.embed_tokens = VocabParallelEmbedding(vocab, dims.hidden, tp, dtype=dims.dtype)
        layers = int(require(config, "num_hidden_layers"))
        self.layers = nn.ModuleList(DecoderLayer(dims, spec, tp, i) for i in range(layers))
        self.norm = RMSNorm(dims.hidden, eps=dims.eps, dtype=dims.dtype)
        self.rotary = Rotary.from_config(config, dims.heads.head_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(input_ids.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class DecoderForCausalLM(CausalLM):
    """A Llama-style causal LM for one rank; subclasses override :meth:`spec` (and
    :attr:`stacked_params_mapping` when the checkpoint's names differ)."""

    stacked_params_mapping: ClassVar[StackedParamsMapping] = QKV_MAPPING + GATE_UP_MAPPING

    @classmethod
    def spec(cls, config: Mapping[str, Any]) -> DecoderSpec:
        """The architecture's features, read from its config."""
        return DecoderSpec()

    def __init__(self, config: Mapping[str, Any], tp: TensorParallel | None = None) -> None:
        super().__init__(config, tp)
        config = self.config
        heads = AttentionHeads.from_config(config, self.tp.size)
        dims = _Dims(
            hidden=int(require(config, "hidden_size")),
            intermediate=int(require(config, "intermediate_size")),
            heads=heads,
            eps=float(config.get("rms_norm_eps", 1e-6)),
            act=activation(str(config.get("hidden_act", "silu"))),
            dtype=config_dtype(config),
        )
        spec = self.spec(config)
        self.model = DecoderModel(dims, spec, self.tp, config)
        self.lm_head: ParallelLMHead | None = None
        if not tie_word_embeddings(config):
            vocab = int(require(config, "vocab_size"))
            self.lm_head = ParallelLMHead(vocab, dims.hidden, self.tp, dtype=dims.dtype)

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return logits_from(hidden, self.model.embed_tokens.weight, self.tp)
