"""Expert parallel: each rank reads only its experts, whole, on checkpoints written by
``transformers`` (Mixtral, Qwen3-MoE, DeepSeek-V3). That the layout is what a TP+EP model
runs on is proven by the forward-pass tests (tests/models, tests/ray_cluster)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rayload.errors import ConfigError
from rayload.loading import load_rank
from rayload.loading.convert import convert_checkpoint
from rayload.loading.manifest import MANIFEST_NAME
from rayload.loading.plan import plan_shards
from support.cli import assert_one_line_error, run_cli
from support.reading import bytes_to_read
from support.transformers_models import write_llama_gqa, write_mixtral, write_qwen3_moe

pytest.importorskip("transformers")

EXPERT = re.compile(r"experts\.(\d+)\.")


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("moe")
    writers = {"mixtral": write_mixtral, "qwen3_moe": write_qwen3_moe}
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = writers[family](root / family)
        return made[family]

    return get


def _expert_of(name: str) -> int | None:
    match = EXPERT.search(name)
    return int(match[1]) if match else None


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_each_rank_reads_only_its_experts_whole(
    moe: Callable[[str], Path], family: str, tp: int
) -> None:
    path = moe(family)
    full = load_file(str(path / "model.safetensors"))
    plan = plan_shards(path, tp, expert_parallel=True)
    tp_plan = plan_shards(path, tp)
    all_expert_bytes = sum(t.nbytes for n, t in full.items() if _expert_of(n) is not None)
    assert plan.experts == tuple(tuple(range(r * 4 // tp, (r + 1) * 4 // tp)) for r in range(tp))
    for rank in range(tp):
        before = rchar()
        tensors, report = load_rank(path, rank, tp, method="scratch", expert_parallel=True)
        read = rchar() - before
        mine = {n for n in tensors if _expert_of(n) is not None}
        assert {_expert_of(n) for n in mine} == set(plan.experts[rank])
        for name in mine:  # whole, bit-exact
            assert torch.equal(tensors[name], full[name]), name
        assert plan.expert_bytes(rank) == all_expert_bytes // tp
        # Everything else is cut as without expert parallel.
        tp_tensors = {s.name: s for s in tp_plan.ranks[rank].shards}
        for shard in plan.ranks[rank].shards:
            if shard.name not in mine:
                assert shard == tp_tensors[shard.name], shard.name
        # bytes_read and the file reads themselves: its experts + its other shards, no more.
        expected = bytes_to_read(plan.ranks[rank].shards)
        assert report.bytes_read == expected
        # rchar is the whole process's: other threads of the test session (a Ray driver's,
        # a background run's pipes) add to it, never subtract. Of a few loads, the least.
        for _ in range(3):
            if read < expected + 64 * 1024:
                break
            before = rchar()
            load_rank(path, rank, tp, method="scratch", expert_parallel=True)
            read = min(read, rchar() - before)
        assert expected <= read < expected + 64 * 1024  # + headers and config
    assert plan.replicated_bytes == tp_plan.replicated_bytes  # experts are held, not replicated


def test_experts_not_divisible_by_tp_exit_2_naming_counts(moe: Callable[[str], Path]) -> None:
    result = run_cli("plan", str(moe("mixtral")), "--tp", "3", "--expert-parallel")
    assert_one_line_error(
        result, "4 experts per layer cannot be divided among tp=3", "valid tp sizes", "1, 2, 4"
    )


def test_expert_parallel_on_a_dense_model_is_an_input_error(tmp_path: Path) -> None:
    path = write_llama_gqa(tmp_path / "dense")
    with pytest.raises(ConfigError, match="no tensor is an expert's"):
        plan_shards(path, 2, expert_parallel=True)
    assert_one_line_error(
        run_cli("plan", str(path), "--tp", "2", "--expert-parallel"), "drop --expert-parallel"
    )


def test_plan_cli_shows_each_rank_experts_and_bytes(moe: Callable[[str], Path]) -> None:
    path = moe("qwen3_moe")
    result = run_cli("plan", str(path), "--tp", "4", "--expert-parallel", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    plan = plan_shards(path, 4, expert_parallel=True)
    assert summary["expert_parallel"] is True
    assert [r["experts"] for r in summary["ranks"]] == [[0], [1], [2], [3]]
    assert [r["expert_bytes"] for r in summary["ranks"]] == [plan.expert_bytes(r) for r in range(4)]
    text = run_cli("plan", str(path), "--tp", "2", "--expert-parallel").stdout
    assert re.search(r"^1 .* 2-3 ", text, re.MULTILINE), text


def test_converted_with_expert_parallel_round_trips(
    moe: Callable[[str], Path], tmp_path: Path
) -> None:
    path = moe("mixtral")
    result = run_cli("convert", str(path), str(tmp_path / "ep2"), "--tp", "2", "--expert-parallel")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "ep2"
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["expert_parallel"] is True
    assert manifest["experts"] == {"0": [0, 1], "1": [2, 3]}
    for rank in range(2):
        converted, _ = load_rank(out, rank, 2, method="converted", expert_parallel=True)
        original, _ = load_rank(path, rank, 2, method="scratch", expert_parallel=True)
        assert converted.keys() == original.keys()
        assert all(torch.equal(converted[n], t) for n, t in original.items())
        on_disk = {
            n for f in out.glob(f"model-rank-{rank}-part-*.safetensors") for n in load_file(str(f))
        }
        assert {_expert_of(n) for n in on_disk} - {None} == {2 * rank, 2 * rank + 1}
    with pytest.raises(ConfigError, match="converted with expert parallel"):
        load_rank(out, 0, 2, method="converted")
    # The same checkpoint converted without expert parallel cannot be loaded with it.
    plain = convert_checkpoint(path, tmp_path / "tp2", 2)
    with pytest.raises(ConfigError, match="converted without expert parallel"):
        plan_shards(plain, 2, expert_parallel=True)


def test_deepseek_v3_preset_shards_mla_by_heads_and_experts_by_rank(tmp_path: Path) -> None:
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path / "dsv3", safe_serialization=True)
    plan = plan_shards(tmp_path / "dsv3", 2, expert_parallel=True)
    assert plan.unmatched == ()
    layer = "model.layers.1."
    shards = [{s.name: s for s in rank.shards} for rank in plan.ranks]
    # MLA: q_b_proj rows are 4 heads x (8 + 4); kv_b_proj 4 heads x (8 + 8); whole heads.
    assert shards[1][layer + "self_attn.q_b_proj.weight"].pieces == ((24, 24),)
    assert shards[1][layer + "self_attn.kv_b_proj.weight"].pieces == ((32, 32),)
    assert shards[0][layer + "self_attn.o_proj.weight"].split == 1
    assert plan.split_dim(layer + "self_attn.kv_a_proj_with_mqa.weight") is None
    assert {_expert_of(n) for n in shards[1]} - {None} == {2, 3}
    assert shards[0][layer + "mlp.shared_experts.down_proj.weight"].split == 1
