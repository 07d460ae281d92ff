"""Driver side of peer loading: register a load's replicas in the cluster's directory, pick
where each rank gets its shards from, and keep the directory in step with the replicas.

A load's replicas are claimed in order once their ranks are up; replica ``i`` sees every
replica registered before it for the same key (other loads' and this load's replicas
``0..i-1``), so with several replicas started together the first reads storage and the
others receive from it, each rank over a gloo group of two with its holder
(:mod:`rayload.actors.peers`). Only holders whose rank actors answer a ping are used; dead
ones are dropped from the directory on the spot.

For rank ``r`` the source is, in order of preference: a holder that has finished loading,
one whose rank ``r`` is on the same node (loopback, not the network), then spread
over the loaded holders by receiver and rank; among holders still loading, the oldest
(the one reading storage, not one that is itself receiving). A directory that cannot be
reached is one warning and no peers: the load reads storage.
"""

from __future__ import annotations

import logging
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import RayError

from rayload.actors.directory import (
    DirectoryUnavailable,
    ReplicaEntry,
    call,
    directory,
    live_holders,
    replaced_since_last_use,
)
from rayload.actors.peers import PeerRef
from rayload.actors.rank_group import RankActorGroup
from rayload.loading.methods import LoadMethod
from rayload.options import PEER_FANOUT

log = logging.getLogger(__name__)


RECEIVING_METHODS = frozenset({LoadMethod.AUTO, LoadMethod.PEER})
"""Requested methods whose ranks receive from a holder when one is given (other methods
read storage, and are still offered)."""


def reload_sources(
    actors: Sequence[Any], nodes: Sequence[str | None], replica: str
) -> tuple[PeerRef, ...]:
    """Each rank's source when the other replicas of a load reload from ``replica`` (whose
    rank ``r`` is ``actors[r]`` on ``nodes[r]``), which has reloaded first."""
    return tuple(
        PeerRef(replica=replica, rank=rank, node_id=node, actor=actor)
        for rank, (actor, node) in enumerate(zip(actors, nodes, strict=True))
    )


def new_replica_id() -> str:
    """A replica's id in the directory: short, unique across the cluster."""
    return uuid.uuid4().hex[:10]


@dataclass
class PeerSharing:
    """One load's replicas and the directory. ``enabled`` False: no directory at all (the
    replicas of this load still load from each other)."""

    key: str
    path: str
    enabled: bool = True
    warnings: list[str] = field(default_factory=list)
    registered: list[str] = field(default_factory=list)
    _directory: Any = None

    @property
    def available(self) -> bool:
        """Whether the directory is in use (enabled and reachable so far)."""
        return self._directory is not None

    def start(self) -> None:
        """Get (or start) the directory actor; not waited for here. A directory other
        than the one this process used last means that one is gone (killed, or lost with
        its node): one warning, since the replicas registered there are unknown now."""
        if not self.enabled:
            return
        try:
            self._directory = directory()
        except RayError as exc:  # a handle that cannot be made is one warning, not a failure
            self._unavailable(DirectoryUnavailable(f"{type(exc).__name__}: {exc}"))
            return
        if replaced_since_last_use(self._directory):
            warning = (
                "the peer directory this process used before is gone (killed, or lost with "
                "its node): replicas registered there are unknown to the new one, so this "
                "load reads storage unless a replica registered since holds its checkpoint"
            )
            log.warning("%s", warning)
            self.warnings.append(warning)

    def claim(
        self, replica: str, group: RankActorGroup, earlier: Sequence[ReplicaEntry] = ()
    ) -> tuple[list[ReplicaEntry], ReplicaEntry]:
        """Register ``replica`` (its ranks' actors and nodes) as loading; return the live
        holders of its key (``earlier`` replicas of this load included) and its entry."""
        entry = ReplicaEntry(
            replica=replica,
            key=self.key,
            path=self.path,
            tp_size=group.tp_size,
            actors=tuple(group.actors),
            nodes=tuple(group.node_id(rank) for rank in range(group.tp_size)),
            job=_job_id(),
            since_ns=time.time_ns(),
        )
        holders: list[ReplicaEntry] = []
        if self._directory is not None:
            try:
                holders = call(self._directory.claim, entry)
                self.registered.append(replica)
            except DirectoryUnavailable as exc:
                self._unavailable(exc)
        own = {e.replica for e in earlier}
        others = [h for h in holders if h.replica not in own]
        if others:
            live, dead = live_holders(others)
            if dead:
                log.info("dropping %d replica(s) that no longer answer: %s", len(dead), dead)
                self._call_quietly("drop", dead)
            others = live
        return [*others, *earlier], entry

    def loaded(self, replicas: Sequence[str], key: str | None = None) -> None:
        """These replicas hold their shards now (``key``: a reload changed what they hold)."""
        for replica in replicas:
            if replica in self.registered:
                self._call_quietly("mark", replica, "loaded", key)

    def reloading(self, replicas: Sequence[str]) -> None:
        """These replicas are being rewritten: holders that are not to be chosen now."""
        for replica in replicas:
            if replica in self.registered:
                self._call_quietly("mark", replica, "loading")

    def drop(self) -> None:
        """Forget every replica this load registered (close, or a failed load)."""
        if self.registered:
            self._call_quietly("drop", list(self.registered))
            self.registered = []

    def _call_quietly(self, method: str, *args: Any) -> None:
        if self._directory is None:
            return
        try:
            call(getattr(self._directory, method), *args, timeout_s=5.0)
        except DirectoryUnavailable as exc:
            self._unavailable(exc)

    def _unavailable(self, exc: DirectoryUnavailable) -> None:
        if self._directory is None and self.warnings:
            return
        warning = (
            f"the peer directory is unavailable ({exc}): this load reads storage and is not "
            "offered to other replicas; the next load starts a new directory"
        )
        log.warning("%s", warning)
        self.warnings.append(warning)
        self._directory = None


