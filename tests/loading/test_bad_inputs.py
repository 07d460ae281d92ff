"""Every malformed checkpoint is a CheckpointError naming the file (and tensor)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rayload.errors import CheckpointError, InputError
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.header import MAX_HEADER_BYTES
from rayload.loading.manifest import MANIFEST_NAME, file_entry, verify_file_checksum
from rayload.loading.plan import plan_shards

F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _expect(
    path: Path, *, file: Path, tensor: str | None, match: str, tp: int | None = None
) -> CheckpointError:
    """``open_checkpoint`` (or, with ``tp``, planning for it) raises the CheckpointError
    naming ``file`` and ``tensor``."""
    with pytest.raises(CheckpointError, match=match) as info:
        if tp is None:
            open_checkpoint(path)
        else:
            plan_shards(path, tp)
    assert isinstance(info.value, InputError)
    assert info.value.file == str(file)
    assert str(file) in str(info.value)
    assert info.value.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(info.value)
    return info.value


@pytest.mark.parametrize(
    ("header", "data", "length", "tensor", "match"),
    [
        pytest.param(b"", b"", None, None, "header is not valid JSON", id="empty-header"),
        pytest.param({"a": F32x2}, bytes(8), 10**6, None, "truncated", id="length-past-eof"),
        pytest.param({}, b"", MAX_HEADER_BYTES + 1, None, "over the", id="length-over-limit"),
        pytest.param(b"{not json", b"", None, None, "not valid JSON", id="invalid-json"),
        pytest.param(b"\xff\xfe", b"", None, None, "not valid JSON", id="not-utf8"),
        pytest.param([1, 2], b"", None, None, "not an object", id="json-list"),
        pytest.param(b"[" * 100_000, b"", None, None, "nested too deeply", id="deep-nesting"),
        pytest.param({"a": [1]}, b"", None, "a", "not an object", id="entry-not-object"),
        pytest.param(
            {"a": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "a", "no data_offsets",
            id="missing-offsets",
        ),
        pytest.param(
            {"a": {**F32x2, "dtype": "F7"}}, bytes(8), None, "a", "dtype 'F7'", id="unknown-dtype"
        ),
        pytest.param(
            {"a": {**F32x2, "shape": [-2]}}, bytes(8), None, "a", "not a list", id="negative-dim"
        ),
        pytest.param(
            {"a": {**F32x2, "shape": [True, 2]}}, bytes(8), None, "a", "not a list", id="bool-dim"
        ),
        pytest.param(
            {"a": {**F32x2, "shape": [3]}}, bytes(12), None, "a", "12 bytes but data_offsets",
            id="shape-length-mismatch",
        ),
        pytest.param(
            {"a": {**F32x2, "data_offsets": [0, 8]}}, bytes(4), None, "a", "truncated",
            id="offsets-past-eof",
        ),
        pytest.param(
            {"a": {**F32x2, "data_offsets": [8, 0]}}, bytes(8), None, "a", "reversed",
            id="reversed-offsets",
        ),
        pytest.param(
            {"a": {**F32x2, "data_offsets": [0]}}, bytes(8), None, "a", "not two",
            id="one-offset",
        ),
        pytest.param(
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            },
            bytes(16), None, "b", "overlaps tensor 'a'", id="overlap",
        ),
    ],
)  # fmt: skip
def test_malformed_header_raises_naming_file_and_tensor(
    tmp_path: Path,
    write_raw_safetensors: Callable[..., Path],
    header: Any,
    data: bytes,
    length: int | None,
    tensor: str | None,
    match: str,
) -> None:
    path = write_raw_safetensors(tmp_path / "model.safetensors", header, data, length=length)
    _expect(tmp_path, file=path, tensor=tensor, match=match)


def test_file_shorter_than_length_prefix_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    _expect(tmp_path, file=path, tensor=None, match="3 bytes, too short")


def _index_checkpoint(root: Path, write: Callable[..., Path], weight_map: Any) -> Path:
    root.mkdir(exist_ok=True)
    write(root / "part-1.safetensors", {"a": F32x2}, bytes(8))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root / "model.safetensors.index.json"


def test_index_invalid_json_names_index(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{")
    _expect(tmp_path, file=index, tensor=None, match="index is not valid JSON")


@pytest.mark.parametrize("weight_map", [None, [], {}, {"a": 3}], ids=repr)
def test_index_without_usable_weight_map_names_index(
    tmp_path: Path, write_raw_safetensors: Callable[..., Path], weight_map: Any
) -> None:
    index = _index_checkpoint(tmp_path / "c", write_raw_safetensors, weight_map)
    _expect(tmp_path / "c", file=index, tensor=None, match="weight_map")


def test_index_naming_missing_file_says_fetch_it(
    tmp_path: Path, write_raw_safetensors: Callable[..., Path]
) -> None:
    root = tmp_path / "c"
    _index_checkpoint(
        root, write_raw_safetensors, {"a": "part-1.safetensors", "b": "part-2.safetensors"}
    )
    error = _expect(root, file=root / "part-2.safetensors", tensor=None, match="does not exist")
    assert "model.safetensors.index.json" in str(error)


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS"])
def test_index_path_outside_root_is_refused(
    tmp_path: Path, write_raw_safetensors: Callable[..., Path], name: str
) -> None:
    write_raw_safetensors(tmp_path / "outside.safetensors", {"a": F32x2}, bytes(8))
    if name == "ABS":
        name = str(tmp_path / "outside.safetensors")
    root = tmp_path / "c"
    _index_checkpoint(root, write_raw_safetensors, {"a": name})
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as info:
        open_checkpoint(root)
    assert name in str(info.value)


def test_symlink_escaping_root_is_refused(
    tmp_path: Path, write_raw_safetensors: Callable[..., Path]
) -> None:
    write_raw_safetensors(tmp_path / "outside.safetensors", {"a": F32x2}, bytes(8))
    root = tmp_path / "c"
    _index_checkpoint(root, write_raw_safetensors, {"a": "link.safetensors"})
    os.symlink(tmp_path / "outside.safetensors", root / "link.safetensors")
    _expect(root, file=root / "link.safetensors", tensor=None, match="outside the checkpoint")


def test_weight_map_tensor_missing_from_its_file(
    tmp_path: Path, write_raw_safetensors: Callable[..., Path]
) -> None:
    root = tmp_path / "c"
    _index_checkpoint(
        root, write_raw_safetensors, {"a": "part-1.safetensors", "zz": "part-1.safetensors"}
    )
    _expect(root, file=root / "part-1.safetensors", tensor="zz", match="has no such tensor")


def test_bad_shard_header_in_index_names_that_shard(
    tmp_path: Path, write_raw_safetensors: Callable[..., Path]
) -> None:
    root = tmp_path / "c"
    _index_checkpoint(
        root, write_raw_safetensors, {"a": "part-1.safetensors", "b": "part-2.safetensors"}
    )
    bad = write_raw_safetensors(
        root / "part-2.safetensors", {"b": {**F32x2, "dtype": "Q4"}}, bytes(8)
    )
    _expect(root, file=bad, tensor="b", match="dtype 'Q4'")


def test_invalid_config_json_names_it(tiny_llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    shutil.copytree(tiny_llama, root)
    (root / "config.json").write_text("[1,")
    _expect(root, file=root / "config.json", tensor=None, match="model config is not valid JSON")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ('{"architectures": 5}', r"'architectures' is 5, not a list of class names"),
        ('{"architectures": "LlamaForCausalLM"}', r"'architectures' is 'LlamaForCausalLM'"),
        ('{"architectures": ["LlamaForCausalLM", 3]}', r"not a list of class names"),
        ('["LlamaForCausalLM"]', r"model config is a JSON list, not an object"),
    ],
    ids=["int", "string", "list-with-int", "top-level-list"],
)
def test_malformed_config_json_names_it_and_says_what_to_fix(
    tiny_llama: Path, tmp_path: Path, config: str, match: str
) -> None:
    root = tmp_path / "c"
    shutil.copytree(tiny_llama, root)
    (root / "config.json").write_text(config)
    error = _expect(root, file=root / "config.json", tensor=None, match=match)
    assert "fix it to" in str(error)


def test_deeply_nested_config_json_names_it(tiny_llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    shutil.copytree(tiny_llama, root)
    (root / "config.json").write_text("[" * 100_000)
    _expect(root, file=root / "config.json", tensor=None, match="nested too deeply")


def test_config_json_without_architectures_is_accepted(tiny_llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    shutil.copytree(tiny_llama, root)
    (root / "config.json").write_text('{"hidden_size": 64}')
    assert open_checkpoint(root).architecture is None


def test_missing_path_is_reported(tmp_path: Path) -> None:
    _expect(tmp_path / "nope", file=tmp_path / "nope", tensor=None, match="no such file")


def test_directory_without_safetensors_is_reported(tmp_path: Path) -> None:
    _expect(tmp_path, file=tmp_path, tensor=None, match="no .safetensors file")


def test_several_files_without_index_are_ambiguous(
    tmp_path: Path, write_raw_safetensors: Callable[..., Path]
) -> None:
    write_raw_safetensors(tmp_path / "a.safetensors", {"a": F32x2}, bytes(8))
    write_raw_safetensors(tmp_path / "b.safetensors", {"b": F32x2}, bytes(8))
    _expect(tmp_path, file=tmp_path, tensor=None, match="2 .safetensors files but no")


def test_non_safetensors_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(16))
    _expect(path, file=path, tensor=None, match="not a .safetensors file")


# Converted layout ---------------------------------------------------------------------


@pytest.fixture
def converted(
    tiny_llama: Path, make_converted: Callable[[Path, Path, int], Path], tmp_path: Path
) -> Path:
    return make_converted(tiny_llama, tmp_path / "tp2", 2)


def _edit_manifest(root: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    path = root / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def test_manifest_invalid_json(converted: Path) -> None:
    (converted / MANIFEST_NAME).write_text("{")
    _expect(converted, file=converted / MANIFEST_NAME, tensor=None, match="not valid JSON")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m.update(extra=1), "extra"),
        (lambda m: m.update(format_version=9), "format_version"),
        (lambda m: m.update(tp_size=3), "expected 0..2"),
        (lambda m: m["ranks"]["1"].append("model-rank-0-part-0.safetensors"), "more than one rank"),
        (lambda m: m["files"].pop("model-rank-1-part-0.safetensors"), "appear in only one"),
        (lambda m: m["files"]["model-rank-1-part-0.safetensors"].update(crc32="xyz"), "crc32"),
    ],
    ids=["extra-key", "version", "tp-vs-ranks", "file-twice", "file-unlisted", "bad-crc-format"],
)
def test_invalid_manifest_names_it(
    converted: Path, edit: Callable[[dict[str, Any]], None], match: str
) -> None:
    path = _edit_manifest(converted, edit)
    error = _expect(converted, file=path, tensor=None, match=match)
    assert "rayload convert" in str(error)


def test_stray_rank_file_is_a_file_list_mismatch(converted: Path) -> None:
    stray = converted / "model-rank-2-part-0.safetensors"
    shutil.copy(converted / "model-rank-1-part-0.safetensors", stray)
    _expect(converted, file=stray, tensor=None, match="not listed in the manifest")


def test_missing_rank_file_is_reported(converted: Path) -> None:
    missing = converted / "model-rank-1-part-0.safetensors"
    missing.unlink()
    _expect(converted, file=missing, tensor=None, match="does not exist")


def test_rank_file_of_wrong_size_is_reported(converted: Path) -> None:
    path = converted / "model-rank-0-part-0.safetensors"
    with open(path, "ab") as f:
        f.write(b"\0")
    _expect(converted, file=path, tensor=None, match="bytes but .* says")


@pytest.mark.parametrize("key", ["full_shapes", "shard_shapes"])
def test_rank_shard_shape_contradicting_manifest_is_reported(converted: Path, key: str) -> None:
    def edit(manifest: dict[str, Any]) -> None:
        if key == "full_shapes":
            manifest.pop("shard_shapes", None)  # a manifest from before shard shapes
        manifest[key] = {**(manifest.get(key) or {}), "model.norm.weight": [7]}

    _edit_manifest(converted, edit)
    _expect(
        converted,
        file=converted / "model-rank-0-part-0.safetensors",
        tensor="model.norm.weight",
        match="manifest's full shape",
        tp=2,
    )


def test_checksum_mismatch_names_file(converted: Path) -> None:
    path = converted / "model-rank-1-part-0.safetensors"
    entry = file_entry(path)
    verify_file_checksum(str(path), entry)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="CRC-32") as info:
        verify_file_checksum(str(path), entry)
    assert info.value.file == str(path) and str(path) in str(info.value)
