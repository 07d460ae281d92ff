"""An in-process :class:`~rayload.loading.peer.PeerSource`: a "replica" whose rank holds
tensors loaded by ``load_rank`` and serves their bytes the way the Ray transport does (a
1-D uint8 numpy array per shard, here read-only), plus the faults a real peer can have:
dying after some shards, a wrong byte count, a missing or foreign tensor."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rayload.loading.peer import PeerUnavailable
from rayload.loading.plan import RankPlan


@dataclass
class TensorPeer:
    """Serves ``tensors`` (a rank's loaded shards by name) in plan order.

    ``fail_after`` raises :class:`PeerUnavailable` (or ``error`` when given) after that
    many shards; ``short`` names a tensor sent one byte short; ``omit`` one left out;
    ``extra`` a name sent that the plan does not hold. ``served`` counts shards handed out.
    """

    tensors: Mapping[str, torch.Tensor]
    replica: str = "3f2a"
    rank: int = 0
    node_id: str | None = "ab12cd34"
    fail_after: int | None = None
    error: Exception | None = None
    short: str | None = None
    omit: str | None = None
    extra: str | None = None
    served: int = field(default=0, init=False)

    def describe(self) -> str:
        return f"replica {self.replica} rank {self.rank} on node {self.node_id}"

    def fetch(self, plan: RankPlan) -> Iterator[tuple[str, Any]]:
        for shard in plan.shards:
            if self.fail_after is not None and self.served >= self.fail_after:
                raise self.error or PeerUnavailable(
                    f"the holder's actor died after {self.served} shards"
                )
            if shard.name == self.omit:
                continue
            data = self.tensors[shard.name].contiguous().view(torch.uint8).reshape(-1).numpy()
            if shard.name == self.short:
                data = data[:-1]
            data = np.array(data, copy=True)
            data.flags.writeable = False
            self.served += 1
            yield shard.name, data
        if self.extra is not None:
            yield self.extra, np.zeros(4, dtype=np.uint8)
