"""``scratch``: rayload's own shard-exact reader, the method that runs everywhere.

Each shard gets one preallocated destination (a host tensor on CPU; a device tensor on
CUDA, filled through bounded pinned staging buffers); only the plan's byte ranges are read,
with parallel ``os.preadv`` calls straight into the destination's memory. Tensors are views
of their destination, so peak host memory on CPU is the shard size plus nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from rayload.loading.arrivals import Arrivals
from rayload.loading.backends.base import BackendResult, ReaderBackend, register
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import RankPlan
from rayload.loading.reader.group import (
    GroupShare,
    checked_round,
    plan_share,
    scatter_round,
    whole_segments,
)
from rayload.loading.reader.readplan import Segment, shard_segments
from rayload.loading.reader.reads import read_segments, shard_tensors
from rayload.loading.reader.sinks import Sink
from rayload.loading.report import READ, TO_DEVICE, PhaseTimer
from rayload.loading.storage import is_remote


@register(LoadMethod.SCRATCH)
class ScratchBackend(ReaderBackend):
    """Reads exactly the plan's byte ranges; ``bytes_read`` equals ``plan.nbytes``.
    Into resident tensors it reads straight into their memory (no allocation on CPU; on
    CUDA only the pinned staging ring).

    From object storage, given the TP group's process group (``group``), the ranks
    fetch each split-1 tensor once between them (:mod:`~rayload.loading.reader.group`):
    ``bytes_read`` is then what this rank fetched, whole tensors for the others included."""

    def _read(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        targets: Sequence[torch.Tensor],
        touched: set[int] | None,
    ) -> BackendResult:
        shards = plan.shards
        sizes = [s.nbytes for s in shards]
        share = self._share(plan, device)
        segments = shard_segments(shards)
        with timer.phase(READ, bytes=plan.nbytes) as attrs:
            if share is None:
                buffers, sink, bytes_read = read_segments(
                    segments,
                    sizes,
                    device,
                    self.options,
                    targets=targets,
                    touched=touched,
                    publish=self._publisher(plan),
                    keep=len(shards),
                )
            else:
                buffers, sink, bytes_read = self._read_shared(
                    plan, share, segments, device, targets, touched, attrs
                )
            attrs["bytes_read"] = bytes_read
        with timer.phase(TO_DEVICE, device=str(device)):
            sink.finish()
            tensors = shard_tensors(shards, buffers)
        return BackendResult(tensors, bytes_read, self.method)

    def _share(self, plan: RankPlan, device: torch.device) -> GroupShare | None:
        """The split-1 tensors this rank's TP group fetches once (:mod:`..reader.group`):
        only from object storage, with the group's backend for ``device``'s tensors."""
        group = self.group
        if group is None or self.checkpoint is None or not is_remote(self.checkpoint.root):
            return None
        import torch.distributed as dist

        if dist.get_world_size(group) != plan.tp_size or dist.get_rank(group) != plan.rank:
            return None
        if dist.get_backend(group) != ("nccl" if device.type == "cuda" else "gloo"):
            return None
        return plan_share(plan.shards, group)

    def _read_shared(
        self,
        plan: RankPlan,
        share: GroupShare,
        segments: list[Segment],
        device: torch.device,
        targets: Sequence[torch.Tensor],
        touched: set[int] | None,
        attrs: dict[str, Any],
    ) -> tuple[list[torch.Tensor], Sink, int]:
        """This rank's other shards and its first round of whole tensors in one read, then
        round by round: scatter, fetch the next whole tensors (``attrs`` of rank.read get
        what was shared)."""
        sizes = [s.nbytes for s in plan.shards]
        shared, n = share.targets, len(sizes)
        first = share.owned(0)
        arrivals: list[Arrivals] = []  # what a holder forwards while it loads

        def read_round(round_: int) -> tuple[list[torch.Tensor], Sink, int]:
            """Round 0: this rank's other shards and its first whole tensors; then the
            round's whole tensors. Its device copies are waited for before the group's
            collective: its arrivals are told then, and a group that fails leaves no copy
            in flight."""
            if round_:
                owned = share.owned(round_)
                read = read_segments(
                    whole_segments(owned, 0), [s.nbytes for s in owned], device, self.options
                )
            else:
                read = read_segments(
                    [s for s in segments if s.target not in shared] + whole_segments(first, n),
                    sizes + [s.nbytes for s in first],
                    device,
                    self.options,
                    targets=targets,
                    touched=touched,
                    publish=self._publisher(plan),
                    arrivals_out=arrivals,
                    keep=n,
                )
            read[1].finish()
            return read

        buffers, sink, bytes_read = checked_round(share, self.group, partial(read_round, 0))
        wholes, buffers = buffers[n:], buffers[:n]
        scatter_s = 0.0
        for round_ in range(len(share.rounds)):
            if round_:
                wholes, _, fetched = checked_round(share, self.group, partial(read_round, round_))
                bytes_read += fetched
            started = time.perf_counter()
            scatter_round(
                share, round_, self.group, buffers, wholes, touched, next(iter(arrivals), None)
            )
            scatter_s += time.perf_counter() - started
            wholes = []
        attrs.update(
            {
                "group.shared_tensors": len(share.shared),
                "group.fetched_bytes": share.fetched_bytes,
                "group.rounds": len(share.rounds),
                "group.scatter_ms": round(scatter_s * 1e3, 1),
            }
        )
        return buffers, sink, bytes_read
