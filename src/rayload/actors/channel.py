"""The peer channel's wire: what a holder and a receiver agree on and how the bytes cross.

A channel is a two-rank ``torch.distributed`` gloo group (the holder rank 0, the receiver
rank 1) meeting in a TCP store the holder hosts (:class:`PeerChannel`: where, and which
tensors of how many bytes, in order). Both sides cut the tensors into the same
:func:`pieces` and the holder broadcasts them one by one; :func:`receive` is the
receiver's half. The holder's half, which waits for each piece to land before it sends
it, is :class:`~rayload.actors.peers.ShardServer`.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from rayload.loading.peer import Landed, PeerUnavailable

TRANSFER_TIMEOUT_S = 120.0
"""The longest either side of a channel waits for the other once both joined (one bucket
to cross), and for the holder to answer once it has finished loading."""

STALL_S = 60.0
"""How long a receiver waits for its next piece, times its depth in the tree
(:attr:`~rayload.actors.peers.PeerRef.depth`), before it takes its holder as stalled (a
frozen process, a link that drops everything) and gets the rest elsewhere: longer than
one storage request's read time-out (30 s, retried), so that a holder whose own read is
retrying is not taken for stalled. The holder's sender waits for its own bytes as long as
the receiver's load may last (at least :data:`TRANSFER_TIMEOUT_S`), so that the receiver,
not the holder, decides."""

JOIN_TIMEOUT_S = 30.0
"""The longest a channel's store waits for its other side: a receiver that never comes, a
holder that died after it answered."""

BUCKET_BYTES = 8 << 20
"""Tensors smaller than this travel together, in buckets of at most this many bytes (one
broadcast per bucket, not per tensor: a checkpoint has hundreds of small tensors, a
norm's weight a few KiB; from and into their own memory where they are adjacent,
:func:`span`, else packed); a larger tensor is sent alone, from and into its
own memory, in ranges of this many bytes (:func:`pieces`; the first pieces are smaller,
:data:`RAMP_PIECES`)."""

HOLDER, RECEIVER = 0, 1
"""The two ranks of a channel's group."""


@dataclass(frozen=True)
class PeerChannel:
    """What a holder hands a receiver: the rendezvous store of their two-rank group
    (``host``:``port``), the tensors it will send, in that order, with their byte counts
    (``sizes[i]`` is ``names[i]``'s), the bucket size both sides pack them by
    (:func:`buckets`), and where each tensor's sending begins (``starts``, none: at 0; a
    tensor cut short by another holder is sent from where its bytes stopped)."""

    host: str
    port: int
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    bucket_bytes: int
    starts: tuple[int, ...] = ()

    @property
    def nbytes(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes, strict=True))

    @property
    def sent(self) -> int:
        """How many bytes the channel carries."""
        return sum(self.sizes) - sum(self.starts)

    def pieces(self) -> list[Piece]:
        """The channel's broadcasts (:func:`pieces`), as both sides cut them."""
        return pieces(self.sizes, self.bucket_bytes, starts=self.starts or None)


def gloo_group(store: Any, rank: int, host: str, timeout_s: float) -> Any:
    """Rank ``rank`` of a two-rank gloo group meeting in ``store``, its TCP on ``host``
    (this node's address in the cluster). Blocks until both ranks joined (at most
    ``timeout_s``)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, 2, options)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Send (on the holder) or receive (on the receiver) ``tensor`` whole."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = HOLDER
    group.broadcast([tensor], options).wait()


in_place = True
"""False packs every piece of several tensors into a buffer of its own on both sides (the
``peer_pack`` test hook: the benchmarks compare both in one run)."""


def span(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D uint8 tensor over the memory of ``views`` (1-D uint8 CPU tensors) when each
    begins where the one before it ends (buffers of one
    :func:`~rayload.loading.reader.sinks.host_buffers`), so that a piece of several
    tensors crosses from and into their own memory, with no packing copy; None when they
    do not. Every byte of it is one of the views', which must outlive it."""
    first = views[0]
    if first.device.type != "cpu" or not first.is_contiguous():
        return None
    if len(views) == 1:
        return first
    if not in_place:
        return None
    end = first.data_ptr() + first.numel()
    for view in views[1:]:
        if view.device.type != "cpu" or not view.is_contiguous() or view.data_ptr() != end:
            return None
        end += view.numel()
    memory = (ctypes.c_uint8 * (end - first.data_ptr())).from_address(first.data_ptr())
    return torch.frombuffer(memory, dtype=torch.uint8)


