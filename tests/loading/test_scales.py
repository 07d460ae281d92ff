"""FP8 checkpoints: weights in ``float8_e4m3fn`` with 128 x 128 block scales
(``weight_scale_inv``, DeepSeek-V3 / Qwen3-FP8 style) and per-tensor scales, built here with
torch and the safetensors library from a transformers Llama. Every rank's weight shard and
scale shard dequantize to exactly the matching part of the dequantized full weight."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rayload.errors import ShardingError
from rayload.loading import load_rank
from rayload.loading.convert import convert_checkpoint
from rayload.loading.plan import plan_shards
from support.cli import assert_one_line_error, run_cli

transformers = pytest.importorskip("transformers")

BLOCK = 128
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8: one float32 scale per BLOCK x BLOCK block (the last may be partial)."""
    rows, cols = weight.shape
    scales = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            scale = block.abs().max().clamp(min=1e-12) / 448.0
            scales[i, j] = scale
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (block / scale).to(
                torch.float8_e4m3fn
            )
    return q, scales


def _dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    full = scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * full


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama (2 heads of 128, 2 KV heads, hidden 256, intermediate 512) with every linear
    in FP8 + 128 x 128 block scales, per-tensor input and k scales, and config.json's
    quantization_config."""
    root = tmp_path_factory.mktemp("fp8") / "ckpt"
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=128,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root, safe_serialization=True)
    tensors = load_file(str(root / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = _quantize(t)
            out[name[: -len("weight")] + "input_scale"] = torch.tensor(0.5)
        else:
            out[name] = t
    out["model.layers.0.self_attn.k_scale"] = torch.tensor([1.0])
    save_file(out, str(root / "model.safetensors"), metadata={"format": "pt"})
    data = json.loads((root / "config.json").read_text())
    data["quantization_config"] = QUANT
    (root / "config.json").write_text(json.dumps(data))
    return root


def test_fp8_shards_and_block_scales_dequantize_to_the_full_weight(fp8_llama: Path) -> None:
    full = load_file(str(fp8_llama / "model.safetensors"))
    plan = plan_shards(fp8_llama, 2)
    assert plan.unmatched == ()  # scales follow their weights; per-tensor ones replicate
    assert plan.block_size == (BLOCK, BLOCK)
    for rank in range(2):
        tensors, _ = load_rank(fp8_llama, rank, 2, method="scratch")
        for name in [n for n in full if n.endswith("_proj.weight")]:
            weight, scale = tensors[name], tensors[name + "_scale_inv"]
            assert weight.dtype == torch.float8_e4m3fn
            split = plan.split_dim(name)
            assert plan.split_dim(name + "_scale_inv") == split
            want = _dequantize(full[name], full[name + "_scale_inv"])
            want = torch.tensor_split(want, 2, dim=split)[rank]
            assert torch.equal(_dequantize(weight, scale), want), (rank, name)
            assert torch.equal(tensors[name[: -len("weight")] + "input_scale"], torch.tensor(0.5))
        assert torch.equal(tensors["model.layers.0.self_attn.k_scale"], torch.tensor([1.0]))


def test_a_shard_that_cuts_a_block_exits_2_naming_tensor_block_and_tp(fp8_llama: Path) -> None:
    # With the preset, tp 4 fails on the heads first (2 query heads); a rules file that
    # splits only down_proj's rows (256 / 4 = 64: half a 128-block) reaches the scales.
    assert_one_line_error(run_cli("plan", str(fp8_llama), "--tp", "4"), "2 query heads")
    rules = fp8_llama.parent / "rules.json"
    rules.write_text(
        json.dumps(
            {"rules": [{"pattern": r".*down_proj\.weight", "split": 0}], "use_preset": False}
        )
    )
    with pytest.raises(ShardingError, match="cut a block of 128"):
        plan_shards(fp8_llama, 4, rules=str(rules))
    assert_one_line_error(
        run_cli("plan", str(fp8_llama), "--tp", "4", "--rules", str(rules)),
        "down_proj.weight_scale_inv",
        "block of 128",
        "tp=4",
    )


def test_fp8_converted_round_trip_keeps_scales(fp8_llama: Path, tmp_path: Path) -> None:
    out = convert_checkpoint(fp8_llama, tmp_path / "tp2", 2)
    manifest = json.loads((out / "rayload-manifest.json").read_text())
    assert manifest["block_size"] == [BLOCK, BLOCK]
    for rank in range(2):
        converted, _ = load_rank(out, rank, 2, method="converted")
        original, _ = load_rank(fp8_llama, rank, 2, method="scratch")
        assert converted.keys() == original.keys()
        for name, t in original.items():
            got, want = converted[name].reshape(-1), t.reshape(-1)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu])
def test_fp8_dtypes_read_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    raw = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    save_file({"w": raw.view(dtype)}, str(tmp_path / "model.safetensors"))
    from rayload.loading.rules import Rule

    for rank in range(2):
        tensors, _ = load_rank(tmp_path, rank, 2, method="scratch", rules=[Rule("w", 1)])
        assert tensors["w"].dtype == dtype
        assert torch.equal(tensors["w"].view(torch.uint8), raw[:, rank * 8 : (rank + 1) * 8])


def test_inspect_shows_the_quantization_config(fp8_llama: Path) -> None:
    result = run_cli("inspect", str(fp8_llama))
    assert result.returncode == 0, result.stderr
    assert "quantized   fmt=e4m3, quant_method=fp8, weight_block_size=[128, 128]" in result.stdout
    summary = json.loads(run_cli("inspect", str(fp8_llama), "--json").stdout)
    assert summary["quantization"] == QUANT
