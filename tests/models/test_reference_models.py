"""The reference models in one process: transformers' logits at tp 1 for every family, the
parameter contract (names and shard shapes that rayload's shards fill exactly, meta
construction) at every rank of tp 2 and 4, tensor and expert parallel, and clear errors
for what they do not implement.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from models.tp_processes import rank_logits
from rayload.errors import ConfigError
from rayload.loading import load_rank, open_checkpoint
from rayload.loading.fill import fill_model
from rayload.loading.model import ModelContext
from rayload.models import MODELS, TensorParallel, UnsupportedModelError, build_model
from support.transformers_models import EXPERTS, FAMILIES, MOE_FAMILIES, Reference, expert_id

TOLERANCE = 1e-4
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


def _build(
    config: dict, rank: int = 0, tp: int = 1, *, expert_parallel: bool = False
) -> torch.nn.Module:
    context = ModelContext(
        rank=rank, tp_size=tp, device="cpu", config=config, expert_parallel=expert_parallel
    )
    return build_model(context)


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers_at_tp1(
    family: str, reference: Callable[[str], Reference]
) -> None:
    ref = reference(family)
    logits = rank_logits(ref.path, ref.input_ids, rank=0, tp=1)
    assert logits.shape == ref.logits.shape
    assert ref.logits.std() > 0.5, "reference logits too small for the comparison to mean much"
    assert (logits - ref.logits).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rayload_shards_fill_every_parameter_at_every_rank(
    family: str, tp: int, reference: Callable[[str], Reference]
) -> None:
    path = reference(family).path
    config = dict(open_checkpoint(path).config or {})
    for rank in range(tp):
        model = _build(config, rank, tp)
        tensors, _ = load_rank(path, rank, tp, method="scratch", device="cpu")
        fill = fill_model(model, tensors, rank=rank)
        assert fill.parameters == len(list(model.parameters()))
        assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_parallel_ranks_hold_their_block_of_whole_experts(
    family: str, tp: int, reference: Callable[[str], Reference]
) -> None:
    path = reference(family).path
    config = dict(open_checkpoint(path).config or {})
    whole = _shapes(_build(config))
    split = _shapes(_build(config, 0, tp))
    for rank in range(tp):
        model = _build(config, rank, tp, expert_parallel=True)
        shapes = _shapes(model)
        per = EXPERTS // tp
        assert {expert_id(n) for n in shapes} - {None} == set(range(rank * per, (rank + 1) * per))
        for name, shape in shapes.items():
            assert shape == (split[name] if expert_id(name) is None else whole[name]), name
        tensors, _ = load_rank(path, rank, tp, method="scratch", device="cpu", expert_parallel=True)
        fill = fill_model(model, tensors, rank=rank)
        assert fill.parameters == len(shapes)
        assert not any(p.is_meta for p in model.parameters())


def test_expert_parallel_is_ignored_by_dense_families() -> None:
    config = dict(TINY_LLAMA)
    assert _shapes(_build(config, 1, 4, expert_parallel=True)) == _shapes(_build(config, 1, 4))


def test_expert_parallel_refuses_experts_the_ranks_do_not_divide() -> None:
    config = {
        **TINY_LLAMA,
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": 6,
        "num_experts_per_tok": 2,
    }
    assert _build(config, 0, 4) is not None
    message = "num_experts (expert parallel)=6 is not divisible by tp_size=4"
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        _build(config, 0, 4, expert_parallel=True)


def test_build_model_allocates_frozen_meta_parameters_and_no_buffers() -> None:
    model = _build(dict(TINY_LLAMA), rank=1, tp=4)
    assert all(p.is_meta and not p.requires_grad for p in model.parameters())
    assert list(model.buffers()) == []
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # rank 1 of 4: 2 q heads of 8 (head_dim 8) and the one kv head of 2 they use
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (2 * 8 + 2 * 8, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 16)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 32, 64)
    assert shapes["model.embed_tokens.weight"] == (32, 64)
    assert shapes["lm_head.weight"] == (32, 64)


def test_registry_names_every_family_and_mappings_are_vllm_rows() -> None:
    assert set(MODELS) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "GPT2LMHeadModel",
    }
    assert MODELS["LlamaForCausalLM"].stacked_params_mapping == (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", "0"),
        (".gate_up_proj", ".up_proj", "1"),
    )
    assert MODELS["Phi3ForCausalLM"].stacked_params_mapping == ()
    assert MODELS["GPT2LMHeadModel"].stacked_params_mapping == ()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["FalconForCausalLM"]}, "no reference model for architecture"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"hidden_act": "xielu"}, "activation 'xielu'"),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 8},
            "num_key_value_heads=3 and tp_size=4",
        ),
        ({"vocab_size": 130}, "vocab_size=130 is not divisible by tp_size=4"),
    ],
)
def test_unsupported_config_raises_value_error_naming_it(change: dict, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message) as info:
        _build({**TINY_LLAMA, **change}, rank=0, tp=4)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)


def _real_model(config: dict, tp: TensorParallel) -> torch.nn.Module:
    with torch.device("cpu"):
        model = MODELS[config["architectures"][0]](config, tp)
    for p in model.parameters():
        p.data.normal_()
    return model


def test_sequence_past_the_sliding_window_is_refused() -> None:
    config = {**TINY_LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 4}
    model = _real_model(config, TensorParallel())
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 128)
    with pytest.raises(UnsupportedModelError, match="sliding_window=4"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_tp2_without_process_group_says_what_it_needs() -> None:
    model = _real_model(dict(TINY_LLAMA), TensorParallel(rank=0, size=2))
    with pytest.raises(RuntimeError, match="needs a process group"):
        model(torch.zeros(1, 3, dtype=torch.long))
