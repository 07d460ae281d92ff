"""The transport of the ``peer`` load method: a loaded rank sends its shards to the same
rank of another replica over a ``torch.distributed`` process group of two, opened for that
transfer (gloo over TCP).

Holder side (:class:`ShardServer`, run by the rank actor in its ``peer`` concurrency group,
so it answers while the actor's main thread loads or runs engine code): a receiver asks
for a channel (:meth:`ShardServer.open`); once the rank's load has finished, the holder
hosts a rendezvous store on a free port of its node and hands back a :class:`PeerChannel`
(where to meet, and which tensors of how many bytes it will send, in order). A sender
thread then joins a two-rank gloo group as its rank 0 and broadcasts each tensor; the
group is gone when the last tensor has left, or when the receiver never came or vanished
(the group's time-out). Several receivers get several channels, served at once. A reload
(:meth:`ShardServer.loading`) stops the sends under way at their next bucket and waits for
them, so no send reads a tensor while it is rewritten; their receivers fall back.

Receiver side (:class:`RayPeerSource`, a :class:`~rayload.loading.peer.PeerSource`): asks
the holder for a channel (waiting, within the load's time, while a holder that is itself
loading finishes), checks that the holder has exactly the shards of the receiver's plan,
joins the group as rank 1 and receives each tensor of :data:`BUCKET_BYTES` or more
straight into the memory the ``peer`` backend allocated for it (smaller ones arrive in a
packed bucket and are copied out), over the network or loopback, nothing through Ray's
object store. Anything that fails (the holder's actor died, its socket closed, a
time-out, a plan that differs) becomes :class:`~rayload.loading.peer.PeerUnavailable`:
the ``peer`` backend then reads storage and reports the fallback.

Only CPU memory travels: a holder on a GPU copies each tensor to the host before it sends
(no NCCL path yet), and the receiver's ``rank.to_device`` moves what arrived.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from rayload.loading.peer import PeerUnavailable, check_sizes
from rayload.loading.plan import RankPlan

log = logging.getLogger(__name__)

PEER_GROUP = "peer"
"""The rank actor's concurrency group for the peer methods (opening a channel, ping)."""

PEER_CONCURRENCY = 4
"""Peer calls a rank actor serves at once."""

TRANSFER_TIMEOUT_S = 120.0
"""The longest either side of a channel waits for the other once both joined (one bucket
to cross), and for the holder to answer once it has finished loading."""

JOIN_TIMEOUT_S = 30.0
"""The longest a channel's store waits for its other side: a receiver that never comes, a
holder that died after it answered."""

BUCKET_BYTES = 8 << 20
"""Tensors smaller than this travel together, packed into buckets of at most this many
bytes (one broadcast per bucket, not per tensor: a checkpoint has hundreds of small
tensors, a norm's weight a few KiB); a larger tensor is sent alone, from and into its
own memory."""

SHARED_OBJECT_BYTES = 64 << 20
"""About how many bytes of tensors one object of a shared copy holds (a larger tensor is
an object of its own): few objects for thousands of tensors, each got in one call."""

_HOLDER, _RECEIVER = 0, 1


@dataclass(frozen=True)
class PeerRef:
    """Where a rank gets its shards from: rank ``rank`` of replica ``replica``, whose actor
    is ``actor``, on node ``node_id``. ``loading`` says the holder had not finished its
    own load when it was chosen (the receiver then waits for it)."""

    replica: str
    rank: int
    node_id: str | None
    actor: Any
    loading: bool = False

    def describe(self) -> str:
        node = (self.node_id or "unknown")[:12]
        return f"replica {self.replica} rank {self.rank} on node {node}"


@dataclass(frozen=True)
class PeerChannel:
    """What a holder hands a receiver: the rendezvous store of their two-rank group
    (``host``:``port``), the tensors it will send, in that order, with their byte counts
    (``sizes[i]`` is ``names[i]``'s), and the bucket size both sides pack them by
    (:func:`buckets`)."""

    host: str
    port: int
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    bucket_bytes: int

    @property
    def nbytes(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes, strict=True))


@dataclass(frozen=True)
class SharedCopy:
    """A holder's shards in its node's Ray object store (``load(..., shared_copy=True)``):
    ``refs[i]`` holds the tensors ``names[i]``, in that order, as 1-D uint8 arrays. A
    receiver on the same node reads them from shared memory without a copy and copies them
    into its own memory: one copy in all."""

    names: tuple[tuple[str, ...], ...]
    refs: tuple[Any, ...]


