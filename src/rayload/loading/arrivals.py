"""Which bytes of a rank's shards are in place while its load runs, so that a holder can
forward them to the next replica as they land (the pipelined fan-out of ``peer`` loads).

A load that publishes its progress creates one :class:`Arrivals` for its plan's tensors,
over the memory they are being written into (1-D uint8 views, the reader's or the peer
receiver's own destinations): the reader marks each range once its bytes are there
(:meth:`Arrivals.landed`), in any order; a sender waits for the prefix of a tensor it is
about to send (:meth:`Arrivals.wait`). Only a tensor's contiguous prefix counts as
arrived, whatever order its ranges land in.

Ray-free: the rank actor's :class:`~rayload.actors.peers.ShardServer` holds the current
load's arrivals and its senders wait on them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

import torch


class ArrivalsEnded(Exception):
    """The load these arrivals follow stopped (it failed, or a reload began): what has not
    arrived never will; the message says why."""


class Arrivals:
    """The landed bytes of a plan's tensors ``names`` (``buffers[i]`` is tensor ``i``'s
    memory: a 1-D uint8 view of it while a load writes it, the tensor itself once
    loaded). ``relayed``: the bytes come from an upstream holder, which may itself be
    waiting for its load's end (a method that publishes only then), so they have
    :meth:`started` only once that holder has answered (the receiver tells an empty
    range) or a first byte has landed; a storage read has started as it publishes.
    Thread-safe."""

    def __init__(
        self, names: Sequence[str], buffers: Sequence[torch.Tensor], *, relayed: bool = False
    ) -> None:
        self.names = tuple(names)
        self.buffers = tuple(buffers)
        self.sizes = tuple(int(b.numel() * b.element_size()) for b in buffers)
        self._index = {name: i for i, name in enumerate(self.names)}
        self._done = [0] * len(self.sizes)
        self._pending: list[list[tuple[int, int]]] = [[] for _ in self.sizes]
        self._ended: str | None = None
        self._started = not relayed
        self._changed = threading.Condition()

    @property
    def nbytes(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes, strict=True))

    def landed(self, index: int, offset: int, length: int) -> int:
        """Bytes ``offset .. offset + length`` of tensor ``index`` are in place; returns how
        many of them are new past the tensor's arrived prefix (0: told twice; a range
        past the prefix counts whole). An empty range says bytes are coming (a relayed
        load's holder answered): the arrivals have :meth:`started`."""
        with self._changed:
            if not self._started:
                self._started = True
                self._changed.notify_all()
            if length <= 0:
                return 0
            done, pending = self._done[index], self._pending[index]
            if offset + length <= done:
                return 0
            if offset > done:
                pending.append((offset, offset + length))
                return length
            new = offset + length - done
            done = max(done, offset + length)
            pending.sort()
            while pending and pending[0][0] <= done:
                done = max(done, pending.pop(0)[1])
            self._done[index] = done
            self._changed.notify_all()
            return new

    def landed_name(self, name: str, offset: int, length: int) -> int:
        """:meth:`landed` by tensor name."""
        return self.landed(self._index[name], offset, length)

    def complete(self) -> None:
        """Every byte is in place (the load finished)."""
        with self._changed:
            self._started = True
            self._done = list(self.sizes)
            for pending in self._pending:
                pending.clear()
            self._changed.notify_all()

    def end(self, why: str) -> None:
        """The load stopped (``why``): waiters for bytes that have not arrived fail."""
        with self._changed:
            self._ended = self._ended or why
            self._changed.notify_all()

    def arrived(self, index: int) -> int:
        """How many bytes of tensor ``index`` are in place from its start."""
        with self._changed:
            return self._done[index]

    def missing(self) -> list[str]:
        """The tensors not wholly in place, in plan order."""
        with self._changed:
            return [n for n, d, s in zip(self.names, self._done, self.sizes, strict=True) if d < s]

    def started(self, timeout_s: float) -> bool:
        """Whether bytes are coming: True at once unless ``relayed``, else once the
        holder has answered or a first byte has landed; False when neither has within
        ``timeout_s``. Raises
        :class:`ArrivalsEnded` when the load stopped first."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self._started:
                if self._ended is not None:
                    raise ArrivalsEnded(self._ended)
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def wait(self, index: int, upto: int, timeout_s: float) -> None:
        """Return once the first ``upto`` bytes of tensor ``index`` are in place; raises
        :class:`ArrivalsEnded` when the load stopped first, TimeoutError when nothing
        arrived for ``timeout_s`` seconds (a stalled load)."""
        with self._changed:
            last, deadline = self._done[index], time.monotonic() + timeout_s
            while self._done[index] < upto:
                if self._ended is not None:
                    raise ArrivalsEnded(self._ended)
                if self._done[index] != last:
                    last, deadline = self._done[index], time.monotonic() + timeout_s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"tensor {self.names[index]!r} stayed at {self._done[index]} of "
                        f"{upto} bytes for {timeout_s:.0f} s: the load stalled"
                    )
                self._changed.wait(left)


class Publish(Protocol):
    """How a load publishes its progress: given its tensors' names and memory (1-D uint8),
    the :class:`Arrivals` to mark as their bytes land (``relayed``: see
    :class:`Arrivals`)."""

    def __call__(
        self, names: Sequence[str], buffers: Sequence[torch.Tensor], *, relayed: bool = False
    ) -> Arrivals: ...
