"""What a ``peer`` load received, and from whom (the ``peer`` backend's bookkeeping,
:mod:`rayload.loading.backends.peer`): :func:`receive_from_sources`, a source and then
each of its alternates asked for what is still missing, and :class:`Received`, what each
gave and how they failed, said in the load's report."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from rayload.loading.arrivals import Arrivals
from rayload.loading.peer import (
    PeerMismatch,
    PeerSource,
    PeerUnavailable,
    Pieces,
    Uploads,
    receive_shards,
)
from rayload.loading.plan import RankPlan
from rayload.loading.reader.pages import Prefaulter
from rayload.loading.report import PhaseTimer


@dataclass
class Received:
    """What a rank's peers gave and how they failed: ``given``, each source asked, in
    order, with how many tensors it completed and its :class:`Pieces` (which bytes it
    landed); ``failures``, each source that failed, and why; ``mismatch``, one sent what
    the plan does not hold; ``uploads``, the device copies made as tensors landed."""

    plan: RankPlan
    first: PeerSource
    uploads: Uploads
    given: list[tuple[PeerSource, int, Pieces]] = field(default_factory=list)
    failures: list[tuple[PeerSource, str]] = field(default_factory=list)
    mismatch: bool = False

    @property
    def pieces(self) -> list[tuple[Pieces, PeerSource]]:
        return [(pieces, source) for source, _, pieces in self.given]

    def nbytes(self, rest: RankPlan | None = None) -> int:
        """Bytes that landed from the sources, whole tensors or not (what this rank's own
        receivers may have had already), less those of ``rest``'s tensors (read again
        whole from storage)."""
        return sum(pieces.kept(rest) for _, _, pieces in self.given)

    @property
    def switched(self) -> bool:
        """Whether an alternate gave some of the tensors (the first source failed)."""
        return bool(self.failures) and any(
            n and s is not self.failures[0][0] for s, n, _ in self.given
        )

    def largest(self) -> PeerSource:
        """The source that gave the most bytes (the first asked, when none gave any)."""
        if not self.nbytes():
            return self.first
        return max(self.given, key=lambda g: g[2].nbytes)[0]

    def failed(self) -> str:
        """``<first source> failed mid-transfer: <why>``, then each alternate that failed
        too."""
        (first, why), *others = self.failures
        return "; ".join(
            [f"{first.describe()} failed mid-transfer: {why}"]
            + [f"{source.describe()} failed too: {why}" for source, why in others]
        )

    def account(self, rest: RankPlan | None = None, starts: Mapping[str, int] | None = None) -> str:
        """How the failures went and how many tensors (and bytes) came from where: kept
        from the first source, then from each alternate (a cut tensor it resumed named,
        with the byte it resumed at), then ``rest`` read from storage (those of
        ``starts`` from that byte on, their first bytes kept)."""
        starts = starts or {}
        again = rest and read_again(rest, starts)
        (_, n, pieces), *others = self.given
        parts = [
            f"{n} of {len(self.plan.shards)} tensors ({pieces.kept(again)} bytes) had arrived "
            "and were kept",
            *(
                f"{n} ({pieces.kept(again)} bytes{pieces.resumed_said()}) came from "
                f"{source.describe()}"
                for source, n, pieces in others
                if n
            ),
        ]
        if rest is not None:
            read = rest.nbytes - sum(starts.values())
            said = "".join(f", {name!r} from byte {at} on" for name, at in starts.items())
            parts.append(
                f"the other {len(rest.shards)} ({read} bytes{said}) were read from storage"
            )
        return f"{self.failed()}; {', '.join(parts)}"


def receive_from_sources(
    plan: RankPlan,
    peer: PeerSource,
    views: Sequence[torch.Tensor],
    arrivals: Arrivals,
    prefault: Prefaulter,
    timer: PhaseTimer,
    uploads: Uploads,
) -> Received:
    """Have ``peer`` fill ``views`` (each shard's memory) with ``plan``'s shards, then, when
    it fails part way, each of its alternates in turn with what is still missing (a
    tensor cut short from where its bytes stopped); every range is marked in
    ``arrivals`` as it lands (this rank's own receivers follow them) and in each source's
    :class:`Pieces` (a :data:`PIECES` span naming it)."""
    log = Received(plan, peer, uploads)
    index = {shard.name: i for i, shard in enumerate(plan.shards)}
    for source in [peer, *peer.alternates()]:
        part, part_views = missing_part(plan, arrivals, views)
        missing = {shard.name for shard in part.shards}
        offsets = {n: a for n in missing if (a := arrivals.arrived(index[n]))}
        pieces = Pieces(arrivals, timer.clock, offsets)

        def landed(name: str, offset: int, length: int, pieces: Pieces = pieces) -> None:
            pieces.landed(name, offset, length)
            prefault.advance(length)
            uploads.landed(index[name])

        try:
            receive_shards(part, source, part_views, landed, offsets)
        except PeerUnavailable as exc:
            log.failures.append((source, str(exc)))
            log.mismatch = isinstance(exc, PeerMismatch)
        log.given.append((source, len(missing - set(arrivals.missing())), pieces))
        if not log.failures or log.mismatch or not arrivals.missing():
            break
    return log


def missing_part(
    plan: RankPlan, arrivals: Arrivals, views: Sequence[torch.Tensor]
) -> tuple[RankPlan, list[torch.Tensor]]:
    """The part of ``plan`` whose tensors have not wholly arrived, and their memory (of
    ``views``, every shard's)."""
    missing = set(arrivals.missing())
    kept = [(s, v) for s, v in zip(plan.shards, views, strict=True) if s.name in missing]
    return replace(plan, shards=tuple(s for s, _ in kept)), [v for _, v in kept]


def read_again(rest: RankPlan, starts: Mapping[str, int]) -> RankPlan:
    """The tensors of ``rest`` read whole again: those not resumed from a byte (``starts``)."""
    return replace(rest, shards=tuple(s for s in rest.shards if s.name not in starts))
