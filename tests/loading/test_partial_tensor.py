"""rayload.integrations.partial: what an engine's weight loaders may do with a tensor of
which the rank holds only its shard (vLLM's own loaders drive it in tests/vllm)."""

from __future__ import annotations

import pytest
import torch

from rayload.errors import ShardingError
from rayload.integrations.partial import PartialTensor, partial_tensor

FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def _rank1_of_2(split: int) -> torch.Tensor:
    """Rank 1's half of FULL along ``split``, as a partial tensor of FULL's shape."""
    half = FULL.shape[split] // 2
    shard = FULL.narrow(split, half, half).clone()
    return partial_tensor("w", FULL.shape, split, [(half, half)], shard, rank=1)


def test_narrow_inside_the_shard_gives_its_bytes() -> None:
    part = _rank1_of_2(0)
    assert isinstance(part, PartialTensor) and part.shape == FULL.shape
    assert torch.equal(part.narrow(0, 4, 4), FULL[4:])
    assert torch.equal(part.narrow(0, 5, 2), FULL[5:7])


def test_narrow_outside_the_shard_is_an_error_naming_the_tensor() -> None:
    with pytest.raises(ShardingError, match=r"'w'.*takes 0\.\.2 of dimension 0") as info:
        _rank1_of_2(0).narrow(0, 0, 2)
    assert info.value.tensor == "w"
    straddling = _rank1_of_2(0).narrow(0, 3, 2)  # one row held, one not: still partial
    with pytest.raises(ShardingError, match="it called copy_"):
        torch.empty(2, 6).copy_(straddling)


def test_any_other_use_is_an_error() -> None:
    with pytest.raises(ShardingError, match=r"it called .*add"):
        _rank1_of_2(0) + 1


@pytest.mark.parametrize("split", [0, 1])
def test_unsqueeze_then_unbind_keeps_the_shard(split: int) -> None:
    """vLLM's fused-MoE loader: ``loaded_weight.unsqueeze(0).unbind()`` per expert."""
    stacked = _rank1_of_2(split).unsqueeze(0)
    assert stacked.shape == (1, *FULL.shape)
    [expert] = stacked.unbind()
    half = FULL.shape[split] // 2
    assert expert.shape == FULL.shape
    assert torch.equal(expert.narrow(split, half, half), FULL.narrow(split, half, half))
    with pytest.raises(ShardingError):
        expert.narrow(split, 0, half)


def test_unbind_on_the_split_dimension_is_an_error() -> None:
    with pytest.raises(ShardingError, match="unbind on dimension 0, the split one"):
        _rank1_of_2(0).unbind(0)
