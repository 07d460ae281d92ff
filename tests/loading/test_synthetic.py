from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rayload.errors import ConfigError
from rayload.loading import load_rank, synthetic
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.plan import plan_shards
from rayload.loading.synthetic import DTYPES, GB, PRESETS, preset_shape, write_checkpoint

EXPERT = re.compile(r"\.experts\.(\d+)\.")


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


def _files_digest(root: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.iterdir()):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def test_existing_presets_keep_their_bytes(tmp_path: Path) -> None:
    """Earlier benchmark results were measured on these bytes: a new preset must not
    change them (digests from the code before the Mixtral presets)."""
    assert _files_digest(write_checkpoint(tmp_path / "t")) == "351c9e899c56f57570d820af118c2234"
    shape = preset_shape("llama-1b", size_gb=1.0)
    layout = json.dumps([shape.tensors(), shape.config("BF16")]).encode()
    assert hashlib.blake2b(layout, digest_size=16).hexdigest() == (
        "8d803dc28e22c6c575fac4e4809219e7"
    )


def test_dtypes_is_public_and_the_old_name_still_works() -> None:
    assert DTYPES == {"bf16": "BF16", "f16": "F16", "f32": "F32"}
    assert synthetic._FLOAT_DTYPES is DTYPES


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("mixtral") / "m", preset="tiny-mixtral")


def test_mixtral_preset_has_mixtral_names_and_config(tiny_mixtral: Path) -> None:
    config = json.loads((tiny_mixtral / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (8, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)  # GQA
    names = set(open_checkpoint(tiny_mixtral).tensors)
    layer = "model.layers.1."
    assert layer + "block_sparse_moe.gate.weight" in names
    assert {layer + f"block_sparse_moe.experts.7.{w}.weight" for w in ("w1", "w2", "w3")} <= names
    assert not any(".mlp." in n for n in names)
    assert len({int(m[1]) for n in names if (m := EXPERT.search(n))}) == 8


def test_transformers_loads_the_mixtral_preset_with_no_key_missing_or_unexpected(
    tiny_mixtral: Path,
) -> None:
    """transformers is the oracle: its MixtralForCausalLM takes every tensor, names and
    shapes as they are."""
    transformers = pytest.importorskip("transformers")
    _, info = transformers.MixtralForCausalLM.from_pretrained(
        tiny_mixtral, output_loading_info=True
    )
    assert info["missing_keys"] == info["unexpected_keys"] == set()
    assert not info["mismatched_keys"] and not info["error_msgs"]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_mixtral_plans_with_no_unmatched_tensor_with_and_without_expert_parallel(
    tiny_mixtral: Path, tp: int
) -> None:
    plain = plan_shards(tiny_mixtral, tp)
    ep = plan_shards(tiny_mixtral, tp, expert_parallel=True)
    assert plain.unmatched == ep.unmatched == ()
    assert ep.experts == tuple(tuple(range(r * 8 // tp, (r + 1) * 8 // tp)) for r in range(tp))
    experts = open_checkpoint(tiny_mixtral).tensors
    all_expert_bytes = sum(t.nbytes for n, t in experts.items() if EXPERT.search(n))
    assert [ep.expert_bytes(r) for r in range(tp)] == [all_expert_bytes // tp] * tp


def test_expert_parallel_rank_gets_its_experts_whole(tiny_mixtral: Path) -> None:
    full: dict[str, torch.Tensor] = {}
    for file in sorted(tiny_mixtral.glob("*.safetensors")):
        full.update(load_file(str(file)))
    tensors, _ = load_rank(tiny_mixtral, 1, 4, expert_parallel=True)
    mine = {n for n in tensors if EXPERT.search(n)}
    assert {int(m[1]) for n in mine if (m := EXPERT.search(n))} == {2, 3}
    assert len(mine) == 2 * 3 * 2  # 2 experts x w1/w2/w3 x 2 layers
    for name in mine:
        assert torch.equal(tensors[name], full[name]), name


def test_mixtral_8e_has_mixtral_8x7b_layout_at_a_quarter_width() -> None:
    shape = preset_shape("mixtral-8e")
    assert (shape.hidden_size, shape.intermediate_size, shape.vocab_size) == (1024, 3584, 32000)
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (16, 4, 64)
    assert shape.num_hidden_layers == 32 and not shape.tie_word_embeddings
    config = shape.config("BF16")
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (8, 2)


@pytest.mark.parametrize("size_gb", [1.0, 4.0])
def test_mixtral_8e_scales_layers_to_about_size_gb(size_gb: float) -> None:
    shape = preset_shape("mixtral-8e", size_gb=size_gb)
    total = sum(math.prod(s) for _, s in shape.tensors()) * 2
    experts = sum(math.prod(s) for n, s in shape.tensors() if EXPERT.search(n)) * 2
    per_layer = 2 * (2 * 1024 * 1024 + 2 * 256 * 1024 + 8 * 1024 + 24 * 1024 * 3584 + 2 * 1024)
    assert abs(total - size_gb * GB) <= per_layer / 2
    assert experts / total > 0.8  # experts dominate, as in Mixtral
