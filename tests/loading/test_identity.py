"""Checkpoint and plan identity: the same for the same content anywhere, different as soon
as a header byte, the data (a fine-tuned step with the same header), the tp size, the
rules or expert parallel differ."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from rayload.loading import open_checkpoint, plan_shards
from rayload.loading.identity import (
    SAMPLE_BYTES,
    SAMPLES,
    checkpoint_identity,
    peer_key,
    plan_identity,
)
from rayload.loading.rules import Rule


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from support.transformers_models import write_llama_gqa

    return write_llama_gqa(tmp_path_factory.mktemp("identity") / "llama")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from support.transformers_models import write_mixtral

    return write_mixtral(tmp_path_factory.mktemp("identity") / "mixtral")


def _key(path: Path, tp: int = 2, **plan_options: object) -> str:
    checkpoint = open_checkpoint(path)
    return peer_key(checkpoint, plan_shards(checkpoint, tp, **plan_options))  # type: ignore[arg-type]


def test_peer_key_is_short_and_readable(llama: Path) -> None:
    assert re.fullmatch(r"ckpt-[0-9a-f]{12}\.plan-[0-9a-f]{12}", _key(llama))


def test_a_copy_at_another_path_has_the_same_key(llama: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(llama, tmp_path / "elsewhere" / "copy")
    assert _key(copy) == _key(llama)


def test_an_indexed_copy_at_another_path_has_the_same_key(
    mixed_dtype_checkpoint: Path, tmp_path: Path
) -> None:
    copy = shutil.copytree(mixed_dtype_checkpoint, tmp_path / "copy")
    assert _key(copy) == _key(mixed_dtype_checkpoint)


def test_one_header_byte_changed_at_equal_size_changes_the_checkpoint_identity(
    llama: Path, tmp_path: Path
) -> None:
    copy = shutil.copytree(llama, tmp_path / "copy")
    [file] = copy.glob("*.safetensors")
    raw = bytearray(file.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    at = raw.index(b'"pt"', 8, header_end)  # the metadata's "format": "pt"
    raw[at + 2] = ord("u")
    file.write_bytes(bytes(raw))
    assert file.stat().st_size == (llama / file.name).stat().st_size
    before, after = open_checkpoint(llama), open_checkpoint(copy)
    assert checkpoint_identity(after) != checkpoint_identity(before)
    assert plan_identity(plan_shards(after, 2)) == plan_identity(plan_shards(before, 2))
    assert _key(copy) != _key(llama)


def test_a_fine_tuned_checkpoint_with_the_same_header_has_another_key(
    llama: Path, tmp_path: Path
) -> None:
    """The next step of a fine-tune is saved with the same header and sizes: the sampled
    data blocks tell it apart."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1e-3)
    tuned = tmp_path / "tuned"
    model.save_pretrained(tuned, safe_serialization=True)
    [base_file], [tuned_file] = llama.glob("*.safetensors"), tuned.glob("*.safetensors")
    assert _header(base_file) == _header(tuned_file)
    assert base_file.stat().st_size == tuned_file.stat().st_size
    assert _key(tuned) != _key(llama)


def test_identity_reads_headers_and_samples_only(llama: Path) -> None:
    checkpoint = open_checkpoint(llama)
    before = _rchar()
    checkpoint_identity(checkpoint)
    read = _rchar() - before
    headers = sum(len(_header(Path(f))) + 8 for f in checkpoint.files)
    slack = 4096  # reading /proc/self/io itself
    assert read <= headers + len(checkpoint.files) * SAMPLES * SAMPLE_BYTES + slack
    assert read < checkpoint.total_bytes


def _header(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[8 : 8 + int.from_bytes(raw[:8], "little")]


def _rchar() -> int:
    with open("/proc/self/io", encoding="ascii") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def test_tp_size_changes_the_plan_identity(llama: Path) -> None:
    checkpoint = open_checkpoint(llama)
    keys = {plan_identity(plan_shards(checkpoint, tp)) for tp in (1, 2, 4)}
    assert len(keys) == 3
    assert len({checkpoint_identity(checkpoint)}) == 1


def test_rules_change_the_plan_identity(llama: Path) -> None:
    replicate_all = [Rule(".*", None)]
    assert _key(llama, rules=replicate_all) != _key(llama)
    assert _key(llama, rules=replicate_all) == _key(llama, rules=replicate_all)


def test_expert_parallel_changes_the_plan_identity(mixtral: Path) -> None:
    assert _key(mixtral, expert_parallel=True) != _key(mixtral, expert_parallel=False)


def test_converted_identity_comes_from_the_manifest(
    mixed_dtype_checkpoint: Path, make_converted: object, tmp_path: Path
) -> None:
    make = make_converted
    tp2 = make(mixed_dtype_checkpoint, tmp_path / "tp2", 2)  # type: ignore[operator]
    tp4 = make(mixed_dtype_checkpoint, tmp_path / "tp4", 4)  # type: ignore[operator]
    copy = shutil.copytree(tp2, tmp_path / "moved" / "tp2")
    assert _key(copy, 2) == _key(tp2, 2)
    assert checkpoint_identity(open_checkpoint(tp4)) != checkpoint_identity(open_checkpoint(tp2))
    assert checkpoint_identity(open_checkpoint(tp2)) != checkpoint_identity(
        open_checkpoint(mixed_dtype_checkpoint)
    )
