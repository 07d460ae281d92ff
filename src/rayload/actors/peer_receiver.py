"""The receiver's half of the ``peer`` method's transport (the holder's is
:mod:`rayload.actors.peers`): :class:`RayPeerSource`, a
:class:`~rayload.loading.peer.PeerSource` over Ray.

It asks the holder for a channel (waiting, within the load's time, while a holder that is
itself loading finishes), checks that the holder has exactly the shards of the
receiver's plan (or, for an alternate, the part it still lacks), joins the group as rank
1 and receives each tensor of :data:`~rayload.actors.channel.BUCKET_BYTES` or more
straight into the memory the ``peer`` backend gave it, and a run of smaller ones into
theirs too where they lie one after the other (the backend allocates them so:
:func:`~rayload.actors.channel.span`; else they arrive in a packed bucket and are copied
out), over the network or loopback, nothing through Ray's object store. Anything that
fails (the holder's actor died, its socket closed, no piece for a stall's time, a plan
that differs) becomes :class:`~rayload.loading.peer.PeerUnavailable`: the ``peer``
backend then asks the
source's :meth:`~RayPeerSource.alternates`, then storage, and reports the switch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from rayload.actors.channel import STALL_S, TRANSFER_TIMEOUT_S, PeerChannel, receive
from rayload.actors.peers import PeerRef, SharedCopy
from rayload.loading.peer import Landed, PeerUnavailable
from rayload.loading.plan import RankPlan


class RayPeerSource:
    """A :class:`~rayload.loading.peer.PeerSource` over Ray: the holder ``ref`` sends, this
    rank (on node ``node_id``, address ``host``) receives: from the holder's shared copy
    when it is on this node and has one, else over a channel. ``wait_s`` bounds the wait
    for a holder that is still loading, ``stall_s`` the wait for each piece
    (:data:`~rayload.actors.channel.STALL_S`); ``part``: the plans this source is given
    are some of the holder's shards (an alternate's: what another holder did not give).
    ``until`` (``time.monotonic()``; default: ``wait_s`` and its slack from now) is when
    its holder must have answered at the latest, however long a wait it is given: the
    load's end, which an alternate asked late in the load does not outwait. ``via`` says
    which way the bytes came."""

    def __init__(
        self,
        ref: PeerRef,
        *,
        host: str,
        node_id: str | None,
        wait_s: float,
        stall_s: float = STALL_S,
        part: bool = False,
        until: float | None = None,
    ) -> None:
        self.ref = ref
        self.replica = ref.replica
        self.rank = ref.rank
        self.node_id = ref.node_id
        self.via = ""
        self._host = host
        self._own_node = node_id
        self._wait_s = wait_s
        self._stall_s = stall_s
        self._part = part
        self._until = time.monotonic() + wait_s + self._slack if until is None else until

    def describe(self) -> str:
        return self.ref.describe()

    def alternates(self) -> list[RayPeerSource]:
        """The ref's alternates, each given one stall's time in all to answer, and never
        past this source's ``until`` (one that does not answer is passed over: storage is
        the last resort)."""
        return [
            RayPeerSource(
                alt,
                host=self._host,
                node_id=self._own_node,
                wait_s=self._stall_s,
                stall_s=self._stall_s,
                part=True,
                until=self._until,
            )
            for alt in self.ref.alternates
        ]

    def fetch(
        self,
        plan: RankPlan,
        destinations: Sequence[torch.Tensor],
        landed: Landed | None = None,
        offsets: Mapping[str, int] | None = None,
    ) -> Iterator[str]:
        """The plan's shards, from the holder's shared copy (each tensor whole) or over a
        channel (a tensor cut short, ``offsets``, from where its bytes stopped)."""
        want = {shard.name: shard.nbytes for shard in plan.shards}
        into = {shard.name: d for shard, d in zip(plan.shards, destinations, strict=True)}
        answer_by = min(time.monotonic() + self._wait_s + self._slack, self._until)
        same_node = self.node_id is not None and self.node_id == self._own_node
        copy: SharedCopy | None = None
        if same_node:
            left = max(min(self._stall_s, answer_by - time.monotonic()), 0.1)
            copy = _get(self.ref.actor.shared_copy.remote(want, self._part), left)
        if copy is not None:
            self.via = "object_store"
            yield from _copy_out(copy, into)
            return
        self.via = "gloo"
        stall_s = self._stall_s * self.ref.depth
        channel = self._channel(want, dict(offsets or {}), answer_by - self._slack)
        if landed is not None and channel.names:  # answered: the bytes are coming
            landed(channel.names[0], (channel.starts or (0,))[0], 0)
        yield from receive(channel, self._host, into, landed, stall_s=stall_s)

    def _channel(
        self, want: Mapping[str, int], offsets: dict[str, int], wait_until: float
    ) -> PeerChannel:
        """A channel from the holder (for ``want``, those of ``offsets`` from there on),
        which may wait for its load until ``wait_until`` (``time.monotonic()``); its
        answer waited for a stall longer at most (an alternate: not at all)."""
        wait_s = max(wait_until - time.monotonic(), 0.0)
        actor = self.ref.actor
        ref = actor.open_channel.remote(wait_s, want, self.ref.stream, self._part, offsets)
        timeout_s = max(wait_s + self._slack, 1.0)
        # Answered once its load knows its tensors (streaming) or has ended: meanwhile,
        # keep checking that it lives.
        _answered_or_alive(ref, actor, timeout_s, self._stall_s)
        channel: PeerChannel = _get(ref, timeout_s)
        return channel

    @property
    def _slack(self) -> float:
        """How much longer than its wait the holder may take to answer: a stall for the
        holder given (its load may be busy), none for an alternate (``wait_s`` is all it
        gets)."""
        return 0.0 if self._part else min(TRANSFER_TIMEOUT_S, self._stall_s)


def _answered_or_alive(ref: Any, actor: Any, timeout_s: float, stall_s: float) -> None:
    """Return once ``ref`` (a call to ``actor``) is answered, asking ``actor`` every
    ``stall_s`` whether it is alive (``peer_ping``, which a thread of its own answers
    while its load runs and channel calls wait). PeerUnavailable when the holder does not
    answer a ping within a stall (a frozen process, a lost node: instead of waiting out
    the load's time), or ``ref`` within ``timeout_s`` in all."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _ = ray.wait([ref], timeout=min(stall_s, left))
        if ready:
            return
        if (left := deadline - time.monotonic()) >= 1.0:  # else the time is up anyway
            _get(actor.peer_ping.remote(), min(stall_s, left))
    raise PeerUnavailable(f"no answer from the holder within {timeout_s:.0f} s")


def _get(ref: Any, timeout_s: float) -> Any:
    """``ray.get`` with Ray's failures as PeerUnavailable (a holder's own exception in
    its own words)."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError as exc:
        raise PeerUnavailable(f"no answer from the holder within {timeout_s:.0f} s") from exc
    except RayTaskError as exc:  # the holder said why: its own words
        raise PeerUnavailable(str(exc.cause) or type(exc.cause).__name__) from exc
    except RayError as exc:
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise PeerUnavailable(f"{type(exc).__name__} while asking the holder: {first}") from exc


def _copy_out(copy: SharedCopy, into: Mapping[str, torch.Tensor]) -> Iterator[str]:
    """Copy those of a shared copy's tensors that ``into`` has memory for (1-D uint8) into
    it, object by object, yielding each name once its bytes are in place."""
    for names, ref in zip(copy.names, copy.refs, strict=True):
        if not any(name in into for name in names):
            continue
        arrays = _get(ref, TRANSFER_TIMEOUT_S)
        for name, array in zip(names, arrays, strict=True):
            if name in into:
                into[name].numpy()[:] = array
                yield name
        del arrays
