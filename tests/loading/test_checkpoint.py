from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rayload.errors import CheckpointError
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.header import MAX_HEADER_BYTES, read_header
from rayload.loading.plan import plan_shards


def test_index_layout_matches_safetensors_library(mixed_dtype_checkpoint: Path) -> None:
    ckpt = open_checkpoint(mixed_dtype_checkpoint)
    assert ckpt.layout == "hf_index"
    assert ckpt.architecture == "LlamaForCausalLM"
    assert len(ckpt.files) == 3
    seen = 0
    for file in ckpt.files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = f.get_tensor(name)
                info = ckpt.tensors[name]
                assert info.file == file
                assert info.shape == tuple(tensor.shape)
                assert info.nbytes == tensor.nbytes
                with open(file, "rb") as raw:
                    raw.seek(info.start)
                    data = raw.read(info.nbytes)
                assert data == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
                seen += 1
    assert seen == len(ckpt.tensors)
    assert {t.dtype for t in ckpt.tensors.values()} == {"BF16", "F16", "F32", "I32"}


def test_single_file_layout_from_directory_and_file(tmp_path: Path) -> None:
    save_file(
        {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.int8)},
        str(tmp_path / "x.safetensors"),
    )
    by_dir = open_checkpoint(tmp_path)
    by_file = open_checkpoint(tmp_path / "x.safetensors")
    assert by_dir == by_file
    assert by_dir.layout == "hf_single"
    assert by_dir.config is None and by_dir.architecture is None
    assert by_dir.tensors["b"].dtype == "I8" and by_dir.tensors["a"].shape == (2, 3)


def test_model_safetensors_wins_over_other_files(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    save_file({"b": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    assert set(open_checkpoint(tmp_path).tensors) == {"a"}


def test_metadata_and_empty_tensors_are_accepted(
    tmp_path: Path, write_raw_safetensors: Callable[..., Path]
) -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "empty": {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    }
    path = write_raw_safetensors(tmp_path / "m.safetensors", header, bytes(8))
    parsed = read_header(str(path))
    assert list(parsed.tensors) == ["empty", "a"]
    assert parsed.metadata == {"format": "pt"}


def test_symlink_inside_root_is_accepted(mixed_dtype_checkpoint: Path, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "blobs").mkdir()
    for item in mixed_dtype_checkpoint.iterdir():
        if item.suffix == ".safetensors":
            (root / "blobs" / item.name).write_bytes(item.read_bytes())
            os.symlink(f"blobs/{item.name}", root / item.name)
        else:
            (root / item.name).write_bytes(item.read_bytes())
    assert len(open_checkpoint(root).tensors) == len(
        open_checkpoint(mixed_dtype_checkpoint).tensors
    )


def test_header_of_large_sparse_file_parses_without_reading_data(
    tmp_path: Path, write_raw_safetensors: Callable[..., Path]
) -> None:
    # A huge declared tensor region is never read: only its size is checked.
    size = MAX_HEADER_BYTES * 3
    header = {"big": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}
    path = write_raw_safetensors(tmp_path / "big.safetensors", header)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) + size)
    assert read_header(str(path)).tensors["big"].nbytes == size


def test_checkpoint_is_picklable(tiny_llama: Path) -> None:
    ckpt = open_checkpoint(tiny_llama)
    assert pickle.loads(pickle.dumps(ckpt)) == ckpt


def test_converted_layout_is_detected_and_planned(
    tiny_llama: Path, make_converted: Callable[[Path, Path, int], Path], tmp_path: Path
) -> None:
    out = make_converted(tiny_llama, tmp_path / "tp2", 2)
    ckpt = open_checkpoint(out)
    assert ckpt.layout == "converted"
    assert ckpt.tp_size == 2
    assert ckpt.architecture == "LlamaForCausalLM"
    assert ckpt.rank_files is not None and len(ckpt.rank_files[1]) == 1
    source_plan = plan_shards(tiny_llama, 2)
    plan = plan_shards(out, 2)
    assert plan.layout == "converted"
    assert plan.splits == source_plan.splits
    assert plan.checkpoint_bytes == source_plan.checkpoint_bytes
    assert plan.rank_bytes == source_plan.rank_bytes
    assert plan.read_amplification == pytest.approx(source_plan.read_amplification)
    for rank_plan, source_rank in zip(plan.ranks, source_plan.ranks, strict=True):
        assert rank_plan.files == ckpt.rank_files[rank_plan.rank]
        by_name = {s.name: s for s in source_rank.shards}
        for shard in rank_plan.shards:
            assert len(shard.ranges) == 1
            assert shard.shape == by_name[shard.name].shape
            assert shard.full_shape == by_name[shard.name].full_shape


def test_converted_for_other_tp_tells_how_to_convert(
    tiny_llama: Path, make_converted: Callable[[Path, Path, int], Path], tmp_path: Path
) -> None:
    out = make_converted(tiny_llama, tmp_path / "tp4", 4)
    with pytest.raises(CheckpointError, match=r"converted for tp_size=4, not 2") as info:
        plan_shards(out, 2)
    assert "rayload convert" in str(info.value) and "--tp 2" in str(info.value)
    assert info.value.file == str(out / "rayload-manifest.json")


def test_config_json_is_read(tiny_llama: Path) -> None:
    ckpt = open_checkpoint(tiny_llama)
    config = json.loads((tiny_llama / "config.json").read_text())
    assert ckpt.config == config


def test_tensors_missing_from_weight_map_are_ignored_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_file({"a": torch.zeros(2), "orphan": torch.zeros(3)}, str(tmp_path / "p1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "p1.safetensors"}})
    )
    with caplog.at_level("WARNING", logger="rayload.loading.checkpoint"):
        ckpt = open_checkpoint(tmp_path)
    assert set(ckpt.tensors) == {"a"}
    assert "orphan" in caplog.text and "p1.safetensors" in caplog.text


def test_converted_rank_tensors_differ_per_rank(
    tiny_llama: Path, make_converted: Callable[[Path, Path, int], Path], tmp_path: Path
) -> None:
    ckpt = open_checkpoint(make_converted(tiny_llama, tmp_path / "tp2", 2))
    name = "model.layers.0.mlp.down_proj.weight"
    r0, r1 = ckpt.rank_tensors(0)[name], ckpt.rank_tensors(1)[name]
    assert r0.shape == r1.shape == (256, 256)
    assert r0.file != r1.file
    assert ckpt.tensors[name] == r0
    assert ckpt.tensor_bytes == sum(
        t.nbytes for rank in (0, 1) for t in ckpt.rank_tensors(rank).values()
    )
