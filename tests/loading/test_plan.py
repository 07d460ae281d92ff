from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch

from rayload.errors import ConfigError, ShardingError
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.plan import ByteRange, RowRanges, ShardPlan, plan_shards
from rayload.loading.rules import Rule


def _shard_bytes(ranges: tuple[ByteRange, ...]) -> bytes:
    out = bytearray()
    for r in ranges:
        with open(r.file, "rb") as f:
            f.seek(r.offset)
            out += f.read(r.length)
    return bytes(out)


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _small(write: Callable[..., Path], tmp_path: Path, tensors: dict[str, list[int]]) -> Path:
    """An F32 single-file checkpoint whose tensors hold their element index."""
    header, data, offset = {}, b"", 0
    for name, shape in tensors.items():
        t = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + t.nbytes]}
        data += _as_bytes(t)
        offset += t.nbytes
    return write(tmp_path / "model.safetensors", header, data)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("fixture", ["tiny_llama", "mixed_dtype_checkpoint"])
def test_ranges_concatenate_to_reference_shard_for_every_rank(
    request: pytest.FixtureRequest,
    reference_shard: Callable[..., torch.Tensor],
    fixture: str,
    tp: int,
) -> None:
    path = request.getfixturevalue(fixture)
    plan = plan_shards(path, tp)
    for rank_plan in plan.ranks:
        for shard in rank_plan.shards:
            expected = reference_shard(path, rank_plan.rank, tp, shard.name, shard.split)
            assert shard.shape == tuple(expected.shape), shard.name
            assert _shard_bytes(shard.ranges) == _as_bytes(expected), (shard.name, rank_plan.rank)


def test_split0_is_one_contiguous_range_per_rank(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"w": [4, 6]})
    start = open_checkpoint(path).tensors["w"].start
    plan = plan_shards(path, 2, rules=[Rule("w", 0)])
    assert [s.ranges for r in plan.ranks for s in r.shards] == [
        (ByteRange(str(path), start, 48),),
        (ByteRange(str(path), start + 48, 48),),
    ]
    assert plan.ranks[1].shards[0].shape == (2, 6)


def test_split1_has_one_range_per_row(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"w": [3, 4]})
    start = open_checkpoint(path).tensors["w"].start
    plan = plan_shards(path, 2, rules=[Rule("w", 1)])
    f = str(path)
    rank0, rank1 = (r.shards[0] for r in plan.ranks)
    assert rank0.ranges == tuple(ByteRange(f, start + 16 * i, 8) for i in range(3))
    assert rank1.ranges == tuple(ByteRange(f, start + 16 * i + 8, 8) for i in range(3))
    assert rank1.shape == (3, 2)
    values = torch.frombuffer(bytearray(_shard_bytes(rank1.ranges)), dtype=torch.float32)
    assert values.tolist() == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]


def test_split1_coalesces_rows_at_tp1(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"w": [3, 4]})
    start = open_checkpoint(path).tensors["w"].start
    (shard,) = plan_shards(path, 1, rules=[Rule("w", 1)]).ranks[0].shards
    assert shard.ranges == (ByteRange(str(path), start, 48),)


def test_split1_of_3d_tensor_keeps_trailing_dims_contiguous(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"w": [2, 4, 3]})
    start = open_checkpoint(path).tensors["w"].start
    plan = plan_shards(path, 2, rules=[Rule("w", 1)])
    f = str(path)
    assert plan.ranks[0].shards[0].ranges == (ByteRange(f, start, 24), ByteRange(f, start + 48, 24))
    assert plan.ranks[1].shards[0].ranges == (
        ByteRange(f, start + 24, 24),
        ByteRange(f, start + 72, 24),
    )
    assert plan.ranks[1].shards[0].shape == (2, 2, 3)


def test_replicated_tensor_is_read_whole_by_every_rank(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"n": [5]})
    info = open_checkpoint(path).tensors["n"]
    plan = plan_shards(path, 4, rules=[Rule("n", None)])
    for rank in plan.ranks:
        assert rank.shards[0].ranges == (ByteRange(str(path), info.start, 20),)
        assert rank.shards[0].split is None


