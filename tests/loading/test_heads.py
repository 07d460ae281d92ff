"""Head-aware and fused sharding on checkpoints written by ``transformers`` itself.

The bytes are compared with vLLM's layout built here by hand from the full tensors
(whole heads; KV heads replicated over ``tp / kv_heads`` ranks; a fused tensor's shard is
the concatenation of its part of each component). That the layout is what a TP model
runs on is proven by the forward-pass tests (tests/models).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rayload.errors import ConfigError, ShardingError
from rayload.loading import load_rank
from rayload.loading.heads import HeadLayout
from rayload.loading.plan import plan_shards
from rayload.loading.rules import Rule, resolve_rules
from support.cli import assert_one_line_error, run_cli

transformers = pytest.importorskip("transformers")

LLAMA_GQA = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}


def _write(config: Any, root: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root, safe_serialization=True)
    return root


@pytest.fixture(scope="module")
def llama_gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, **LLAMA_GQA
    )
    return _write(config, tmp_path_factory.mktemp("llama-gqa"))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.Phi3Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _write(config, tmp_path_factory.mktemp("phi3"))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.GPT2Config(
        vocab_size=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _write(config, tmp_path_factory.mktemp("gpt2"))


def _heads_part(full: torch.Tensor, heads: int, tp: int, rank: int, dim: int) -> torch.Tensor:
    """vLLM's part of ``heads`` whole heads stacked on ``dim`` for ``rank``."""
    if heads >= tp:
        return torch.tensor_split(full, tp, dim=dim)[rank]
    return torch.tensor_split(full, heads, dim=dim)[rank // (tp // heads)]


def _qkv(full: torch.Tensor, heads: HeadLayout, tp: int, rank: int, dim: int) -> torch.Tensor:
    q_rows, kv_rows = heads.num_heads * heads.head_dim, heads.num_kv_heads * heads.head_dim
    q, k, v = torch.split(full, [q_rows, kv_rows, kv_rows], dim=dim)
    return torch.cat(
        [
            _heads_part(q, heads.num_heads, tp, rank, dim),
            _heads_part(k, heads.num_kv_heads, tp, rank, dim),
            _heads_part(v, heads.num_kv_heads, tp, rank, dim),
        ],
        dim=dim,
    )


@pytest.mark.parametrize("tp", [2, 4])
def test_gqa_kv_shards_are_whole_heads_replicated_when_tp_exceeds_kv_heads(
    llama_gqa: Path, tp: int
) -> None:
    full = load_file(str(llama_gqa / "model.safetensors"))
    plan = plan_shards(llama_gqa, tp)
    assert plan.heads == HeadLayout(8, 2, 32)
    assert plan.kv_replicas == (2 if tp == 4 else 1)
    for rank in range(tp):
        tensors, _ = load_rank(llama_gqa, rank, tp, method="scratch")
        for layer in range(2):
            p = f"model.layers.{layer}.self_attn."
            for kv in ("k_proj", "v_proj"):
                shard = tensors[p + kv + ".weight"]
                assert shard.shape == (32, 128)  # one whole KV head on every rank
                assert torch.equal(shard, _heads_part(full[p + kv + ".weight"], 2, tp, rank, 0))
            q = tensors[p + "q_proj.weight"]
            assert torch.equal(q, _heads_part(full[p + "q_proj.weight"], 8, tp, rank, 0))
            o = tensors[p + "o_proj.weight"]
            assert torch.equal(o, _heads_part(full[p + "o_proj.weight"], 8, tp, rank, 1))
    kv_bytes = sum(
        t.nbytes for n, t in full.items() if n.endswith(("k_proj.weight", "v_proj.weight"))
    )
    assert plan.replicated_head_bytes == (kv_bytes if tp == 4 else 0)


def test_plan_cli_shows_kv_replication(llama_gqa: Path) -> None:
    result = run_cli("plan", str(llama_gqa), "--tp", "4", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["heads"] == {"attention": 8, "kv": 2, "head_dim": 32, "kv_replicas": 2}
    assert summary["replicated_head_bytes"] == plan_shards(llama_gqa, 4).replicated_head_bytes
    text = run_cli("plan", str(llama_gqa), "--tp", "4").stdout
    assert "KV heads replicated each on 2 ranks (2 KV heads < tp 4)" in text


def test_heads_not_divisible_by_tp_exit_2_naming_tensor_counts_and_valid_sizes(
    tmp_path: Path,
) -> None:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=384,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=6,
    )
    root = _write(config, tmp_path / "six-heads")
    # 384 rows divide by 4, but 6 heads of 64 do not: an even cut would split heads.
    result = run_cli("plan", str(root), "--tp", "4")
    assert_one_line_error(
        result,
        "tensor 'model.layers.0.self_attn.k_proj.weight'",  # the first in file order
        "6 KV heads cannot be split whole across tp=4",
        "6 query heads, 6 KV heads, head_dim 64",
        "valid tp sizes: 1, 2, 3, 6",
    )
    with pytest.raises(ShardingError, match="heads cannot be split whole across tp=4"):
        load_rank(root, 0, 4, method="scratch")


@pytest.mark.parametrize("tp", [2, 4])
def test_phi3_fused_tensors_split_per_component(phi3: Path, tp: int) -> None:
    plan = plan_shards(phi3, tp)
    assert plan.unmatched == ()
    assert plan.read_amplification <= 1.05
    full = load_file(str(phi3 / "model.safetensors"))
    heads = HeadLayout(8, 8, 32)
    for rank in range(tp):
        tensors, _ = load_rank(phi3, rank, tp, method="scratch")
        qkv = "model.layers.1.self_attn.qkv_proj.weight"
        assert torch.equal(tensors[qkv], _qkv(full[qkv], heads, tp, rank, 0))
        gate_up = "model.layers.1.mlp.gate_up_proj.weight"
        gate, up = full[gate_up].chunk(2)
        want = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        assert torch.equal(tensors[gate_up], want)
        fused = {s.name: s for s in plan.ranks[rank].shards}[qkv]
        assert fused.nbytes == tensors[qkv].nbytes  # its ranges hold only the rank's bytes


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_conv1d_splits_swapped_and_fused_per_component(gpt2: Path, tp: int) -> None:
    plan = plan_shards(gpt2, tp)
    assert plan.unmatched == ()
    assert plan.split_dim("transformer.h.0.attn.c_attn.weight") == 1  # Conv1D: out on dim 1
    assert plan.split_dim("transformer.h.0.attn.c_proj.weight") == 0  # in_features on dim 0
    full = load_file(str(gpt2 / "model.safetensors"))
    heads = HeadLayout(4, 4, 16)
    for rank in range(tp):
        tensors, _ = load_rank(gpt2, rank, tp, method="scratch")
        for name, dim in (("attn.c_attn.weight", 1), ("attn.c_attn.bias", 0)):
            name = "transformer.h.1." + name
            assert torch.equal(tensors[name], _qkv(full[name], heads, tp, rank, dim)), name


def test_rules_file_with_parts_plans_like_the_preset(phi3: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps(
            {
                "rules": [
                    {"pattern": r".*qkv_proj\.weight", "split": 0, "parts": ["q", "kv", "kv"]},
                    {"pattern": r".*gate_up_proj\.weight", "split": 0, "parts": ["even", "even"]},
                ],
                "use_preset": True,
            }
        )
    )
    mine, preset = plan_shards(phi3, 4, rules=str(rules)), plan_shards(phi3, 4)
    assert mine.ranks == preset.ranks


def test_rule_head_size_cuts_in_whole_heads_without_config(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"attn.weight": torch.zeros(96, 8)}, str(tmp_path / "model.safetensors"))
    whole = resolve_rules([Rule(r"attn\.weight", 0, ("q",), head_size=32)], None)
    with pytest.raises(ShardingError, match="3 heads cannot be split whole by tp=2"):
        plan_shards(tmp_path, 2, rules=whole)
    assert plan_shards(tmp_path, 3, rules=whole).ranks[1].shards[0].pieces == ((32, 32),)


