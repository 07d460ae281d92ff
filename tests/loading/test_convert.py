"""``convert_checkpoint``: pre-sharded rank files readable by the safetensors library, a
manifest that describes them, and loads from them bit-identical to the original."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rayload.errors import CheckpointError, ConfigError
from rayload.loading import convert as convert_module
from rayload.loading import convert_checkpoint, load_rank, open_checkpoint, plan_shards
from rayload.loading.dtypes import DTYPES
from rayload.loading.header import read_header
from rayload.loading.manifest import file_entry, read_manifest

Reference = Callable[[Path, int, int, str, int | None], torch.Tensor]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def tp2(mixed_dtype_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_checkpoint(mixed_dtype_checkpoint, tmp_path_factory.mktemp("c") / "tp2", 2)


def test_rank_files_hold_the_reference_shards(
    tp2: Path, mixed_dtype_checkpoint: Path, reference_shard: Reference
) -> None:
    plan = plan_shards(mixed_dtype_checkpoint, 2)
    for rank in range(2):
        stored = load_file(str(tp2 / f"model-rank-{rank}-part-0.safetensors"))
        assert set(stored) == set(plan.splits)
        for name, got in stored.items():
            want = reference_shard(mixed_dtype_checkpoint, rank, 2, name, plan.split_dim(name))
            assert got.dtype == want.dtype
            assert torch.equal(raw(got), raw(want)), (rank, name)


def test_manifest_describes_files_rules_and_shapes(tp2: Path, mixed_dtype_checkpoint: Path) -> None:
    manifest = read_manifest(str(tp2 / "rayload-manifest.json"))
    plan = plan_shards(mixed_dtype_checkpoint, 2)
    assert (manifest.format_version, manifest.tp_size) == (1, 2)
    assert manifest.architecture == "LlamaForCausalLM"
    assert manifest.ranks == {
        0: ["model-rank-0-part-0.safetensors"],
        1: ["model-rank-1-part-0.safetensors"],
    }
    for name, entry in manifest.files.items():
        assert entry == file_entry(tp2 / name)
    assert manifest.splits == dict(plan.splits)
    original = open_checkpoint(mixed_dtype_checkpoint).tensors
    assert manifest.full_shapes == {n: list(t.shape) for n, t in original.items()}
    assert manifest.rules  # the Llama preset that was used
    assert json.loads((tp2 / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_every_tensor_is_aligned_to_its_element_size(tmp_path: Path) -> None:
    src = tmp_path / "odd"
    src.mkdir()
    save_file(
        {
            "a_u8": torch.arange(3, dtype=torch.uint8),
            "b_bf16": torch.ones(3, dtype=torch.bfloat16),
            "c_f32": torch.ones(5, dtype=torch.float32),
            "d_f64": torch.ones(1, dtype=torch.float64),
        },
        str(src / "model.safetensors"),
    )
    out = convert_checkpoint(src, tmp_path / "out", 1)
    infos = read_header(str(out / "model-rank-0-part-0.safetensors")).tensors.values()
    assert len(infos) == 4
    for info in infos:
        assert info.start % DTYPES[info.dtype][1] == 0, info.name
    tensors, _ = load_rank(out, 0, 1, "converted")
    assert torch.equal(tensors["a_u8"], torch.arange(3, dtype=torch.uint8))


def test_metadata_names_rank_and_tp(tp2: Path) -> None:
    with safe_open(str(tp2 / "model-rank-1-part-0.safetensors"), "pt") as f:
        assert f.metadata()["rayload.rank"] == "1"
        assert f.metadata()["rayload.tp_size"] == "2"


def test_small_part_size_splits_rank_files_and_still_loads_exactly(
    mixed_dtype_checkpoint: Path, tmp_path: Path, reference_shard: Reference
) -> None:
    out = convert_checkpoint(mixed_dtype_checkpoint, tmp_path / "parts", 2, part_bytes=64 << 10)
    manifest = read_manifest(str(out / "rayload-manifest.json"))
    names = manifest.ranks[1]
    assert len(names) > 2
    assert names == [f"model-rank-1-part-{p}.safetensors" for p in range(len(names))]
    plan = plan_shards(mixed_dtype_checkpoint, 2)
    for name in names:
        tensors = list(read_header(str(out / name)).tensors.values())
        data = sum(t.nbytes for t in tensors)
        assert data <= 64 << 10 or len(tensors) == 1
    tensors, report = load_rank(out, 1, 2, "converted")
    assert report.method.effective.value == "converted"
    for name, got in tensors.items():
        want = reference_shard(mixed_dtype_checkpoint, 1, 2, name, plan.split_dim(name))
        assert torch.equal(raw(got), raw(want)), name


def test_rules_file_decides_the_splits(mixed_dtype_checkpoint: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"pattern": ".*", "split": "replicate"}]}))
    out = convert_checkpoint(mixed_dtype_checkpoint, tmp_path / "rep", 2, rules=rules)
    manifest = read_manifest(str(out / "rayload-manifest.json"))
    assert set(manifest.splits.values()) == {None}
    sizes = {os.path.getsize(out / n) for names in manifest.ranks.values() for n in names}
    assert len(sizes) == 1  # both ranks hold the whole model


def test_existing_empty_output_directory_is_used(
    mixed_dtype_checkpoint: Path, tmp_path: Path
) -> None:
    (tmp_path / "empty").mkdir()
    out = convert_checkpoint(mixed_dtype_checkpoint, tmp_path / "empty", 1)
    assert (out / "rayload-manifest.json").is_file()


def test_non_empty_output_directory_is_refused(
    mixed_dtype_checkpoint: Path, tmp_path: Path
) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an empty directory"):
        convert_checkpoint(mixed_dtype_checkpoint, tmp_path / "busy", 2)
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]


def test_converting_a_converted_checkpoint_is_refused(tp2: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="already a converted checkpoint"):
        convert_checkpoint(tp2, tmp_path / "again", 2)


def test_failed_conversion_leaves_no_partial_checkpoint(
    mixed_dtype_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = convert_module.read_segments
    calls = 0

    def read_then_fail(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 2:  # rank 0's file is written by now
            raise CheckpointError("disk went away", file="x")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(convert_module, "read_segments", read_then_fail)
    with pytest.raises(CheckpointError, match="disk went away"):
        convert_checkpoint(mixed_dtype_checkpoint, tmp_path / "out", 2)
    assert not (tmp_path / "out").exists()


def test_unwritable_output_raises_config_error_and_leaves_nothing(
    mixed_dtype_checkpoint: Path, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("a regular file, not a directory")
    out = tmp_path / "file" / "out"
    with pytest.raises(ConfigError, match="cannot write") as info:
        convert_checkpoint(mixed_dtype_checkpoint, out, 2)
    assert str(info.value).startswith(f"{out}: cannot write (Not a directory)")
    assert "choose a writable directory with free space" in str(info.value)
    assert (tmp_path / "file").read_text() == "a regular file, not a directory"


def test_converted_output_is_auto_selected_and_exact_at_tp4(
    mixed_dtype_checkpoint: Path, tmp_path: Path, reference_shard: Reference
) -> None:
    out = convert_checkpoint(mixed_dtype_checkpoint, tmp_path / "tp4", 4)
    plan = plan_shards(mixed_dtype_checkpoint, 4)
    for rank in range(4):
        tensors, report = load_rank(out, rank, 4, "auto")
        assert report.method.selected.value == "converted"
        assert report.bytes_read == sum(os.path.getsize(f) for f in report.files)
        for name, got in tensors.items():
            want = reference_shard(mixed_dtype_checkpoint, rank, 4, name, plan.split_dim(name))
            assert torch.equal(raw(got), raw(want)), (rank, name)
