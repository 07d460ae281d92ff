"""GPT-2 (``GPT2LMHeadModel``) for one rank, under its checkpoint's names
(``transformer.wte``, ``transformer.h.N.attn.c_attn``, ...).

GPT-2's ``Conv1D`` stores weights ``[in, out]`` (``y = x W + b``), so column-parallel
layers split dimension 1 and row-parallel ones dimension 0, the transpose of
``nn.Linear``. The rank's ``c_attn`` shard is ``[n_embd, 3 * n_embd / tp]``: its q, k and v
columns (whole heads of each) side by side, and its bias likewise. The LM head is always
tied to ``transformer.wte``; ``transformer.wpe`` and the layer norms are replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rayload.models.base import CausalLM
from rayload.models.config import (
    Activation,
    AttentionHeads,
    UnsupportedModelError,
    activation,
    config_dtype,
    per_rank,
    require,
)
from rayload.models.layers import (
    Conv1DColumnParallel,
    Conv1DRowParallel,
    LayerNorm,
    TensorParallel,
    VocabParallelEmbedding,
    causal_attention,
    empty_param,
    logits_from,
)


class PositionEmbedding(nn.Module):
    """GPT-2's learned, replicated position embedding ``wpe.weight [n_positions, n_embd]``."""

    def __init__(self, positions: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(positions, hidden, dtype=dtype)

    def forward(self, seq_len: int) -> torch.Tensor:
        """The embeddings of positions ``0..seq_len-1``."""
        if seq_len > self.weight.shape[0]:
            raise UnsupportedModelError(
                f"sequence of {seq_len} tokens is longer than n_positions={self.weight.shape[0]}"
            )
        return self.weight[:seq_len]


class GPT2Attention(nn.Module):
    """Multi-head attention over the rank's heads (GPT-2 has no kv grouping, no RoPE)."""

    def __init__(
        self, config: Mapping[str, Any], tp: TensorParallel, layer: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        hidden = int(require(config, "n_embd"))
        self.heads = AttentionHeads.from_config(config, tp.size)
        self.scaling = self.heads.head_dim**-0.5 if config.get("scale_attn_weights", True) else 1.0
        if config.get("scale_attn_by_inverse_layer_idx", False):
            self.scaling /= float(layer + 1)
        self.c_attn = Conv1DColumnParallel(hidden, 3 * self.heads.q_size, dtype=dtype)
        self.c_proj = Conv1DRowParallel(self.heads.q_size, hidden, tp, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.heads
        shape = (batch, seq, h.local_heads, h.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1))
        return self.c_proj(causal_attention(q, k, v, scaling=self.scaling))


class GPT2MLP(nn.Module):
    """``c_proj(act(c_fc(x)))``: ``c_fc`` the rank's columns, ``c_proj`` its rows."""

    def __init__(
        self, hidden: int, inner: int, tp: TensorParallel, act: Activation, dtype: torch.dtype
    ) -> None:
        super().__init__()
        local = per_rank(inner, tp.size, "n_inner")
        self.act = act
        self.c_fc = Conv1DColumnParallel(hidden, local, dtype=dtype)
        self.c_proj = Conv1DRowParallel(local, hidden, tp, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(
        self, config: Mapping[str, Any], tp: TensorParallel, layer: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        hidden = int(require(config, "n_embd"))
        eps = float(config.get("layer_norm_epsilon", 1e-5))
        inner = int(config.get("n_inner") or 4 * hidden)
        act = activation(str(config.get("activation_function", "gelu_new")))
        self.ln_1 = LayerNorm(hidden, eps=eps, dtype=dtype)
        self.attn = GPT2Attention(config, tp, layer, dtype)
        self.ln_2 = LayerNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = GPT2MLP(hidden, inner, tp, act, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Transformer(nn.Module):
    """``wte`` (vocab-parallel), ``wpe`` (replicated), ``h``, ``ln_f``."""

    def __init__(self, config: Mapping[str, Any], tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = int(require(config, "n_embd"))
        vocab = int(require(config, "vocab_size"))
        self.wte = VocabParallelEmbedding(vocab, hidden, tp, dtype=dtype)
        self.wpe = PositionEmbedding(int(require(config, "n_positions")), hidden, dtype)
        layers = int(require(config, "n_layer"))
        self.h = nn.ModuleList(GPT2Block(config, tp, i, dtype) for i in range(layers))
        eps = float(config.get("layer_norm_epsilon", 1e-5))
        self.ln_f = LayerNorm(hidden, eps=eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(input_ids.shape[1])
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(CausalLM):
    """GPT-2 for one rank; the LM head is the (vocab-parallel) ``transformer.wte`` shard."""

    def __init__(self, config: Mapping[str, Any], tp: TensorParallel | None = None) -> None:
        super().__init__(config, tp)
        if self.config.get("add_cross_attention"):
            raise UnsupportedModelError("GPT-2 with add_cross_attention is not implemented")
        self.transformer = GPT2Transformer(self.config, self.tp, config_dtype(self.config))

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer(input_ids)
        return logits_from(hidden, self.transformer.wte.weight, self.tp)
