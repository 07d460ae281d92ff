"""Which torch device a rank actor loads onto. Pure, so it is tested without GPUs.

Inside a Ray actor the GPU is the actor's *local* device: Ray sets
``CUDA_VISIBLE_DEVICES`` to the GPU(s) it assigned, so the rank's GPU is always
``cuda:0`` of the visible set, never ``cuda:{rank}``.
"""

from __future__ import annotations

from collections.abc import Sequence

from rayload.errors import ConfigError
from rayload.options import check_device

LOCAL_CUDA_DEVICE = "cuda:0"


def rank_device(
    requested: str, *, gpu_ids: Sequence[object], cuda_device_count: int, rank: int
) -> str:
    """The torch device string for a rank.

    ``requested`` is ``auto`` (the local GPU when Ray assigned one and torch sees CUDA, else
    ``cpu``), ``cpu``, or ``cuda`` (the local GPU, or :class:`ConfigError` naming what is
    missing). ``gpu_ids`` are the ids Ray assigned the actor (``ray.get_gpu_ids()``);
    ``cuda_device_count`` is what torch sees in the actor's process.
    """
    check_device(requested)
    if requested == "cpu":
        return "cpu"
    has_gpu = bool(gpu_ids) and cuda_device_count > 0
    if requested == "auto":
        return LOCAL_CUDA_DEVICE if has_gpu else "cpu"
    if not gpu_ids:
        raise ConfigError(
            f"rank {rank}: device='cuda' but Ray assigned this rank no GPU; the cluster needs "
            "a GPU per rank (or load with device='cpu')"
        )
    if cuda_device_count == 0:
        raise ConfigError(
            f"rank {rank}: device='cuda' and Ray assigned GPU {list(gpu_ids)}, but torch sees "
            "no CUDA device in the actor (CPU-only torch or missing driver?)"
        )
    return LOCAL_CUDA_DEVICE
