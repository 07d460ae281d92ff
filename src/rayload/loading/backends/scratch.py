"""``scratch``: rayload's own shard-exact reader, the method that runs everywhere.

Each shard gets one preallocated destination (a host tensor on CPU; a device tensor on
CUDA, filled through bounded pinned staging buffers); only the plan's byte ranges are read,
with parallel ``os.preadv`` calls straight into the destination's memory. Tensors are views
of their destination, so peak host memory on CPU is the shard size plus nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rayload.loading.backends.base import BackendResult, ReaderBackend, register
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import RankPlan
from rayload.loading.reader.readplan import shard_segments
from rayload.loading.reader.reads import read_segments, shard_tensors
from rayload.loading.report import READ, TO_DEVICE, PhaseTimer


@register(LoadMethod.SCRATCH)
class ScratchBackend(ReaderBackend):
    """Reads exactly the plan's byte ranges; ``bytes_read`` equals ``plan.nbytes``.
    Into resident tensors it reads straight into their memory (no allocation on CPU; on
    CUDA only the pinned staging ring)."""

    def _read(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        targets: Sequence[torch.Tensor],
        touched: set[int] | None,
    ) -> BackendResult:
        shards = plan.shards
        with timer.phase(READ, bytes=plan.nbytes) as attrs:
            buffers, sink, bytes_read = read_segments(
                shard_segments(shards),
                [s.nbytes for s in shards],
                device,
                self.options,
                targets=targets,
                touched=touched,
            )
            attrs["bytes_read"] = bytes_read
        with timer.phase(TO_DEVICE, device=str(device)):
            sink.finish()
            tensors = shard_tensors(shards, buffers)
        return BackendResult(tensors, bytes_read, self.method)
