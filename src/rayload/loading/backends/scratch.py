"""``scratch``: rayload's own shard-exact reader, the method that runs everywhere.

Each shard gets one preallocated destination (a host tensor on CPU; a device tensor on
CUDA, filled through bounded pinned staging buffers); only the plan's byte ranges are read,
with parallel ``os.preadv`` calls straight into the destination's memory. Tensors are views
of their destination, so peak host memory on CPU is the shard size plus nothing.
"""

from __future__ import annotations

import torch

from rayload.loading.backends.base import Backend, BackendResult, register
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import RankPlan
from rayload.loading.reader.readplan import shard_segments
from rayload.loading.reader.reads import read_segments, shard_tensors
from rayload.loading.report import READ, TO_DEVICE, PhaseTimer


@register(LoadMethod.SCRATCH)
class ScratchBackend(Backend):
    """Reads exactly the plan's byte ranges; ``bytes_read`` equals ``plan.nbytes``."""

    def _load(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        shards = plan.shards
        with timer.phase(READ, bytes=plan.nbytes) as attrs:
            buffers, sink, bytes_read = read_segments(
                shard_segments(shards), [s.nbytes for s in shards], device, self.options
            )
            attrs["bytes_read"] = bytes_read
        with timer.phase(TO_DEVICE, device=str(device)):
            sink.finish()
            tensors = shard_tensors(shards, buffers)
        return BackendResult(tensors, bytes_read, self.method)