def _gloo_group(store: Any, rank: int, host: str, timeout_s: float) -> Any:
    """Rank ``rank`` of a two-rank gloo group meeting in ``store``, its TCP on ``host``
    (this node's address in the cluster). Blocks until both ranks joined (at most
    ``timeout_s``)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Send (on the holder) or receive (on the receiver) ``tensor`` whole."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = _HOLDER
    group.broadcast([tensor], options).wait()


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
    """A holder rank's serving state: waits for the load, opens a channel per receiver and
    sends from a thread of its own. Thread-safe (the actor's peer methods run in a pool).

    ``started`` counts the sends whose first bucket has left (what :meth:`peer_ping`
    reports). ``pause_s`` and ``bucket_bytes`` are TEST HOOKS: the first pauses each send
    after its first bucket, so a test can stop the holder mid-transfer; the second sets the
    bucket size (several buckets from a small checkpoint)."""

    def __init__(self, *, pause_s: float = 0.0, bucket_bytes: int | None = None) -> None:
        self._pause_s = pause_s
        self._bucket_bytes = bucket_bytes or BUCKET_BYTES
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._tensors: Mapping[str, torch.Tensor] | None = None
        self._sizes: dict[str, int] = {}
        self._failure: str | None = None
        self._generation = 0
        self._senders: list[threading.Thread] = []
        self._copy: SharedCopy | None = None
        self.started = 0

    def loading(self) -> None:
        """The rank's tensors are about to be (re)written: new receivers wait, and sends
        under way stop at their next bucket (their receivers fall back to storage); returns
        once they have stopped, so no send reads a tensor while it is rewritten."""
        with self._lock:
            self._settled.clear()
            self._tensors, self._failure, self._copy, self._sizes = None, None, None, {}
            self._generation += 1
            senders, self._senders = self._senders, []
        for sender in senders:
            sender.join(TRANSFER_TIMEOUT_S)  # one bucket at most, bounded by the group

    def loaded(self, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            self._tensors, self._failure = dict(tensors), None
            self._sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
            self._settled.set()

    def failed(self, why: str) -> None:
        with self._lock:
            self._tensors, self._failure, self._copy = None, why, None
            self._settled.set()

    def share(self) -> None:
        """Put a copy of the loaded tensors into this node's object store (packed into
        objects of about :data:`SHARED_OBJECT_BYTES`; the actor owns them), for receivers on
        this node: :meth:`shared_copy`. A reload drops it (:meth:`loading`)."""
        with self._lock:
            tensors, sizes, generation = self._tensors, self._sizes, self._generation
        if tensors is None:
            return
        names, values = list(tensors), list(tensors.values())
        runs, refs = [], []
        for bucket in buckets(list(sizes.values()), SHARED_OBJECT_BYTES):
            runs.append(tuple(names[k] for k in bucket))
            refs.append(ray.put([_flat_bytes(values[k]).numpy() for k in bucket]))
        with self._lock:
            if self._generation == generation:
                self._copy = SharedCopy(tuple(runs), tuple(refs))

    def shared_copy(self, want: Mapping[str, int]) -> SharedCopy | None:
        """The shared copy, when there is one of exactly the shards of ``want`` (name ->
        bytes); None otherwise (the receiver then opens a channel)."""
        with self._lock:
            copy, sizes = self._copy, self._sizes
        if copy is None:
            return None
        check_sizes(want, sizes)
        return copy

    def open(self, host: str, wait_s: float, want: Mapping[str, int]) -> PeerChannel:
        """A channel to this rank's shards for a receiver whose plan has the tensors of
        ``want`` (name -> bytes), once this rank's load has finished (at most ``wait_s``
        seconds of waiting), its store on ``host``; the sending starts when the receiver
        joins. Raises PeerUnavailable when the load failed or is still running, or when
        this rank holds other shards than ``want``."""
        import torch.distributed as dist

        if not self._settled.wait(max(wait_s, 0.0)):
            raise PeerUnavailable(f"it was still loading after {wait_s:.0f} s")
        with self._lock:
            if self._tensors is None:
                raise PeerUnavailable(f"its own load failed: {self._failure or 'no weights'}")
            tensors, sizes, generation = self._tensors, self._sizes, self._generation
        check_sizes(want, sizes)
        store = dist.TCPStore(
            host, 0, 2, True, timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False
        )
        channel = PeerChannel(
            host, int(store.port), tuple(sizes), tuple(sizes.values()), self._bucket_bytes
        )
        sender = threading.Thread(
            target=self._send,
            args=(store, host, list(tensors.values()), channel.sizes, generation),
            name=f"rayload-peer-send-{channel.port}",
            daemon=True,
        )
        with self._lock:
            self._senders = [t for t in self._senders if t.is_alive()] + [sender]
        sender.start()
        return channel

    def _send(
        self,
        store: Any,
        host: str,
        tensors: Sequence[torch.Tensor],
        sizes: Sequence[int],
        generation: int,
    ) -> None:
        """The sender thread: join the group, broadcast every bucket, leave. A receiver
        that never joins or goes away, or a reload (:meth:`loading`), ends it with a log
        line; ending it drops the group, which the receiver sees as the peer failing."""
        group = None
        try:
            group = _gloo_group(store, _HOLDER, host, TRANSFER_TIMEOUT_S)
            for i, bucket in enumerate(buckets(sizes, self._bucket_bytes)):
                if self._generation != generation:
                    raise _Superseded("this rank's tensors are being rewritten (a reload)")
                parts = [_flat_bytes(tensors[k]) for k in bucket]
                _broadcast(group, parts[0] if len(parts) == 1 else torch.cat(parts))
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


class RayPeerSource:
    """A :class:`~rayload.loading.peer.PeerSource` over Ray: the holder ``ref`` sends, this
    rank (on node ``node_id``, address ``host``) receives: from the holder's shared copy
    when it is on this node and has one, else over a channel. ``wait_s`` bounds the wait
    for a holder that is still loading; ``via`` says which way the bytes came."""

    def __init__(self, ref: PeerRef, *, host: str, node_id: str | None, wait_s: float) -> None:
        self.ref = ref
        self.replica = ref.replica
        self.rank = ref.rank
        self.node_id = ref.node_id
        self.via = ""
        self._host = host
        self._own_node = node_id
        self._wait_s = wait_s

    def describe(self) -> str:
        return self.ref.describe()

    def fetch(self, plan: RankPlan, destinations: Sequence[torch.Tensor]) -> Iterator[str]:
        want = {shard.name: shard.nbytes for shard in plan.shards}
        into = {shard.name: d for shard, d in zip(plan.shards, destinations, strict=True)}
        same_node = self.node_id is not None and self.node_id == self._own_node
        copy: SharedCopy | None = None
        if same_node:
            copy = _get(self.ref.actor.shared_copy.remote(want), TRANSFER_TIMEOUT_S)
        if copy is not None:
            self.via = "object_store"
            yield from _copy_out(copy, into)
            return
        self.via = "gloo"
        yield from receive(self._channel(want), self._host, into)

    def _channel(self, want: Mapping[str, int]) -> PeerChannel:
        ref = self.ref.actor.open_channel.remote(self._wait_s, want)
        channel: PeerChannel = _get(ref, self._wait_s + TRANSFER_TIMEOUT_S)
        return channel


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
    """Copy a shared copy's tensors into ``into`` (their memory as 1-D uint8), object by
    object, yielding each name once its bytes are in place."""
    for names, ref in zip(copy.names, copy.refs, strict=True):
        arrays = _get(ref, TRANSFER_TIMEOUT_S)
        for name, array in zip(names, arrays, strict=True):
            into[name].numpy()[:] = array
        del arrays
        yield from names


def receive(channel: PeerChannel, host: str, into: Mapping[str, torch.Tensor]) -> Iterator[str]:
    """Join ``channel``'s group as the receiver (this node's address ``host``) and receive
    each tensor into ``into[name]`` (1-D uint8, its byte count), yielding its name once
    its bytes are in place (an empty tensor's at once: nothing is sent for it)."""
    import torch.distributed as dist

    store = dist.TCPStore(channel.host, channel.port, 2, False, timedelta(seconds=JOIN_TIMEOUT_S))
    group = _gloo_group(store, _RECEIVER, host, TRANSFER_TIMEOUT_S)
    yield from (name for name, size in zip(channel.names, channel.sizes, strict=True) if not size)
    for bucket in buckets(channel.sizes, channel.bucket_bytes):
        names = [channel.names[k] for k in bucket]
        if len(names) == 1:
            _broadcast(group, into[names[0]])
        else:
            sizes = [channel.sizes[k] for k in bucket]
            packed = torch.empty(sum(sizes), dtype=torch.uint8)
            _broadcast(group, packed)
            for name, part in zip(names, packed.split(sizes), strict=True):
                into[name].copy_(part)
        yield from names


def buckets(sizes: Sequence[int], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """The broadcasts of a channel: consecutive runs of tensor indices (by byte count
    ``sizes``), each run at most ``limit`` bytes in all, a tensor of ``limit`` or more alone;
    empty tensors are in no run (nothing to send). The holder and the receiver compute
    the same runs from the channel's sizes."""
    runs: list[list[int]] = []
    run: list[int] = []
    total = 0
    for index, size in enumerate(sizes):
        if size == 0:
            continue
        if run and (size >= limit or total + size > limit):
            runs.append(run)
            run, total = [], 0
        run.append(index)
        total += size
        if size >= limit:
            runs.append(run)
            run, total = [], 0
    if run:
        runs.append(run)
    return runs
