"""The Llama-style architectures, one small class each: its :class:`DecoderSpec` from
``config.json`` and, where the checkpoint's names differ, its ``stacked_params_mapping``.

Each follows the transformers modeling file of the same name (``modeling_llama.py``,
``modeling_qwen2.py``, ...), which is the oracle its tests compare against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rayload.models.base import QKV_MAPPING, StackedParamsMapping
from rayload.models.config import require
from rayload.models.decoder import DecoderForCausalLM, DecoderSpec
from rayload.models.feedforward import MoeSpec


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama: ``attention_bias`` on q, k, v and o; ``mlp_bias`` on gate, up and down."""

    @classmethod
    def spec(cls, config: Mapping[str, Any]) -> DecoderSpec:
        bias = bool(config.get("attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(config.get("mlp_bias")))


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama without biases (its sliding window is refused past its length)."""


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2: biases on q, k and v (always), none on o."""

    @classmethod
    def spec(cls, config: Mapping[str, Any]) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: per-head RMSNorm of q and k (``q_norm`` / ``k_norm``, replicated) before RoPE;
    ``attention_bias`` on q, k, v and o."""

    @classmethod
    def spec(cls, config: Mapping[str, Any]) -> DecoderSpec:
        bias = bool(config.get("attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=True)


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3: Llama's modules, but the checkpoint already stores ``qkv_proj`` and
    ``gate_up_proj`` fused, so names map one to one (the rank's shard of a fused tensor is
    the concatenation of its q, k, v parts, or of its gate and up parts); RoPE may be
    partial (``partial_rotary_factor``)."""

    stacked_params_mapping: ClassVar[StackedParamsMapping] = ()


def _experts(config: Mapping[str, Any]) -> int:
    """``num_experts``, which transformers 5 writes as ``num_local_experts`` for Qwen3-MoE."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral: every layer a sparse MoE block ``block_sparse_moe`` of experts with their
    checkpoint names ``w1`` / ``w2`` / ``w3`` (not stacked), top-k weights renormalized."""

    stacked_params_mapping: ClassVar[StackedParamsMapping] = QKV_MAPPING

    @classmethod
    def spec(cls, config: Mapping[str, Any]) -> DecoderSpec:
        moe = MoeSpec(
            num_experts=int(require(config, "num_local_experts")),
            top_k=int(require(config, "num_experts_per_tok")),
            intermediate_size=int(require(config, "intermediate_size")),
            normalize_top_k=True,
            mixtral_experts=True,
        )
        return DecoderSpec(moe=moe, moe_block="block_sparse_moe")


def _qwen_moe(config: Mapping[str, Any], shared_intermediate_size: int) -> MoeSpec:
    return MoeSpec(
        num_experts=_experts(config),
        top_k=int(require(config, "num_experts_per_tok")),
        intermediate_size=int(require(config, "moe_intermediate_size")),
        normalize_top_k=bool(config.get("norm_topk_prob", False)),
        shared_intermediate_size=shared_intermediate_size,
        sparse_step=int(config.get("decoder_sparse_step", 1)),
        dense_layers=frozenset(config.get("mlp_only_layers") or ()),
    )


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE: Qwen3's attention, sparse ``mlp`` blocks of gated experts
    (``mlp.experts.E.gate_up_proj`` stacked), dense layers per ``mlp_only_layers`` /
    ``decoder_sparse_step``."""

    @classmethod
    def spec(cls, config: Mapping[str, Any]) -> DecoderSpec:
        bias = bool(config.get("attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=True, moe=_qwen_moe(config, 0))


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """Qwen2-MoE: q, k, v biases (``qkv_bias``), gated experts plus a ``shared_expert``
    weighted by ``sigmoid(shared_expert_gate(x))``."""

    @classmethod
    def spec(cls, config: Mapping[str, Any]) -> DecoderSpec:
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        moe = _qwen_moe(config, shared)
        return DecoderSpec(qkv_bias=bool(config.get("qkv_bias", True)), moe=moe)