MAX_ALTERNATES = 4
"""At most this many alternates per rank among finished holders (in a pipeline, a rank's
alternates are its holder's upstream, as many as the tree is deep)."""


def choose_sources(
    holders: Sequence[ReplicaEntry], entry: ReplicaEntry, *, fanout: int = PEER_FANOUT
) -> tuple[PeerRef | None, ...]:
    """Each rank's source among ``holders`` (empty: every rank reads storage).

    A holder that has finished loading is preferred (one on the rank's node first, then
    spread by receiver and rank). Else, with ``fanout`` > 0, the replicas still loading
    are a tree in the order they registered (the first reads storage): the new one is
    its next node, receiving from its parent each piece as it lands there (``stream``);
    with ``fanout`` 0, from the oldest once it has finished (no pipeline).

    Each source has its alternates, for what it does not give: the next finished holders
    by the same preference, or in the tree the parent's ancestors, nearest first (each has
    every byte the parent had received, and more), and its depth
    (:attr:`~rayload.actors.peers.PeerRef.depth`)."""
    if not holders:
        return ()
    sources: list[PeerRef | None] = []
    spread = zlib.crc32(entry.replica.encode())
    loading = [i for i, h in enumerate(holders) if h.state != "loaded"]
    above = _ancestors(len(loading), fanout) if fanout > 0 and loading else []
    for rank in range(entry.tp_size):

        def preference(i: int, rank: int = rank) -> tuple[bool, bool, int]:
            holder = holders[i]
            loaded = holder.state == "loaded"
            same_node = holder.nodes[rank] is not None and holder.nodes[rank] == entry.nodes[rank]
            # Loaded holders: spread by receiver and rank. Holders still loading: the
            # tree's parent, else the oldest, which reads storage.
            if loaded:
                return False, not same_node, (i + rank + spread) % len(holders)
            return True, False, 0 if above and i == loading[above[0]] else 1 + i

        order = sorted(range(len(holders)), key=preference)
        if holders[order[0]].state == "loaded":  # and the next finished ones
            chosen = [(i, 1) for i in order[: 1 + MAX_ALTERNATES] if holders[i].state == "loaded"]
        elif above:  # the tree: the parent, then its ancestors, each this many hops away
            chosen = [(loading[p], len(_ancestors(p, fanout)) + 1) for p in above]
        else:  # the oldest, once it has finished
            chosen = [(order[0], 1)]
        refs = [_ref(holders[i], rank, stream=fanout > 0, depth=d) for i, d in chosen]
        sources.append(replace(refs[0], alternates=tuple(refs[1:])))
    return tuple(sources)


def _ancestors(position: int, fanout: int) -> list[int]:
    """The positions above ``position`` in a tree of ``fanout`` children per node, laid
    out in order (0 the root; node ``p``'s children ``p * fanout + 1 ..``), nearest
    first."""
    out = []
    while position > 0:
        position = (position - 1) // fanout
        out.append(position)
    return out


def _ref(holder: ReplicaEntry, rank: int, *, stream: bool, depth: int) -> PeerRef:
    return PeerRef(
        replica=holder.replica,
        rank=rank,
        node_id=holder.nodes[rank],
        actor=holder.actors[rank],
        loading=holder.state != "loaded",
        stream=stream,
        depth=depth,
    )


def _job_id() -> str:
    try:
        return str(ray.get_runtime_context().get_job_id())
    except (AssertionError, RuntimeError):  # not connected to a job: no job to name
        return ""
