"""Getting a rank's shard bytes from a rank of another replica (the ``peer`` method).

A replica that already holds a rank's shards (same checkpoint identity, same plan:
:func:`~rayload.loading.identity.peer_key`) can hand them to the same rank of a new
replica, so the new one reads nothing from storage. This module is the Ray-free half:

* :class:`PeerSource`, what the transport (``rayload.actors``) implements: who holds the
  bytes, and a ``fetch`` that writes every shard of a plan into given memory;
* :class:`PeerUnavailable`, how a source says it could not give the bytes (and
  :class:`PeerMismatch`, that what it gave is not this plan's);
* :func:`receive_shards`, the loop the ``peer`` backend runs: the source writes each
  tensor into the memory the backend allocated for it, and every planned tensor must
  arrive exactly once; any failure of the source becomes :class:`PeerUnavailable`, so the
  backend can discard what it got and read storage;
* :func:`check_sizes`, how a source checks that the peer holds exactly a plan's shards;
* :func:`source_label` and :func:`peer_attributes`, what the trace says about the source,
  and :class:`Pieces`, the :data:`PIECES` span of the pieces one source gave;
* :class:`Uploads`, a receiver's copies to its device, each made as its tensor lands.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

import torch

from rayload.loading.arrivals import Arrivals
from rayload.loading.plan import RankPlan
from rayload.loading.report import PhaseRecord, PhaseTimer

Landed = Callable[[str, int, int], None]
"""``landed(name, offset, length)``: bytes ``offset .. offset + length`` of tensor
``name`` are in place (what a receiver that forwards while it receives follows); a
source tells an empty range (``length`` 0) as soon as its holder has answered, before
any byte: its bytes are coming, so this rank's own receivers may be given a channel."""


class PeerUnavailable(Exception):
    """The peer could not give the bytes: it is gone, failed, or gave wrong shards. The
    message says why; the ``peer`` backend then reads storage instead."""


class PeerMismatch(PeerUnavailable):
    """The peer sent what this rank's plan does not hold (a foreign tensor, one twice):
    its plan differs, so none of what it sent is kept."""


