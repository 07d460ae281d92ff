"""Tiny transformers checkpoints (a few hundred KB each) and their reference logits.

``write_<family>(directory) -> Path`` builds the family's model with
``AutoModelForCausalLM.from_config`` (float32), redraws every weight with a fixed seed at a
scale that makes the logits O(1) (transformers' own init, std 0.02, gives logits so small
that any shard would pass a 1e-4 comparison), and writes it with ``save_pretrained``
(safetensors + config.json). ``reference_logits(directory, input_ids)`` loads it back with
``from_pretrained`` and returns transformers' logits: the oracle a sharded forward is held to.

Every family has 8 attention heads (4 for GPT-2), vocab 128 and intermediate sizes that
tp 1, 2 and 4 divide; ``llama_gqa`` and ``qwen2`` have 2 kv heads, so tp 4 is the case where
each kv head is replicated over 2 ranks (``phi3`` too, inside its fused ``qkv_proj``).

transformers is imported inside the functions, so importing this module is cheap (worker
processes that only need :data:`FAMILIES`' names never import it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 128
HIDDEN = 64
LAYERS = 2

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 8,
    "max_position_embeddings": 128,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Weights ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2).

    GPT-2's ``Conv1D`` stores ``[in, out]``, so its fan-in is dimension 0; everything else
    (linears, embeddings, transformers 5's 3-D expert tensors) has it last.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() == 1:
                value = noise * 0.1 if name.endswith("bias") else 1.0 + noise * 0.1
            else:
                fan_in = p.shape[0] if ".c_" in name else p.shape[-1]
                value = noise * fan_in**-0.5
            p.copy_(value.to(p.dtype))


def write_model(directory: Path, config: Any, seed: int, max_shard_size: int | None = None) -> Path:
    """``config``'s model with its weights redrawn from ``seed`` (:func:`_redraw`), saved
    into ``directory`` by transformers' ``save_pretrained`` (in files of at most
    ``max_shard_size`` bytes when given, with their index)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    directory.mkdir(parents=True, exist_ok=True)
    shards = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **shards)
    return directory


def write_llama_gqa(directory: Path) -> Path:
    """Llama, 8 q heads over 2 kv heads (head_dim 8), tied embeddings, Llama-3 RoPE scaling."""
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = LlamaConfig(
        **_COMMON,
        intermediate_size=128,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters=rope,
    )
    return write_model(directory, config, seed=1)


def write_mistral(directory: Path) -> Path:
    """Mistral, 4 kv heads, head_dim 16 (not hidden / heads), a sliding window of 4096."""
    from transformers import MistralConfig

    config = MistralConfig(
        **_COMMON, intermediate_size=128, num_key_value_heads=4, head_dim=16, sliding_window=4096
    )
    return write_model(directory, config, seed=2)


def write_qwen2(directory: Path) -> Path:
    """Qwen2: q/k/v biases, 2 kv heads (replicated at tp 4, biases too)."""
    from transformers import Qwen2Config

    config = Qwen2Config(**_COMMON, intermediate_size=128, num_key_value_heads=2)
    return write_model(directory, config, seed=3)


def write_qwen3(directory: Path) -> Path:
    """Qwen3: per-head q_norm / k_norm, 4 kv heads, head_dim 16."""
    from transformers import Qwen3Config

    config = Qwen3Config(**_COMMON, intermediate_size=128, num_key_value_heads=4, head_dim=16)
    return write_model(directory, config, seed=4)


def write_phi3(directory: Path) -> Path:
    """Phi-3: fused qkv_proj / gate_up_proj, 2 kv heads, half the head dims rotated."""
    from transformers import Phi3Config

    config = Phi3Config(
        **_COMMON, intermediate_size=128, num_key_value_heads=2, partial_rotary_factor=0.5
    )
    return write_model(directory, config, seed=5)


def write_gpt2(directory: Path) -> Path:
    """GPT-2: Conv1D weights, 4 heads, learned positions (32), tied LM head."""
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=4,
        n_positions=32,
        bos_token_id=None,
        eos_token_id=None,
    )
    return write_model(directory, config, seed=6)


def write_mixtral(directory: Path) -> Path:
    """Mixtral: 4 experts (w1/w2/w3), top 2 renormalized, 2 kv heads."""
    from transformers import MixtralConfig

    config = MixtralConfig(
        **_COMMON,
        intermediate_size=64,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return write_model(directory, config, seed=7)


def write_qwen3_moe(directory: Path) -> Path:
    """Qwen3-MoE: 4 gated experts, top 2 with norm_topk_prob, layer 1 dense (mlp_only_layers),
    q_norm / k_norm, 2 kv heads, head_dim 16."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **_COMMON,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )
    return write_model(directory, config, seed=8)


def write_qwen2_moe(directory: Path) -> Path:
    """Qwen2-MoE: 4 gated experts, top 2 not renormalized, a sigmoid-gated shared expert."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        **_COMMON,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_key_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return write_model(directory, config, seed=9)


FAMILIES: dict[str, Callable[[Path], Path]] = {
    "llama_gqa": write_llama_gqa,
    "mistral": write_mistral,
    "qwen2": write_qwen2,
    "qwen3": write_qwen3,
    "phi3": write_phi3,
    "gpt2": write_gpt2,
    "mixtral": write_mixtral,
    "qwen3_moe": write_qwen3_moe,
    "qwen2_moe": write_qwen2_moe,
}
"""Family name -> checkpoint writer."""

MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
"""The families with experts, :data:`EXPERTS` each."""
EXPERTS = 4
"""Experts per MoE layer: expert parallel at tp 2 and 4 divides them."""
_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")


def expert_id(name: str) -> int | None:
    """The expert a tensor or parameter belongs to (``...experts.N....``), None when it is
    not a routed expert's (routers, Qwen2-MoE's ``shared_expert``, attention, ...)."""
    match = _EXPERT_ID.search(name)
    return int(match[1]) if match else None


def sample_input_ids(batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    """Token ids ``[batch, seq]`` drawn from the tiny vocab."""
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def reference_logits(directory: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits ``[batch, seq, vocab]`` for the checkpoint in ``directory``
    (loaded with ``from_pretrained``, float32, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits


@dataclass(frozen=True)
class Reference:
    """A family's checkpoint, input ids and transformers' logits for them."""

    path: Path
    input_ids: torch.Tensor
    logits: torch.Tensor


def write_reference(family: str, directory: Path) -> Reference:
    """Write ``family``'s checkpoint into ``directory`` and run transformers on it."""
    path = FAMILIES[family](directory)
    input_ids = sample_input_ids()
    return Reference(path, input_ids, reference_logits(path, input_ids))