def receive(
    channel: PeerChannel,
    host: str,
    into: Mapping[str, torch.Tensor],
    landed: Landed | None = None,
    *,
    stall_s: float = STALL_S,
) -> Iterator[str]:
    """Join ``channel``'s group as the receiver (this node's address ``host``) and receive
    each piece into ``into[name]`` (1-D uint8, its byte count), telling ``landed(name,
    offset, length)`` of each range once its bytes are in place and yielding a tensor's
    name once all of them are (an empty tensor's at once: nothing is sent for it). No
    piece for ``stall_s`` seconds is :class:`~rayload.loading.peer.PeerUnavailable`
    saying that the holder stalled. A tensor the channel starts past its first byte
    (:attr:`PeerChannel.starts`) is received from there: the bytes before are in place."""
    import torch.distributed as dist

    store = dist.TCPStore(channel.host, channel.port, 2, False, timedelta(seconds=JOIN_TIMEOUT_S))
    group = gloo_group(store, RECEIVER, host, stall_s)
    starts = channel.starts or (0,) * len(channel.sizes)
    yield from (
        name
        for name, size, start in zip(channel.names, channel.sizes, starts, strict=True)
        if start == size  # nothing to send for it
    )
    received, total = 0, channel.sent
    for piece in channel.pieces():
        lengths = [b - a for _, a, b in piece]
        waited = time.monotonic()
        try:
            views = [into[channel.names[k]][start:stop] for k, start, stop in piece]
            if (whole := span(views)) is not None:
                broadcast(group, whole)
            else:
                packed = torch.empty(sum(lengths), dtype=torch.uint8)
                broadcast(group, packed)
                for view, part in zip(views, packed.split(lengths), strict=True):
                    view.copy_(part)
        except Exception as exc:
            if time.monotonic() - waited < stall_s * 0.9:
                raise PeerUnavailable(
                    f"the channel broke after {received} of {total} bytes: {_gloo_error(exc)}"
                ) from exc
            raise PeerUnavailable(
                f"the holder stalled: no piece came for {stall_s:g} s, after {received} of "
                f"{total} bytes"
            ) from exc
        received += sum(lengths)
        for k, start, stop in piece:
            name = channel.names[k]
            if landed is not None:
                landed(name, start, stop - start)
            if stop == channel.sizes[k]:
                yield name


def _gloo_error(exc: Exception) -> str:
    """What a failed gloo operation says, without its source location and advice: e.g.
    ``Connection closed by peer [10.0.0.2]:43656``."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:  # "[.../pair.cc:553] Connection closed ..."
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0].rstrip(".")


Piece = tuple[tuple[int, int, int], ...]
"""One broadcast of a channel: ``(tensor index, start, stop)`` byte ranges, sent together."""


RAMP_PIECES = 4
"""A channel's first pieces are smaller: a sixteenth of the piece size, then an eighth, a
quarter, a half, then whole. A holder still loading sends a piece once all of its bytes
have landed, and the storage reader fills many ranges at once, each at a fraction of the
store's rate; small first pieces let the first bytes cross (and go on down the tree)
soon after they land, instead of once a whole piece's worth has."""


def pieces(
    sizes: Sequence[int],
    limit: int = BUCKET_BYTES,
    *,
    ramp: int = RAMP_PIECES,
    starts: Sequence[int] | None = None,
) -> list[Piece]:
    """The broadcasts of a channel, in order: at most ``limit`` bytes each (less for the
    first ``ramp``, :data:`RAMP_PIECES`), consecutive small tensors packed whole, and a
    tensor that does not fit a piece of its own sent alone, in ranges of the piece size (so
    a receiver can forward the first range of a large tensor before the rest has come);
    empty tensors are in none (nothing to send). ``starts[k]``: tensor ``k`` is sent from
    that byte on (the rest of a tensor cut short), counted as a tensor of what is left.
    The holder and the receiver compute the same."""
    out: list[Piece] = []
    run: list[tuple[int, int, int]] = []
    total = 0

    def cap() -> int:
        return max(limit >> max(ramp - len(out), 0), 1)

    for k, (begin, size) in enumerate(zip(starts or [0] * len(sizes), sizes, strict=True)):
        left = size - begin
        if left <= 0:
            continue
        if run and total + left > cap():
            out.append(tuple(run))
            run, total = [], 0
        if left < cap():
            run.append((k, begin, size))
            total += left
            continue
        start = begin
        while start < size:
            stop = min(start + cap(), size)
            out.append(((k, start, stop),))
            start = stop
    if run:
        out.append(tuple(run))
    return out


def buckets(sizes: Sequence[int], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive runs of tensor indices (by byte count ``sizes``), each run at most
    ``limit`` bytes in all, a tensor of ``limit`` or more alone; empty tensors are in no
    run: :func:`pieces` without the ramp, a large tensor's ranges one run."""
    runs: list[list[int]] = []
    for piece in pieces(sizes, limit, ramp=0):
        run = [k for k, _, _ in piece]
        if not (runs and len(run) == 1 and runs[-1] == run):  # not the same tensor's next range
            runs.append(run)
    return runs
