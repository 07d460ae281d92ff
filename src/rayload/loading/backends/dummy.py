"""``dummy``: correct shapes and dtypes, random values, no checkpoint bytes read.

For engine start-up tests: the values are deterministic per (rank, tensor name), so two
runs (or two processes) produce the same weights.
"""

from __future__ import annotations

import zlib

import torch

from rayload.loading.backends.base import Backend, BackendResult, register, synchronize
from rayload.loading.dtypes import torch_dtype
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import RankPlan, TensorShard
from rayload.loading.report import READ, TO_DEVICE, PhaseTimer


@register(LoadMethod.DUMMY)
class DummyBackend(Backend):
    """Fills each shard with seeded random values on the device; ``bytes_read`` is 0."""

    def _load(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        with timer.phase(READ, bytes=0):
            pass
        with timer.phase(TO_DEVICE, device=str(device)):
            tensors = {s.name: _random_shard(s, plan.rank, device) for s in plan.shards}
            synchronize(device)  # the random fills run asynchronously on CUDA
        return BackendResult(tensors, 0, self.method)


def _random_shard(shard: TensorShard, rank: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device)
    generator.manual_seed(zlib.crc32(f"{rank}:{shard.name}".encode()))
    dtype = torch_dtype(shard.dtype)
    if dtype.is_floating_point:
        values = torch.randn(shard.shape, generator=generator, device=device)
        return (values * 0.02).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shard.shape, generator=generator, device=device).bool()
    high = 128 if dtype in (torch.int8, torch.uint8) else 1024
    values = torch.randint(0, high, shard.shape, generator=generator, device=device)
    return values.to(dtype)
