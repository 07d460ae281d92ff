"""``peer``: the rank's shards copied from a rank of another replica that holds them.

``rank.read`` allocates the shards' host tensors (one after the other in one
allocation, :func:`~rayload.loading.reader.sinks.host_buffers`, so a run of small
tensors lands from the channel in one piece, with no copy) and copies the peer's bytes in
(:func:`~rayload.loading.peer.receive_shards`: every planned tensor exactly once, each
with exactly its shard's byte count); onto a GPU each tensor is copied as soon as it has
wholly landed, on a thread of its own (:class:`~rayload.loading.peer.Uploads`), and
``rank.to_device`` copies what is left and waits (``copied_while_receiving``). When
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
from dataclasses import replace
from functools import partial

import torch

from rayload.loading.arrivals import Arrivals, Publish
from rayload.loading.backends.base import BACKENDS, Backend, BackendResult, register, synchronize
from rayload.loading.methods import LoadMethod
from rayload.loading.peer import (
    PeerSource,
    Uploads,
    peer_attributes,
    source_label,
)
from rayload.loading.peer_received import Received, missing_part, read_again, receive_from_sources
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
            uploads = Uploads(arrivals, hosts, None if device.type == "cpu" else device)
            try:
                log = receive_from_sources(plan, peer, views, arrivals, prefault, timer, uploads)
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
        with uploads:  # its thread ends whichever way this does
            if not log.failures:
                return self._to_device(plan, device, timer, hosts, log)
            if log.mismatch or (not log.nbytes() and self.publish is None):
                # Nothing to keep, and no receiver of this rank's to keep going: storage
                # reads it all, its own way (straight to the device where it can).
                del hosts
                uploads.finish().clear()  # nothing of it is kept: free the device
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
        log: Received,
        *,
        rest: RankPlan | None = None,
        bytes_read: int = 0,
        fallback_reason: str | None = None,
    ) -> BackendResult:
        """Move ``hosts`` to ``device``: the result, ``rest`` its tensors read from storage
        (``bytes_read``) after the peers failed (``fallback_reason``)."""
        with timer.phase(TO_DEVICE, device=str(device)) as attrs:
            early = log.uploads.finish()  # those copied as they landed, while receiving
            tensors = {
                s.name: early[i] if i in early else h.to(device)
                for i, (s, h) in enumerate(zip(plan.shards, hosts, strict=True))
            }
            synchronize(device)
            if early:
                attrs["copied_while_receiving"] = sum(t.nbytes for t in early.values())
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
        log: Received,
        hosts: list[torch.Tensor],
        arrivals: Arrivals,
    ) -> BackendResult:
        """The peers failed after some bytes had arrived: keep those, read the others from
        storage into the same memory (a cut tensor: ``scratch`` from where it stopped,
        others whole), move them all; the result names the switch and what came whence."""
        rest, views = missing_part(plan, arrivals, arrivals.buffers)
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
            rest=read_again(rest, starts),
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
        log: Received,
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


def _joined(reason: str, other: str | None) -> str:
    """``reason``, then the storage method's own fallback reason when it has one."""
    return "; ".join([reason, *([other] if other else [])])
