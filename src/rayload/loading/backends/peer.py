"""``peer``: the rank's shards copied from a rank of another replica that holds them.

``rank.read`` allocates the shards' host tensors (one after the other in one
allocation, :func:`~rayload.loading.reader.sinks.host_buffers`, so a run of small
tensors lands from the channel in one piece, with no copy) and copies the peer's bytes in
(:func:`~rayload.loading.peer.receive_shards`: every planned tensor exactly once, each
with exactly its shard's byte count); ``rank.to_device`` moves them to the device. When
the peer fails part way (it died, stalled, or stopped sending), the bytes that had
arrived are kept and the others are asked of the peer's alternates in turn (other
holders, nearest first: :meth:`~rayload.loading.peer.PeerSource.alternates`; a tensor cut
short from the byte where it stopped); when those give everything, the method is still
``peer`` and ``peer_switch`` names the switch. What none gave is read from storage into
the same memory (``scratch``'s reader: a cut tensor from where it stopped; a method that
reads whole tensors: the ``storage`` method, a cut tensor whole), marked as it lands, so
this rank's own receivers go on (the load does not start over); when nothing had landed,
or a peer sent what the plan does not hold, the rank reads all of it from storage. Either
is reported as a fallback: ``effective`` is the storage method, whose phases say
``rayload.source=storage``, and the reason says who failed and how many tensors came from
where. Nothing half-loaded is returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from rayload.loading.arrivals import Arrivals, Publish
from rayload.loading.backends.base import BACKENDS, Backend, BackendResult, register, synchronize
from rayload.loading.methods import LoadMethod
from rayload.loading.peer import (
    PeerMismatch,
    PeerSource,
    PeerUnavailable,
    Pieces,
    peer_attributes,
    receive_shards,
    source_label,
)
from rayload.loading.plan import RankPlan
from rayload.loading.reader.pages import Prefaulter
from rayload.loading.reader.readplan import shard_segments, tail_segments
from rayload.loading.reader.reads import read_segments, shard_tensors
from rayload.loading.reader.sinks import host_buffers
from rayload.loading.report import READ, STORAGE_SOURCE, TO_DEVICE, PhaseTimer


@register(LoadMethod.PEER)
class PeerBackend(Backend):
    """Copies the plan's shards from ``peer``; ``bytes_read`` is 0 and
    ``bytes_from_peers`` the plan's bytes, unless it fell back to ``storage``."""

    def _load(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        return self._fill(plan, device, timer, host_buffers([s.nbytes for s in plan.shards]))

    def _load_into(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        views: Sequence[torch.Tensor],
        written: set[str],
    ) -> BackendResult:
        """Straight into resident host tensors (an engine's parameters on the CPU, a
        reload's tensors): the channel writes each piece into them (a run of them in one
        go where they are adjacent, else through a bucket copied out). Device memory is
        not a gloo channel's: fresh host memory then, copied in."""
        if any(v.device.type != "cpu" for v in views):
            return super()._load_into(plan, device, timer, views, written)
        written.update(s.name for s in plan.shards)
        return self._fill(plan, device, timer, list(views), resident=True)

    def _fill(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        views: list[torch.Tensor],
        *,
        resident: bool = False,
    ) -> BackendResult:
        """Receive ``plan`` into ``views`` (each shard's host bytes; ``resident``: the
        caller's tensors, which a fall back to storage reads into too)."""
        peer = self._peer()
        with timer.phase(READ, bytes=plan.nbytes, **peer_attributes(peer)) as attrs:
            hosts = list(shard_tensors(plan.shards, views).values())
            arrivals = (self.publish or Arrivals)(
                [s.name for s in plan.shards], views, relayed=True
            )
            prefault = Prefaulter(views)
            try:
                log = _receive(plan, peer, views, arrivals, prefault, timer)
            finally:
                attrs["peer.prefault"] = prefault.stop()
            if log.failures:
                attrs["peer.error"] = log.failures[0][1]
            if not arrivals.missing():
                attrs["bytes_from_peers"] = log.nbytes()
            if peer.via:
                attrs["peer.via"] = peer.via
            if log.switched:
                attrs["peer.switch"] = log.account()
        for pieces, source in log.pieces:
            pieces.record(timer, source_label(source))
        if not log.failures:
            return self._to_device(plan, device, timer, hosts, log)
        if log.mismatch or (not log.nbytes() and self.publish is None):
            # Nothing to keep, and no receiver of this rank's to keep going: storage reads
            # it all, its own way (straight to the device where it can).
            del hosts
            return self._from_storage(plan, device, timer, log, views if resident else None)
        if not arrivals.missing():  # every byte from peers: an alternate gave the rest
            return self._to_device(plan, device, timer, hosts, log)
        return self._rest_from_storage(plan, device, timer, log, hosts, arrivals)

    def _to_device(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        hosts: list[torch.Tensor],
        log: _Received,
        *,
        rest: RankPlan | None = None,
        bytes_read: int = 0,
        fallback_reason: str | None = None,
    ) -> BackendResult:
        """Move ``hosts`` to ``device``: the result, ``rest`` its tensors read from storage
        (``bytes_read``) after the peers failed (``fallback_reason``)."""
        with timer.phase(TO_DEVICE, device=str(device)):
            tensors = {s.name: h.to(device) for s, h in zip(plan.shards, hosts, strict=True)}
            synchronize(device)
        effective = self.method if fallback_reason is None else self.storage
        assert effective is not None
        return BackendResult(
            tensors,
            bytes_read,
            effective,
            fallback_reason=fallback_reason,
            bytes_from_peers=log.nbytes(rest),
            source=source_label(log.largest()),
            peer_switch=log.account() if log.switched else None,
        )

    def _rest_from_storage(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        log: _Received,
        hosts: list[torch.Tensor],
        arrivals: Arrivals,
    ) -> BackendResult:
        """The peers failed after some bytes had arrived: keep those, read the others from
        storage into the same memory (a cut tensor: ``scratch`` from where it stopped,
        others whole), move them all; the result names the switch and what came whence."""
        rest, views = _missing_part(plan, arrivals, arrivals.buffers)
        starts: dict[str, int] = {}
        with timer.tagged(source=STORAGE_SOURCE):
            if self.storage is LoadMethod.SCRATCH:  # byte ranges: a cut tensor's rest only
                index = {name: i for i, name in enumerate(arrivals.names)}
                starts = {s.name: a for s in rest.shards if (a := arrivals.arrived(index[s.name]))}
                bytes_read, reason = self._read_rest(rest, views, starts, arrivals, timer), None
            else:  # a method that reads whole tensors
                storage = self._storage_backend(publish=partial(_Rest, arrivals))
                result = storage._load_into(rest, torch.device("cpu"), timer, views, set())
                bytes_read, reason = result.bytes_read, result.fallback_reason
        for shard in rest.shards:  # a storage method that publishes nothing as it reads
            arrivals.landed_name(shard.name, 0, shard.nbytes)
        return self._to_device(
            plan,
            device,
            timer,
            hosts,
            log,
            rest=_read_again(rest, starts),
            bytes_read=bytes_read,
            fallback_reason=_joined(log.account(rest, starts), reason),
        )

    def _read_rest(
        self,
        rest: RankPlan,
        views: Sequence[torch.Tensor],
        starts: Mapping[str, int],
        arrivals: Arrivals,
        timer: PhaseTimer,
    ) -> int:
        """``scratch``'s read of ``rest`` into ``views`` (its shards' memory), a tensor of
        ``starts`` (name -> the bytes in place) from there on; each range marked in
        ``arrivals`` as it lands. Returns the bytes read."""
        at = [starts.get(s.name, 0) for s in rest.shards]
        segments = [
            segment
            for i, shard in enumerate(rest.shards)
            for segment in tail_segments(shard_segments([shard]), at[i], i)
        ]
        sizes = [s.nbytes - a for s, a in zip(rest.shards, at, strict=True)]
        names = [s.name for s in rest.shards]
        with timer.phase(READ, bytes=sum(sizes)) as attrs:
            _, _, bytes_read = read_segments(
                segments,
                sizes,
                torch.device("cpu"),
                self.options,
                targets=[v[a:] for v, a in zip(views, at, strict=True)],
                publish=lambda buffers: _Rest(arrivals, names, buffers, starts=at),
            )
            attrs["bytes_read"] = bytes_read
        return bytes_read

    def _peer(self) -> PeerSource:
        if self.peer is None or self.storage is None:
            raise ValueError(
                "the peer backend needs peer= (the rank holding the shards) and storage= "
                "(the method to read with when it fails); resolve_method selects peer only "
                "when a peer is available"
            )
        return self.peer

    def _from_storage(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        log: _Received,
        resident: list[torch.Tensor] | None,
    ) -> BackendResult:
        """Read ``plan`` with the storage method (into ``resident``, the caller's
        tensors, when given), its phases tagged ``source=storage``; the result says the
        peers failed and why (joined with the storage method's own fallback reason, when
        it has one)."""
        storage = self._storage_backend(publish=self.publish)
        with timer.tagged(source=STORAGE_SOURCE):
            if resident is None:
                result = storage._load(plan, device, timer)
            else:
                result = storage._load_into(plan, device, timer, resident, set())
        reason = f"{log.failed()}; read from storage instead"
        return replace(result, fallback_reason=_joined(reason, result.fallback_reason))

    def _storage_backend(self, *, publish: Publish | None) -> Backend:
        """The storage method's backend, for what the peer did not give."""
        assert self.storage is not None
        return BACKENDS[self.storage](
            self.probe, checkpoint=self.checkpoint, options=self.options, publish=publish
        )


@dataclass
class _Received:
    """What a rank's peers gave and how they failed: ``given``, each source asked, in
    order, with how many tensors it completed and its :class:`Pieces` (which bytes it
    landed); ``failures``, each source that failed, and why; ``mismatch``, one sent what
    the plan does not hold."""

    plan: RankPlan
    first: PeerSource
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
        again = rest and _read_again(rest, starts)
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


def _receive(
    plan: RankPlan,
    peer: PeerSource,
    views: Sequence[torch.Tensor],
    arrivals: Arrivals,
    prefault: Prefaulter,
    timer: PhaseTimer,
) -> _Received:
    """Have ``peer`` fill ``views`` (each shard's memory) with ``plan``'s shards, then, when
    it fails part way, each of its alternates in turn with what is still missing (a
    tensor cut short from where its bytes stopped); every range is marked in
    ``arrivals`` as it lands (this rank's own receivers follow them) and in each source's
    :class:`Pieces` (a :data:`PIECES` span naming it)."""
    log = _Received(plan, peer)
    index = {shard.name: i for i, shard in enumerate(plan.shards)}
    for source in [peer, *peer.alternates()]:
        part, part_views = _missing_part(plan, arrivals, views)
        missing = {shard.name for shard in part.shards}
        offsets = {n: a for n in missing if (a := arrivals.arrived(index[n]))}
        pieces = Pieces(arrivals, timer.clock, offsets)

        def landed(name: str, offset: int, length: int, pieces: Pieces = pieces) -> None:
            pieces.landed(name, offset, length)
            prefault.advance(length)

        try:
            receive_shards(part, source, part_views, landed, offsets)
        except PeerUnavailable as exc:
            log.failures.append((source, str(exc)))
            log.mismatch = isinstance(exc, PeerMismatch)
        log.given.append((source, len(missing - set(arrivals.missing())), pieces))
        if not log.failures or log.mismatch or not arrivals.missing():
            break
    return log


def _missing_part(
    plan: RankPlan, arrivals: Arrivals, views: Sequence[torch.Tensor]
) -> tuple[RankPlan, list[torch.Tensor]]:
    """The part of ``plan`` whose tensors have not wholly arrived, and their memory (of
    ``views``, every shard's)."""
    missing = set(arrivals.missing())
    kept = [(s, v) for s, v in zip(plan.shards, views, strict=True) if s.name in missing]
    return replace(plan, shards=tuple(s for s, _ in kept)), [v for _, v in kept]


class _Rest(Arrivals):
    """The arrivals of the tensors a failed peer did not give, read from storage into the
    plan's memory: each range marked here is marked in the whole plan's ``arrivals`` too,
    so this rank's own receivers get the storage read's bytes as they land."""

    def __init__(
        self,
        arrivals: Arrivals,
        names: Sequence[str],
        buffers: Sequence[torch.Tensor],
        *,
        relayed: bool = False,
        starts: Sequence[int] = (),
    ) -> None:
        super().__init__(names, buffers, relayed=relayed)
        self._plan = arrivals
        self._starts = tuple(starts) or (0,) * len(self.names)

    def landed(self, index: int, offset: int, length: int) -> int:
        self._plan.landed_name(self.names[index], self._starts[index] + offset, length)
        return super().landed(index, offset, length)


def _read_again(rest: RankPlan, starts: Mapping[str, int]) -> RankPlan:
    """The tensors of ``rest`` read whole again: those not resumed from a byte (``starts``)."""
    return replace(rest, shards=tuple(s for s in rest.shards if s.name not in starts))


def _joined(reason: str, other: str | None) -> str:
    """``reason``, then the storage method's own fallback reason when it has one."""
    return "; ".join([reason, *([other] if other else [])])