def test_fused_rule_without_head_counts_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"qkv.weight": torch.zeros(96, 8)}, str(tmp_path / "model.safetensors"))
    rules = resolve_rules([Rule(r"qkv\.weight", 0, ("q", "kv", "kv"))], None)
    with pytest.raises(ShardingError, match=r"'qkv\.weight'.*need the head counts"):
        plan_shards(tmp_path, 2, rules=rules)


def test_fused_size_that_disagrees_with_config_is_an_error(llama_gqa: Path, tmp_path: Path) -> None:
    rules = resolve_rules([Rule(r".*q_proj\.weight", 0, ("q", "kv", "kv"))], "LlamaForCausalLM")
    with pytest.raises(ShardingError, match="does not match its parts"):
        plan_shards(llama_gqa, 2, rules=rules)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"pattern": "x", "split": "replicate", "parts": ["q"]}, "parts need a split"),
        ({"pattern": "x", "split": 0, "parts": ["qkv"]}, "parts.0"),
        ({"pattern": "x", "split": 0, "parts": ["even"], "head_size": 64}, "head_size applies"),
    ],
)
def test_bad_parts_in_rules_file_exit_2(
    tiny_llama: Path, tmp_path: Path, rule: dict[str, Any], message: str
) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [rule]}))
    assert_one_line_error(
        run_cli("plan", str(tiny_llama), "--tp", "2", "--rules", str(rules)), message
    )
    with pytest.raises(ConfigError):
        Rule("x", None, ("q",))


def test_converted_checkpoint_keeps_replicated_kv_heads(llama_gqa: Path, tmp_path: Path) -> None:
    from rayload.loading.convert import convert_checkpoint

    out = convert_checkpoint(llama_gqa, tmp_path / "tp4", 4)
    for rank in range(4):
        converted, _ = load_rank(out, rank, 4, method="converted")
        original, _ = load_rank(llama_gqa, rank, 4, method="scratch")
        assert converted.keys() == original.keys()
        for name, tensor in original.items():
            assert torch.equal(converted[name], tensor), (rank, name)
