"""An in-process :class:`~rayload.loading.peer.PeerSource`: a "replica" whose rank holds
tensors loaded by ``load_rank`` and writes their bytes into the receiver's memory the way
the Ray transport does (sizes checked first, then tensor by tensor), plus the faults a
real peer can have: dying after some shards, a wrong byte count, a missing or foreign
tensor."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rayload.loading.peer import Landed, PeerUnavailable, check_sizes
from rayload.loading.plan import RankPlan


@dataclass
class TensorPeer:
    """Sends ``tensors`` (a rank's loaded shards by name) in plan order.

    ``fail_after`` raises :class:`PeerUnavailable` (or ``error`` when given) after that
    many shards; ``short`` names a tensor the holder has one byte short of; ``omit`` one
    it leaves out while sending; ``extra`` a name it sends that the plan does not hold.
    ``cut_at``: before it fails, it writes that many first bytes of the next shard (and
    says so to ``landed``), a tensor cut short. ``others`` are its alternates; ``part``:
    it is one, asked for some of its shards only. ``served`` counts shards sent,
    ``asked`` the offsets it was last asked to resume tensors at.
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
    others: Sequence[TensorPeer] = ()
    part: bool = False
    cut_at: int | None = None
    served: int = field(default=0, init=False)
    asked: dict[str, int] = field(default_factory=dict, init=False)
    via: str = field(default="", init=False)

    def describe(self) -> str:
        return f"replica {self.replica} rank {self.rank} on node {self.node_id}"

    def alternates(self) -> Sequence[TensorPeer]:
        return self.others

    def fetch(
        self,
        plan: RankPlan,
        destinations: Sequence[torch.Tensor],
        landed: Landed | None = None,
        offsets: Mapping[str, int] | None = None,
    ) -> Iterator[str]:
        sizes = {name: t.numel() * t.element_size() for name, t in self.tensors.items()}
        if self.short is not None:
            sizes[self.short] -= 1
        want = {shard.name: shard.nbytes for shard in plan.shards}
        check_sizes(want, sizes, part=self.part)
        self.via = "memory"
        self.asked = dict(offsets or {})
        for shard, destination in zip(plan.shards, destinations, strict=True):
            source = self.tensors[shard.name].contiguous().view(torch.uint8).reshape(-1)
            if self.fail_after is not None and self.served >= self.fail_after:
                if self.cut_at is not None and landed is not None:
                    destination[: self.cut_at] = source[: self.cut_at]
                    landed(shard.name, 0, self.cut_at)
                raise self.error or PeerUnavailable(
                    f"the holder's actor died after {self.served} shards"
                )
            if shard.name == self.omit:
                continue
            start = self.asked.get(shard.name, 0)
            destination[start:] = source[start:]
            self.served += 1
            yield shard.name
        if self.extra is not None:
            yield self.extra
