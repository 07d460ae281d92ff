"""``peer``: the rank's shards copied from a rank of another replica that holds them.

``rank.read`` allocates each shard's host tensor and copies the peer's bytes in
(:func:`~rayload.loading.peer.receive_shards`: every planned tensor exactly once, each
with exactly its shard's byte count); ``rank.to_device`` moves them to the device. When
the peer fails at any point, what it sent is discarded (nothing half-loaded is returned)
and the rank reads storage with the ``storage`` method instead, reported as a fallback:
``effective`` is that method, whose phases say ``rayload.source=storage``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rayload.loading.backends.base import BACKENDS, Backend, BackendResult, register, synchronize
from rayload.loading.dtypes import torch_dtype
from rayload.loading.methods import LoadMethod
from rayload.loading.peer import (
    PeerSource,
    PeerUnavailable,
    peer_attributes,
    receive_shards,
    source_label,
)
from rayload.loading.plan import RankPlan
from rayload.loading.reader.reads import byte_view
from rayload.loading.report import READ, STORAGE_SOURCE, TO_DEVICE, PhaseTimer


@register(LoadMethod.PEER)
class PeerBackend(Backend):
    """Copies the plan's shards from ``peer``; ``bytes_read`` is 0 and
    ``bytes_from_peers`` the plan's bytes, unless it fell back to ``storage``."""

    def _load(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        peer = self._peer()
        failure: PeerUnavailable | None = None
        with timer.phase(READ, bytes=plan.nbytes, **peer_attributes(peer)) as attrs:
            hosts = [torch.empty(s.shape, dtype=torch_dtype(s.dtype)) for s in plan.shards]
            try:
                received = receive_shards(plan, peer, [_bytes(h) for h in hosts])
            except PeerUnavailable as exc:
                failure = exc
                attrs["peer.error"] = str(exc)
            else:
                attrs["bytes_from_peers"] = received
            if peer.via:
                attrs["peer.via"] = peer.via
        if failure is not None:
            del hosts
            return self._from_storage(plan, device, timer, peer, failure)
        with timer.phase(TO_DEVICE, device=str(device)):
            tensors = {s.name: h.to(device) for s, h in zip(plan.shards, hosts, strict=True)}
            synchronize(device)
        return BackendResult(
            tensors, 0, self.method, bytes_from_peers=received, source=source_label(peer)
        )

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
        peer: PeerSource,
        failure: PeerUnavailable,
    ) -> BackendResult:
        """Read ``plan`` with the storage method, its phases tagged ``source=storage``;
        the result says the peer failed and why (joined with the storage method's own
        fallback reason, when it has one)."""
        assert self.storage is not None
        storage = BACKENDS[self.storage](
            self.probe, checkpoint=self.checkpoint, options=self.options
        )
        with timer.tagged(source=STORAGE_SOURCE):
            result = storage._load(plan, device, timer)
        reason = f"{peer.describe()} failed mid-transfer: {failure}; read from storage instead"
        reasons = [reason, *([result.fallback_reason] if result.fallback_reason else [])]
        return replace(result, fallback_reason="; ".join(reasons))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    view = byte_view(tensor)
    assert view is not None, "a fresh tensor is contiguous"
    return view
