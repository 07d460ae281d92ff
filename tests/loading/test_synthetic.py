from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rayload.errors import ConfigError
from rayload.loading import synthetic
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.plan import plan_shards
from rayload.loading.synthetic import GB, PRESETS, preset_shape, write_checkpoint


def _file_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    a = write_checkpoint(tmp_path / "a", seed=3)
    b = write_checkpoint(tmp_path / "b", seed=3)
    c = write_checkpoint(tmp_path / "c", seed=4)
    assert _file_bytes(a) == _file_bytes(b)
    assert _file_bytes(a) != _file_bytes(c)


def test_chunk_size_does_not_change_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = write_checkpoint(tmp_path / "ref", seed=9)
    monkeypatch.setattr(synthetic, "_CHUNK_WORDS", 1000)
    chunked = write_checkpoint(tmp_path / "chunked", seed=9)
    assert _file_bytes(reference) == _file_bytes(chunked)


@pytest.mark.parametrize(("dtype", "torch_dtype"), [
    ("bf16", torch.bfloat16), ("f16", torch.float16), ("f32", torch.float32),
])  # fmt: skip
def test_safetensors_library_reads_finite_values(
    tmp_path: Path, dtype: str, torch_dtype: torch.dtype
) -> None:
    root = write_checkpoint(tmp_path / dtype, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    expected = dict(PRESETS["tiny-llama"].tensors())
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected
    for name, tensor in tensors.items():
        assert tensor.dtype == torch_dtype
        assert torch.isfinite(tensor.float()).all(), name
        assert tensor.abs().max() < 2
        assert tensor.float().std() > 0, name


def test_config_and_index_describe_the_tensors(tiny_llama: Path) -> None:
    config = json.loads((tiny_llama / "config.json").read_text())
    index = json.loads((tiny_llama / "model.safetensors.index.json").read_text())
    ckpt = open_checkpoint(tiny_llama)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "bfloat16"
    assert index["metadata"]["total_size"] == ckpt.tensor_bytes
    assert len(set(index["weight_map"].values())) >= 2
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"].shape
    k = ckpt.tensors["model.layers.0.self_attn.k_proj.weight"].shape
    assert q == (config["hidden_size"], config["hidden_size"])
    assert k[0] == config["num_key_value_heads"] * config["head_dim"]
    assert ckpt.tensors["lm_head.weight"].shape == (config["vocab_size"], config["hidden_size"])


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tiny_llama_plans_for_every_small_tp(tiny_llama: Path, tp: int) -> None:
    plan = plan_shards(tiny_llama, tp)
    assert set(plan.splits.values()) == {0, 1, None}
    assert len(set(plan.rank_bytes)) == 1


def test_num_files_is_honoured(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "m", num_files=7)
    ckpt = open_checkpoint(root)
    assert len(ckpt.files) == 7
    assert all(any(t.file == f for t in ckpt.tensors.values()) for f in ckpt.files)


@pytest.mark.parametrize("kwargs", [
    {"num_files": 0}, {"num_files": 10_000}, {"preset": "gpt2"}, {"dtype": "i8"},
    {"size_gb": 0.0},
], ids=repr)  # fmt: skip
def test_bad_arguments_are_config_errors(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        write_checkpoint(tmp_path / "m", **kwargs)  # type: ignore[arg-type]


def test_refuses_to_overwrite_a_checkpoint(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="already holds a checkpoint"):
        write_checkpoint(tiny_llama)


def test_llama_1b_has_real_llama_3_2_shapes() -> None:
    shape = preset_shape("llama-1b")
    assert (shape.hidden_size, shape.num_hidden_layers, shape.intermediate_size) == (2048, 16, 8192)
    assert (shape.num_attention_heads, shape.num_key_value_heads) == (32, 8)
    assert shape.vocab_size == 128256 and shape.tie_word_embeddings
    params = sum(math.prod(s) for _, s in shape.tensors())
    assert params == 1_235_814_400  # Llama-3.2-1B's parameter count


@pytest.mark.parametrize("size_gb", [1.0, 4.0, 10.0])
def test_size_gb_scales_layers_to_about_that_size(size_gb: float) -> None:
    shape = preset_shape("llama-1b", size_gb=size_gb)
    total = sum(math.prod(s) for _, s in shape.tensors()) * 2
    per_layer = 2 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192 + 2 * 2048)
    assert abs(total - size_gb * GB) <= per_layer / 2


def test_size_gb_never_goes_below_one_layer() -> None:
    assert preset_shape("llama-1b", size_gb=0.01).num_hidden_layers == 1


def test_partition_makes_non_empty_balanced_groups() -> None:
    groups = synthetic._partition([100, 1, 1, 1, 1, 100], 3)
    assert groups == [(0, 1), (1, 5), (5, 6)]
    assert synthetic._partition([5] * 4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert synthetic._partition([5] * 4, 1) == [(0, 4)]


@pytest.mark.slow
def test_llama_1b_one_layer_writes_and_opens(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "m", preset="llama-1b", size_gb=0.01)
    ckpt = open_checkpoint(root)
    assert ckpt.tensors["model.embed_tokens.weight"].shape == (128256, 2048)
    assert len(ckpt.files) == 3  # 0.65 GB at 256 MiB per file
    assert plan_shards(ckpt, 8).unmatched == ()


def test_output_under_a_regular_file_raises_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "out"
    with pytest.raises(ConfigError) as info:
        write_checkpoint(out)
    assert str(info.value) == (
        f"{out}: cannot write (Not a directory); choose a writable directory with free space"
    )


def test_disk_full_mid_write_raises_config_error_and_removes_written_files(
    tmp_path: Path,
) -> None:
    """config.json, written last, is a link to /dev/full: every write to it is ENOSPC."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").symlink_to("/dev/full")
    with pytest.raises(ConfigError, match=r"cannot write \(No space left on device\)"):
        write_checkpoint(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