def test_amplification_and_replicated_bytes_match_hand_count(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"a": [4, 2], "r": [4]})
    plan = plan_shards(path, 2, rules=[Rule("a", 0), Rule("r", None)])
    assert plan.checkpoint_bytes == 48
    assert plan.rank_bytes == (32, 32)
    assert plan.replicated_bytes == 16
    assert plan.read_amplification == pytest.approx(64 / 48)
    assert plan.unmatched == ()


def test_unmatched_tensor_is_replicated_and_counted(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"a": [4, 2], "stray": [2, 2]})
    plan = plan_shards(path, 2, rules=[Rule("a", 0)])
    assert plan.unmatched == ("stray",)
    assert plan.unmatched_bytes == 16
    assert plan.split_dim("stray") is None
    assert plan.split_dim("a") == 0


def test_first_matching_rule_wins(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"x.weight": [4, 4]})
    plan = plan_shards(path, 2, rules=[Rule(r"x\.weight", 1), Rule(r".*", 0)])
    assert plan.split_dim("x.weight") == 1


def test_unknown_architecture_replicates_everything_with_warning(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"a": [4, 2]})
    with caplog.at_level(logging.WARNING, logger="rayload.loading.rules"):
        plan = plan_shards(path, 2)
    assert plan.unmatched == ("a",)
    assert plan.rules_source == "none"
    assert "no sharding preset" in caplog.text


def test_non_divisible_dimension_raises_naming_tensor_file_and_tp(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"w": [6, 5]})
    with pytest.raises(ShardingError) as info:
        plan_shards(path, 4, rules=[Rule("w", 0)])
    assert info.value.tensor == "w"
    assert info.value.file == str(path)
    message = str(info.value)
    assert "'w'" in message and str(path) in message and "tp=4" in message and "size 6" in message


def test_split1_of_1d_tensor_raises(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"b": [8]})
    with pytest.raises(ShardingError, match="no dimension 1") as info:
        plan_shards(path, 2, rules=[Rule("b", 1)])
    assert info.value.tensor == "b"


@pytest.mark.parametrize("tp", [0, -1, True, 2.0])
def test_bad_tp_size_raises_config_error(tiny_llama: Path, tp: object) -> None:
    with pytest.raises(ConfigError, match="tp_size"):
        plan_shards(tiny_llama, tp)  # type: ignore[arg-type]


def test_tiny_llama_replicates_only_norms(tiny_llama: Path) -> None:
    plan = plan_shards(tiny_llama, 2)
    replicated = {n for n, s in plan.splits.items() if s is None}
    assert plan.unmatched == ()
    assert replicated and all(n.endswith("norm.weight") for n in replicated)
    assert {s for s in plan.splits.values()} == {0, 1, None}


def test_plan_is_picklable_and_frozen(tiny_llama: Path) -> None:
    plan = plan_shards(tiny_llama, 2)
    copy = pickle.loads(pickle.dumps(plan))
    assert isinstance(copy, ShardPlan)
    assert copy == plan
    with pytest.raises(FrozenInstanceError):
        plan.tp_size = 4  # type: ignore[misc]


def test_accepts_an_open_checkpoint(tiny_llama: Path) -> None:
    assert plan_shards(open_checkpoint(tiny_llama), 4) == plan_shards(tiny_llama, 4)


def test_split1_rows_stay_compact_however_many(
    write_raw_safetensors: Callable[..., Path], tmp_path: Path
) -> None:
    path = _small(write_raw_safetensors, tmp_path, {"w": [4096, 8]})
    start = open_checkpoint(path).tensors["w"].start
    shard = plan_shards(path, 2, rules=[Rule("w", 1)]).ranks[1].shards[0]
    assert isinstance(shard.ranges, RowRanges)
    assert len(pickle.dumps(shard)) < 1000
    assert len(shard.ranges) == 4096 and shard.nbytes == 4096 * 16
    assert shard.ranges[-1] == ByteRange(str(path), start + 4095 * 32 + 16, 16)
    assert shard.ranges[1:3] == (
        ByteRange(str(path), start + 32 + 16, 16),
        ByteRange(str(path), start + 64 + 16, 16),
    )
    assert list(shard.ranges) == [shard.ranges[i] for i in range(4096)]
    assert shard.ranges == tuple(shard.ranges) and tuple(shard.ranges) == shard.ranges
    assert shard.ranges != tuple(shard.ranges)[:-1]
    with pytest.raises(IndexError):
        shard.ranges[4096]