class PeerSource(Protocol):
    """A rank of another replica that holds the shards of a plan.

    ``replica`` is the holder replica's id, ``rank`` its rank, ``node_id`` its Ray node
    (None when unknown); ``via`` says how the bytes came once :meth:`fetch` has begun
    (e.g. ``"gloo"``, ``"object_store"``; empty before).
    """

    replica: str
    rank: int
    node_id: str | None
    via: str

    def describe(self) -> str:
        """Who the peer is, for messages: e.g. ``"replica 3f2a rank 1 on node ab12..."``."""
        ...

    def alternates(self) -> Sequence[PeerSource]:
        """Other holders of the same shards, nearest first, to get from what this one did
        not give (it failed part way): each fetches only the tensors of the plan it is
        given, a part of this rank's, from its own shards. Empty: only storage is left."""
        ...

    def fetch(
        self,
        plan: RankPlan,
        destinations: Sequence[torch.Tensor],
        landed: Landed | None = None,
        offsets: Mapping[str, int] | None = None,
    ) -> Iterator[str]:
        """Write every shard of ``plan`` into its destination (``destinations[i]`` is shard
        ``i``'s memory: a 1-D uint8 CPU tensor of exactly its byte count, to be filled with
        its bytes in row-major order), yielding each tensor's name once its bytes are in
        place, in any order; a source that receives a tensor in parts may tell ``landed``
        of each part as it comes (a tensor's name, yielded, counts as all of it).
        ``offsets``: tensors whose first bytes are in place already (name -> how many:
        another holder's, cut short); a source should write only the bytes after them.

        Must raise :class:`PeerUnavailable` before writing anything when the peer's shards
        differ from the plan's in name or byte count (:func:`check_sizes`); may raise it (or
        anything else, which counts as the peer failing) at any point.
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


def check_sizes(want: Mapping[str, int], have: Mapping[str, int], *, part: bool = False) -> None:
    """Raise :class:`PeerUnavailable` unless a peer that holds tensors of ``have`` bytes
    (name -> bytes) holds exactly the shards a plan wants (``want``: each shard's name ->
    its byte count; ``part``: some of a plan's shards, which the peer must hold among
    others); the message names the first difference."""
    if part:
        have = {name: size for name, size in have.items() if name in want}
    if dict(have) == dict(want):
        return
    missing = sorted(want.keys() - have.keys())
    extra = sorted(have.keys() - want.keys())
    if missing:
        why = f"it holds no tensor {missing[0]!r} ({len(missing)} missing): its plan differs"
    elif extra:
        why = f"it holds tensor {extra[0]!r}, which this rank's plan lacks: its plan differs"
    else:
        name = next(n for n in want if have[n] != want[n])
        why = f"its tensor {name!r} has {have[name]} bytes, this rank's shard {want[name]}"
    raise PeerUnavailable(why)


def receive_shards(
    plan: RankPlan,
    peer: PeerSource,
    destinations: Sequence[torch.Tensor],
    landed: Landed | None = None,
    offsets: Mapping[str, int] | None = None,
) -> int:
    """Have ``peer`` fill ``destinations`` (shard ``i``'s memory as a 1-D uint8 CPU tensor
    of ``plan.shards[i].nbytes`` bytes) with every shard of ``plan``; return the bytes
    received. ``landed`` is told of each range as it is in place (each tensor whole at
    the latest when the source yields its name). ``offsets``: the tensors whose first
    bytes are in place already (:meth:`PeerSource.fetch`).

    Raises :class:`PeerUnavailable` saying what went wrong (it reads after "the peer
    failed: ") when the source raises anything or ends before every planned tensor
    arrived: the tensors ``landed`` was told of wholly hold the peer's bytes, the caller
    may keep them. :class:`PeerMismatch` when it names a tensor the plan does not hold,
    or a tensor twice: the caller discards everything it sent.
    """
    index = {shard.name: i for i, shard in enumerate(plan.shards)}
    arrived: set[str] = set()
    items = _guarded(lambda: peer.fetch(plan, destinations, landed, offsets))
    try:
        for name in items:
            if name not in index:
                raise PeerMismatch(
                    f"it sent tensor {name!r}, which rank {plan.rank}'s plan does not hold "
                    "(the peer's plan differs)"
                )
            if name in arrived:
                raise PeerMismatch(f"it sent tensor {name!r} twice")
            arrived.add(name)
            if landed is not None:
                landed(name, 0, plan.shards[index[name]].nbytes)
    finally:
        items.close()
    if missing := index.keys() - arrived:
        raise PeerUnavailable(
            f"it ended without sending {len(missing)} of the {len(index)} tensors "
            f"(e.g. {min(missing)!r})"
        )
    return plan.nbytes - sum((offsets or {}).values())


def _guarded(fetch: Callable[[], Iterable[str]]) -> Generator[str, None, None]:
    """The names ``fetch()`` (a source's :meth:`~PeerSource.fetch`) yields, with any
    exception it raises (when called or while iterating) turned into
    :class:`PeerUnavailable`; closing it closes the source's iterator."""
    try:
        iterator = iter(fetch())
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


def _cause(exc: Exception) -> str:
    """What a source's exception says: its own message for PeerUnavailable, else its type
    and message."""
    if isinstance(exc, PeerUnavailable):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


PIECES = "rank.peer_pieces"
"""The span of a rank's pieces from a peer: from the first one's arrival to the last's,
with ``pieces``, ``bytes`` and ``piece_ms`` (each piece's arrival, ms after the span's
start, in order): from whom the rank received which bytes, and when."""

_MAX_PIECE_TIMES = 4096
"""At most this many arrival times on a span (a 1 TB shard's 8 MiB pieces would be 130k)."""


class Pieces:
    """Records each piece from one source as it lands (``landed``, given to the receiver)
    into ``arrivals`` and by tensor (``resumed``: the tensors it was asked to send from a
    byte on, cut short before), then :meth:`record` s the :data:`PIECES` span."""

    def __init__(
        self,
        arrivals: Arrivals,
        clock: Callable[[], int],
        resumed: Mapping[str, int] | None = None,
    ) -> None:
        self._arrivals, self._clock = arrivals, clock
        self.resumed = dict(resumed or {})
        self.times: list[int] = []
        self.by_name: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(self.by_name.values())

    def landed(self, name: str, offset: int, length: int) -> None:
        if new := self._arrivals.landed_name(name, offset, length):
            self.times.append(self._clock())
            self.by_name[name] = self.by_name.get(name, 0) + new

    def kept(self, rest: RankPlan | None = None) -> int:
        """The bytes it landed, less those of ``rest``'s tensors (read again whole)."""
        again = {s.name for s in rest.shards} if rest is not None else set()
        return sum(n for name, n in self.by_name.items() if name not in again)

    def resumed_said(self) -> str:
        """``, 'name' from byte B on`` for each tensor it resumed and landed bytes of."""
        return "".join(
            f", {name!r} from byte {at} on"
            for name, at in self.resumed.items()
            if name in self.by_name
        )

    def record(self, timer: PhaseTimer, source: str) -> None:
        if not self.times:
            return
        first = self.times[0]
        step = max(1, -(-len(self.times) // _MAX_PIECE_TIMES))
        timer.records.append(
            PhaseRecord(
                PIECES,
                first,
                self.times[-1],
                {
                    **timer.tags,
                    "source": source,
                    "pieces": len(self.times),
                    "bytes": self.nbytes,
                    "piece_ms": [round((t - first) / 1e6, 1) for t in self.times[::step]],
                },
            )
        )


class Uploads:
    """Copies each tensor of a peer load to ``device`` on a thread of its own as soon as it
    has wholly landed (:meth:`landed`, told after each piece), so that a GPU receiver's
    host-to-device copies overlap the receiving of the next tensors instead of all
    following the last; :meth:`finish` returns the copies made. ``hosts`` are the
    tensors' host memory, typed (``hosts[i]`` is ``arrivals``' tensor ``i``): a tensor
    wholly arrived is kept, its bytes never written again, so its copy stays right.
    ``device`` None: nothing is copied (a CPU load's host tensors are its result). A
    context manager: leaving it waits for the copies queued."""

    def __init__(
        self, arrivals: Arrivals, hosts: Sequence[torch.Tensor], device: torch.device | None
    ) -> None:
        self._arrivals, self._hosts, self._device = arrivals, hosts, device
        self._queued: set[int] = set()
        self._copies: dict[int, torch.Tensor] = {}
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rayload-upload", daemon=True)
        if device is not None:
            self._thread.start()

    def landed(self, index: int) -> None:
        """Bytes of tensor ``index`` have landed: its copy is queued once it is whole."""
        if self._device is None or index in self._queued:
            return
        if self._arrivals.arrived(index) >= self._arrivals.sizes[index]:
            self._queued.add(index)
            self._queue.put(index)

    def finish(self) -> dict[int, torch.Tensor]:
        """Wait for the copies queued; returns them, by tensor index (one whose copy
        failed is left out: the caller copies it again, and meets its error)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        return self._copies

    def __enter__(self) -> Uploads:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish()

    def _run(self) -> None:
        assert self._device is not None
        on_device = (
            torch.cuda.device(self._device)
            if self._device.type == "cuda"
            else contextlib.nullcontext()
        )
        with on_device:
            while (index := self._queue.get()) is not None:
                try:
                    self._copies[index] = self._hosts[index].to(self._device, copy=True)
                except Exception:  # out of device memory, say: left to the caller's copy
                    return
