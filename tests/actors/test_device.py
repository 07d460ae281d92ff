from __future__ import annotations

import pytest

from rayload.actors.device import rank_device
from rayload.errors import ConfigError


@pytest.mark.parametrize(
    ("requested", "gpu_ids", "cuda_count", "expected"),
    [
        ("auto", ["3"], 1, "cuda:0"),  # Ray's GPU 3 is cuda:0 of the visible set
        ("auto", ["3"], 0, "cpu"),  # fake GPU / CPU-only torch
        ("auto", [], 8, "cpu"),  # no GPU assigned to this actor
        ("cpu", ["1"], 1, "cpu"),
        ("cuda", ["7"], 1, "cuda:0"),
    ],
)
def test_resolve_device_uses_local_device_never_rank_index(
    requested: str, gpu_ids: list[str], cuda_count: int, expected: str
) -> None:
    assert rank_device(requested, gpu_ids=gpu_ids, cuda_device_count=cuda_count, rank=5) == expected


def test_resolve_device_cuda_without_assigned_gpu_names_rank() -> None:
    with pytest.raises(
        ConfigError, match="rank 2: device='cuda' but Ray assigned this rank no GPU"
    ):
        rank_device("cuda", gpu_ids=[], cuda_device_count=1, rank=2)


def test_resolve_device_cuda_without_torch_cuda_names_gpu_ids() -> None:
    with pytest.raises(ConfigError, match=r"GPU \['0'\], but torch sees no CUDA"):
        rank_device("cuda", gpu_ids=["0"], cuda_device_count=0, rank=0)


def test_resolve_device_rejects_unknown_request() -> None:
    with pytest.raises(ConfigError, match="device must be one of"):
        rank_device("tpu", gpu_ids=[], cuda_device_count=0, rank=0)
