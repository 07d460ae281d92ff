"""The transport of the ``peer`` load method: a loaded rank sends its shards to the same
rank of another replica over a ``torch.distributed`` process group of two, opened for that
transfer (gloo over TCP).

Holder side (:class:`ShardServer`, run by the rank actor in its ``peer`` concurrency group,
so it answers while the actor's main thread loads or runs engine code): a receiver asks
for a channel (:meth:`ShardServer.open`); once the rank's load has finished (or, for a
receiver that streams, once the load knows its tensors), the holder hosts a rendezvous
store on a free port of its node and hands back a :class:`PeerChannel` (where to meet,
and which tensors of how many bytes it will send, in order). A sender thread then joins
a two-rank gloo group as its rank 0 and broadcasts each piece as it lands; the
group is gone when the last tensor has left, or when the receiver never came or vanished
(the group's time-out). Several receivers get several channels, served at once. A reload
(:meth:`ShardServer.loading`) stops the sends under way at their next bucket and waits for
them, so no send reads a tensor while it is rewritten; their receivers fall back.
Receiver side: :class:`~rayload.actors.peer_receiver.RayPeerSource`. Only CPU memory
travels: a holder on a GPU copies each piece to the host before it sends (no NCCL path
yet), and the receiver's ``rank.to_device`` moves what arrived.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch

from rayload.actors.channel import (
    BUCKET_BYTES,
    HOLDER,
    JOIN_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    PeerChannel,
    broadcast,
    buckets,
    gloo_group,
    pieces,
    receive,
    span,
)
from rayload.loading.arrivals import Arrivals, ArrivalsEnded
from rayload.loading.peer import PeerUnavailable, check_sizes

log = logging.getLogger(__name__)

__all__ = [
    "BUCKET_BYTES",
    "PEER_CONCURRENCY",
    "PEER_GROUP",
    "PING_CONCURRENCY",
    "PING_GROUP",
    "PeerChannel",
    "PeerRef",
    "ShardServer",
    "SharedCopy",
    "buckets",
    "pieces",
    "receive",
]

PEER_GROUP = "peer"
"""The rank actor's concurrency group for the peer methods that may wait (opening a
channel, which waits for the load; the shared copy)."""

PEER_CONCURRENCY = 4
"""Peer calls a rank actor serves at once."""

PING_GROUP = "peer_ping"
"""The rank actor's concurrency group for :meth:`peer_ping` alone, so that it answers
at once however many ``open_channel`` calls wait in :data:`PEER_GROUP` (receivers of a
holder still loading): a receiver takes an unanswered ping for a frozen holder."""

PING_CONCURRENCY = 2
"""Pings a rank actor answers at once (each returns at once)."""

SHARED_OBJECT_BYTES = 64 << 20
"""About how many bytes of tensors one object of a shared copy holds (a larger tensor is
an object of its own): few objects for thousands of tensors, each got in one call."""


@dataclass(frozen=True)
class PeerRef:
    """Where a rank gets its shards from: rank ``rank`` of replica ``replica``, whose actor
    is ``actor``, on node ``node_id``. ``loading`` says the holder had not finished its
    own load when it was chosen; ``stream`` that the receiver takes each piece as it
    lands there (pipelined), else it waits for the holder's load to finish.
    ``alternates``: other holders of the same shards, nearest first (in a pipeline the
    holder's own upstream, up to the replica reading storage), for the receiver to get
    from what this one did not give. ``depth``: how many hops the holder's bytes have
    crossed from storage when they reach the receiver (1 from the replica reading
    storage, or from a finished holder): the receiver waits that many
    :data:`~rayload.actors.channel.STALL_S` for a piece, so that when a replica up the
    tree stalls, only the one right below it takes it as stalled (and gets the rest
    elsewhere), while those further down wait for it to do so."""

    replica: str
    rank: int
    node_id: str | None
    actor: Any
    loading: bool = False
    stream: bool = False
    alternates: tuple[PeerRef, ...] = ()
    depth: int = 1

    def describe(self) -> str:
        node = (self.node_id or "unknown")[:12]
        return f"replica {self.replica} rank {self.rank} on node {node}"


@dataclass(frozen=True)
class SharedCopy:
    """A holder's shards in its node's Ray object store (``load(..., shared_copy=True)``):
    ``refs[i]`` holds the tensors ``names[i]``, in that order, as 1-D uint8 arrays. A
    receiver on the same node reads them from shared memory without a copy and copies them
    into its own memory: one copy in all."""

    names: tuple[tuple[str, ...], ...]
    refs: tuple[Any, ...]


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a 1-D uint8 CPU tensor (a view when it is a contiguous CPU
    tensor, else a copy)."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.to("cpu")
    return data.contiguous().reshape(-1).view(torch.uint8)


class _Superseded(Exception):
    """The holder's tensors are being rewritten (a reload): the send stops."""


class ShardServer:
    """A rank's serving state: follows its load's bytes as they land
    (:meth:`publish`), opens a channel per receiver and sends from a thread of its own.
    Thread-safe (the actor's peer methods run in a pool).

    A receiver that streams (:attr:`PeerRef.stream`) gets its channel as soon as this
    rank's load knows its tensors, and each piece as soon as its bytes have landed here,
    from storage or from this rank's own upstream: the pipelined fan-out. Otherwise it
    gets its channel once the load has finished.

    ``started`` counts the sends whose first piece has left (what :meth:`peer_ping`
    reports). ``pause_s``, ``bucket_bytes`` and ``link_mbps`` are TEST HOOKS: the first
    pauses each send after its first piece, so a test can stop the holder mid-transfer;
    the second sets the piece size (several pieces from a small checkpoint); the third
    paces each send to that many MB/s, as a network link of that speed would (the peer
    benchmarks emulate a cluster's links on one host with it)."""

    def __init__(
        self,
        *,
        pause_s: float = 0.0,
        bucket_bytes: int | None = None,
        link_mbps: float | None = None,
    ) -> None:
        self._pause_s = pause_s
        self._bucket_bytes = bucket_bytes or BUCKET_BYTES
        self._link_mbps = link_mbps
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._settled = False
        self._arrivals: Arrivals | None = None
        self._failure: str | None = None
        self._generation = 0
        self._senders: list[threading.Thread] = []
        self._copy: SharedCopy | None = None
        self.started = 0

    def loading(self) -> None:
        """The rank's tensors are about to be (re)written: new receivers wait, and sends
        under way stop at their next piece (their receivers fall back to storage); returns
        once they have stopped, so no send reads a tensor while it is rewritten."""
        with self._lock:
            if self._arrivals is not None:
                self._arrivals.end("this rank's tensors are being rewritten (a reload)")
            self._settled = False
            self._arrivals, self._failure, self._copy = None, None, None
            self._generation += 1
            senders, self._senders = self._senders, []
        for sender in senders:
            sender.join(TRANSFER_TIMEOUT_S)  # one piece at most, bounded by the group

    def publish(
        self, names: Sequence[str], buffers: Sequence[torch.Tensor], *, relayed: bool = False
    ) -> Arrivals:
        """This load's tensors ``names`` are being written into ``buffers`` (1-D uint8):
        the :class:`Arrivals` its reader marks, which streaming receivers' senders follow
        (a :class:`~rayload.loading.arrivals.Publish`). Memory published before and not
        wholly written (a peer that failed, its bytes read again) is given up."""
        arrivals = Arrivals(names, buffers, relayed=relayed)
        with self._changed:
            self._give_up("this rank read its shards again from storage")
            self._arrivals = arrivals
            self._changed.notify_all()
        return arrivals

    def loaded(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The load finished with ``tensors``: receivers from now on are sent these (a
        sender under way keeps following the memory it was given, every byte of which
        has landed)."""
        with self._changed:
            self._give_up("this rank's load ended without writing them")
            arrivals = Arrivals(list(tensors), list(tensors.values()))
            arrivals.complete()
            self._arrivals, self._failure, self._settled = arrivals, None, True
            self._changed.notify_all()

    def _give_up(self, why: str) -> None:
        """End the current arrivals unless every byte of them has landed (lock held)."""
        if self._arrivals is not None and self._arrivals.missing():
            self._arrivals.end(why)

    def failed(self, why: str) -> None:
        with self._changed:
            if self._arrivals is not None:
                self._arrivals.end(f"its own load failed: {why}")
            self._arrivals, self._failure, self._copy = None, why, None
            self._settled = True
            self._changed.notify_all()

    def share(self) -> None:
        """Put a copy of the loaded tensors into this node's object store (packed into
        objects of about :data:`SHARED_OBJECT_BYTES`; the actor owns them), for receivers on
        this node: :meth:`shared_copy`. A reload drops it (:meth:`loading`)."""
        with self._lock:
            arrivals, generation = self._arrivals, self._generation
        if arrivals is None or not self._settled:
            return
        runs, refs = [], []
        for bucket in buckets(arrivals.sizes, SHARED_OBJECT_BYTES):
            runs.append(tuple(arrivals.names[k] for k in bucket))
            refs.append(ray.put([_flat_bytes(arrivals.buffers[k]).numpy() for k in bucket]))
        with self._lock:
            if self._generation == generation:
                self._copy = SharedCopy(tuple(runs), tuple(refs))

    def shared_copy(self, want: Mapping[str, int], *, part: bool = False) -> SharedCopy | None:
        """The shared copy, when there is one of exactly the shards of ``want`` (name ->
        bytes; ``part``: among others); None otherwise (the receiver then opens a
        channel)."""
        with self._lock:
            copy, arrivals = self._copy, self._arrivals
        if copy is None or arrivals is None:
            return None
        check_sizes(want, arrivals.nbytes, part=part)
        return copy

    def open(
        self,
        host: str,
        wait_s: float,
        want: Mapping[str, int],
        *,
        stream: bool = False,
        part: bool = False,
        offsets: Mapping[str, int] | None = None,
    ) -> PeerChannel:
        """A channel to this rank's shards for a receiver whose plan has the tensors of
        ``want`` (name -> bytes), its store on ``host``: once this rank's load has
        finished, or (``stream``) once it knows its tensors, each piece then sent as it
        lands (at most ``wait_s`` seconds of waiting either way); the sending starts when
        the receiver joins. ``part``: ``want`` is what a receiver still lacks, some of this
        rank's shards, and only those are sent; ``offsets``: of those, the ones cut short
        (name -> the bytes already there), each sent from there on. Raises
        PeerUnavailable when the load failed or is still running, or when this rank holds
        other shards than ``want``."""
        import torch.distributed as dist

        arrivals, generation = self._ready(stream, time.monotonic() + max(wait_s, 0.0), wait_s)
        check_sizes(want, arrivals.nbytes, part=part)
        indices = tuple(i for i, name in enumerate(arrivals.names) if name in want)
        starts = _starts([arrivals.names[i] for i in indices], want, offsets or {})
        patience_s = max(wait_s, TRANSFER_TIMEOUT_S)
        store = dist.TCPStore(
            host, 0, 2, True, timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False
        )
        channel = PeerChannel(
            host,
            int(store.port),
            tuple(arrivals.names[i] for i in indices),
            tuple(arrivals.sizes[i] for i in indices),
            self._bucket_bytes,
            starts,
        )
        sender = threading.Thread(
            target=self._send,
            args=(store, host, arrivals, channel, indices, generation, patience_s),
            name=f"rayload-peer-send-{channel.port}",
            daemon=True,
        )
        with self._lock:
            self._senders = [t for t in self._senders if t.is_alive()] + [sender]
        sender.start()
        return channel

    def _ready(self, stream: bool, deadline: float, wait_s: float) -> tuple[Arrivals, int]:
        """The arrivals to send from and their generation: once the load has finished, or
        (``stream``) once its bytes are coming (:meth:`Arrivals.started`; this wait, not a
        piece's, is watched by pings). PeerUnavailable if the load failed, or by ``deadline``."""
        while True:
            with self._changed:
                while not self._settled and not (stream and self._arrivals is not None):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PeerUnavailable(f"it was still loading after {wait_s:.0f} s")
                    self._changed.wait(left)
                if self._arrivals is None:
                    raise PeerUnavailable(f"its own load failed: {self._failure or 'no weights'}")
                arrivals, generation, settled = self._arrivals, self._generation, self._settled
            try:
                if settled or arrivals.started(deadline - time.monotonic()):
                    return arrivals, generation
            except ArrivalsEnded:  # given up: its successor was set under the same lock
                continue
            raise PeerUnavailable(f"it was still loading after {wait_s:.0f} s")

    def _send(
        self,
        store: Any,
        host: str,
        arrivals: Arrivals,
        channel: PeerChannel,
        indices: Sequence[int],
        generation: int,
        patience_s: float,
    ) -> None:
        """The sender thread: join the group, broadcast every piece of ``channel`` (its
        tensors are ``indices`` of ``arrivals``) once its bytes have landed (waiting up
        to ``patience_s`` for each while none land: as long as the receiver would), leave.
        A receiver that never joins or goes away, this rank's load failing or stalling, or
        a reload (:meth:`loading`), ends it with a log line; ending it drops the group,
        which the receiver sees as the peer failing."""
        group = None
        link_free = 0.0
        try:
            group = gloo_group(store, HOLDER, host, TRANSFER_TIMEOUT_S)
            for i, piece in enumerate(channel.pieces()):
                for k, _, stop in piece:
                    arrivals.wait(indices[k], stop, patience_s)
                if self._generation != generation:
                    raise _Superseded("this rank's tensors are being rewritten (a reload)")
                parts = [_byte_range(arrivals.buffers[indices[k]], a, b) for k, a, b in piece]
                if self._link_mbps:
                    link_free = _paced(link_free, sum(b - a for _, a, b in piece), self._link_mbps)
                whole = span(parts)
                broadcast(group, torch.cat(parts) if whole is None else whole)
                if i == 0:
                    with self._lock:
                        self.started += 1
                    if self._pause_s > 0:
                        time.sleep(self._pause_s)
        except Exception as exc:  # the receiver's side reports its own failure
            log.warning("sending shards to a receiver stopped: %s", str(exc))
        finally:
            # Dropping the group closes its connection: a receiver still waiting fails at
            # once (abort() and shutdown() leave a gloo pair open).
            del group


def _starts(
    names: Sequence[str], want: Mapping[str, int], offsets: Mapping[str, int]
) -> tuple[int, ...]:
    """Where the sending of each of ``names`` begins: its ``offsets`` entry (the bytes the
    receiver has), which must be within the tensor; () when every one begins at 0."""
    if unknown := sorted(offsets.keys() - want.keys()):
        raise ValueError(f"an offset for tensor {unknown[0]!r}, which is not asked for")
    starts = tuple(offsets.get(name, 0) for name in names)
    if bad := [n for n, a in zip(names, starts, strict=True) if not 0 <= a <= want[n]]:
        raise ValueError(
            f"offset {offsets[bad[0]]} of tensor {bad[0]!r} is outside its {want[bad[0]]} bytes"
        )
    return starts if any(starts) else ()


def _paced(link_free: float, nbytes: int, mbps: float) -> float:
    """Wait as a link of ``mbps`` MB/s would before ``nbytes`` have crossed it, the link
    busy until ``link_free`` (``time.monotonic()``) with what went before; returns when
    it is free again."""
    now = time.monotonic()
    free = max(link_free, now) + nbytes / (mbps * 1e6)
    time.sleep(max(free - now, 0.0))
    return free


def _byte_range(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes ``start .. stop`` of ``tensor`` as a 1-D uint8 CPU tensor (a view of a
    contiguous CPU tensor; a device tensor's range is copied to the host alone)."""
    data = tensor.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    part = data.reshape(-1).view(torch.uint8)[start:stop]
    return part if part.device.type == "cpu" else part.to("cpu")
