"""Getting a rank's shard bytes from a rank of another replica (the ``peer`` method).

A replica that already holds a rank's shards (same checkpoint identity, same plan:
:func:`~rayload.loading.identity.peer_key`) can hand them to the same rank of a new
replica, so the new one reads nothing from storage. This module is the Ray-free half:

* :class:`PeerSource`, what the transport (``rayload.actors``) implements: who holds the
  bytes and an iterator over ``(tensor name, buffer)`` for every shard of a plan;
* :class:`PeerUnavailable`, how a source says it could not give the bytes;
* :func:`receive_shards`, the copy loop the ``peer`` backend runs: it checks that every
  planned tensor arrives exactly once with exactly its shard's byte count and copies it
  into the memory the backend allocated, turning any failure of the source into
  :class:`PeerUnavailable` so the backend can discard what it got and read storage;
* :func:`source_label` and :func:`peer_attributes`, what the trace says about the source.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from rayload.loading.plan import RankPlan


class PeerUnavailable(Exception):
    """The peer could not give the bytes: it is gone, failed, or gave wrong shards. The
    message says why; the ``peer`` backend then reads storage instead."""


class PeerSource(Protocol):
    """A rank of another replica that holds the shards of a plan.

    ``replica`` is the holder replica's id, ``rank`` its rank, ``node_id`` its Ray node
    (None when unknown).
    """

    replica: str
    rank: int
    node_id: str | None

    def describe(self) -> str:
        """Who the peer is, for messages: e.g. ``"replica 3f2a rank 1 on node ab12..."``."""
        ...

    def fetch(self, plan: RankPlan) -> Iterator[tuple[str, Any]]:
        """``(tensor name, buffer)`` for every shard of ``plan``, in any order.

        Each buffer supports the buffer protocol (a 1-D uint8 numpy array, possibly
        read-only, a memoryview, bytes) and holds exactly that shard's bytes in row-major
        order. May raise :class:`PeerUnavailable` (or anything else, which counts as the
        peer failing) at any point.
        """
        ...


def source_label(peer: PeerSource) -> str:
    """The ``rayload.source`` of bytes from ``peer``:
    ``"peer replica=<id> rank=<r> node=<node>"`` (``node=unknown`` without a node id)."""
    return f"peer replica={peer.replica} rank={peer.rank} node={peer.node_id or 'unknown'}"


def peer_attributes(peer: PeerSource) -> dict[str, Any]:
    """The ``rank.read`` attributes naming the source (``rayload.`` is added by tracing);
    ``peer.node_id`` is None, and left off the span, when unknown."""
    return {
        "source": source_label(peer),
        "peer.replica": peer.replica,
        "peer.rank": peer.rank,
        "peer.node_id": peer.node_id,
    }


def receive_shards(plan: RankPlan, peer: PeerSource, destinations: Sequence[torch.Tensor]) -> int:
    """Copy every shard of ``plan`` from ``peer`` into ``destinations`` (shard ``i``'s
    memory as a 1-D uint8 CPU tensor of ``plan.shards[i].nbytes`` bytes); return the bytes
    received.

    Raises :class:`PeerUnavailable` saying what went wrong (it reads after "the peer
    failed: ") when the source raises anything, gives a buffer of another length or one
    without a row-major buffer, a tensor the plan does not hold, a tensor twice, or ends
    before every planned tensor arrived. The destinations may then hold some of the
    peer's bytes: the caller discards them.
    """
    index = {shard.name: i for i, shard in enumerate(plan.shards)}
    arrived: set[str] = set()
    received = 0
    items = _guarded(peer, plan)
    try:
        for name, buffer in items:
            i = index.get(name)
            if i is None:
                raise PeerUnavailable(
                    f"it sent tensor {name!r}, which rank {plan.rank}'s plan does not hold "
                    "(the peer's plan differs)"
                )
            if name in arrived:
                raise PeerUnavailable(f"it sent tensor {name!r} twice")
            source = _bytes_of(buffer, name)
            want = plan.shards[i].nbytes
            if source.size != want:
                raise PeerUnavailable(
                    f"it sent {source.size} bytes for tensor {name!r} (its shard has {want})"
                )
            arrived.add(name)
            if want:
                np.copyto(destinations[i].numpy(), source)
            received += want
    finally:
        items.close()
    if missing := index.keys() - arrived:
        raise PeerUnavailable(
            f"it ended without sending {len(missing)} of the {len(index)} tensors "
            f"(e.g. {min(missing)!r})"
        )
    return received


def _guarded(peer: PeerSource, plan: RankPlan) -> Generator[tuple[str, Any], None, None]:
    """``peer.fetch(plan)`` with any exception it raises (when called or while iterating)
    turned into :class:`PeerUnavailable`; closing it closes the peer's iterator."""
    try:
        iterator = iter(peer.fetch(plan))
    except Exception as exc:
        raise PeerUnavailable(_cause(exc)) from exc
    try:
        while True:
            try:
                item = next(iterator)
            except StopIteration:
                return
            except Exception as exc:
                raise PeerUnavailable(_cause(exc)) from exc
            yield item
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def _bytes_of(buffer: Any, name: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``buffer``'s bytes as a 1-D uint8 array (no copy); PeerUnavailable when it has no
    row-major (C-contiguous) buffer."""
    try:
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise ValueError("its buffer is not row-major contiguous")
        return np.frombuffer(view, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise PeerUnavailable(
            f"it sent tensor {name!r} as {type(buffer).__name__}, not a buffer of bytes ({exc})"
        ) from exc


def _cause(exc: Exception) -> str:
    """What a source's exception says: its own message for PeerUnavailable, else its type
    and message."""
    if isinstance(exc, PeerUnavailable):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
