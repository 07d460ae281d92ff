"""Where the reader's bytes land.

* :class:`HostSink`: straight into the destination host buffers (CPU loads, convert).
* :class:`StagedDeviceSink`: into a ring of pinned host buffers, then ``non_blocking``
  host-to-device copies on a side stream; a staging buffer is reused only after the copy
  out of it has finished (an event), so reads and copies overlap. A load that publishes
  its progress is told of each batch once its copy has finished (a device holder
  forwards what is in device memory, not what is still on its way there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from rayload.loading.reader.options import ReadSettings
from rayload.loading.reader.readplan import Batch, Read


class Landed(Protocol):
    """Told that a read's bytes are in their destinations (:class:`~.reads.Landing`)."""

    def landed(self, read: Read) -> None: ...


Views = list[list[memoryview]]
"""Per read of a batch, the buffers ``os.preadv`` fills."""


class Sink(Protocol):
    """Where a batch's bytes land: ``acquire`` gives the buffers to read into,
    ``release`` is called once the batch is read, in batch order. ``prefault``: the
    buffers may be memory not yet faulted in (the reader faults each in at once before
    reading into it), False for buffers that are resident already (staging)."""

    prefault: bool

    def acquire(self, batch: Batch) -> Views: ...

    def release(self, batch: Batch, views: Views) -> None: ...

    def finish(self) -> None:
        """Wait until every released batch is in its destination."""


ALIGN_BYTES = 64
"""Where :func:`host_buffers` begins each buffer: at a multiple of this many bytes, as
torch's own CPU allocator does (vectorised kernels read whole cache lines)."""


def host_buffers(sizes: Sequence[int]) -> list[torch.Tensor]:
    """One 1-D uint8 CPU tensor of ``sizes[i]`` bytes per size, laid out one after the other
    in a single allocation (each at a multiple of :data:`ALIGN_BYTES`; sizes that are
    multiples of it, as a model's tensors are, leave no gap), so that consecutive buffers
    are one range of memory: a peer channel sends and receives a run of them as one piece,
    with no packing copy (:func:`~rayload.actors.channel.span`). Each tensor has a storage
    of its own (pickling one carries its bytes only); the allocation lives while any of
    them does."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end = -(-(end + size) // ALIGN_BYTES) * ALIGN_BYTES
    memory = torch.empty(end, dtype=torch.uint8).numpy()
    return [
        torch.frombuffer(memory, dtype=torch.uint8, count=size, offset=at)
        if size
        else torch.empty(0, dtype=torch.uint8)
        for at, size in zip(offsets, sizes, strict=True)
    ]


def host_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    return tensor.view(torch.uint8).reshape(-1).numpy().data.cast("B")


class HostSink:
    """Reads straight into host destination buffers, one view per segment.

    ``touched``, when given, collects the destinations a read has been handed (the
    bytes of those may have changed, even when the read then fails)."""

    prefault = True

    def __init__(self, targets: Sequence[memoryview], touched: set[int] | None = None) -> None:
        self.targets = targets
        self.touched = touched

    def acquire(self, batch: Batch) -> Views:
        targets = self.targets
        if self.touched is not None:
            self.touched.update(s.target for r in batch.reads for s in r.segments)
        return [
            [targets[s.target][s.target_offset : s.target_offset + s.length] for s in r.segments]
            for r in batch.reads
        ]

    def release(self, batch: Batch, views: Views) -> None:
        pass

    def finish(self) -> None:
        pass


class StagedDeviceSink:
    """Reads a batch into one pinned staging buffer, then copies it to the device
    destinations on a side stream, one copy per run of bytes that is contiguous in both
    (the rows of a split-1 shard become one copy). ``finish()`` waits for the last copy.

    Staging buffers are allocated when first needed, up to ``settings.window``: the first
    read starts after one allocation instead of all of them (page-locking new memory is
    slow), and a load of few batches pins few buffers. ``touched``, when given, collects
    the destinations a copy has been queued into. ``landing``, when given, is told of a
    batch's reads once its copy's event has completed: checked at each batch acquired
    and released, and for all of them at ``finish()``, so it lags the copies by at most
    the window."""

    prefault = False  # pinned staging buffers are resident

    def __init__(
        self,
        targets: Sequence[torch.Tensor],
        settings: ReadSettings,
        touched: set[int] | None = None,
        landing: Landed | None = None,
    ) -> None:
        self.targets = targets
        self.touched = touched
        self.landing = landing
        self.device = targets[0].device if targets else torch.device("cuda", 0)
        self.stream = torch.cuda.Stream(self.device)
        # The copies come after whatever the current stream has queued on the targets (a
        # module's initialisation, a forward still running at a reload; the allocator's
        # last use of fresh memory).
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._chunk_bytes = settings.chunk_bytes
        self._unallocated = settings.window
        self._free: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        self._busy: deque[torch.Tensor] = deque()  # acquired, in batch order
        self._copying: deque[tuple[Batch, torch.cuda.Event]] = deque()  # landing not told

    def acquire(self, batch: Batch) -> Views:
        if self._free:
            buffer, copied = self._free.popleft()
            copied.synchronize()
            self._tell_landed()
        elif self._unallocated:
            self._unallocated -= 1
            buffer = torch.empty(self._chunk_bytes, dtype=torch.uint8, pin_memory=True)
        else:
            raise RuntimeError("more batches in flight than staging buffers (window)")
        self._busy.append(buffer)
        view = host_view(buffer)
        views, pos = [], 0
        for read in batch.reads:
            views.append([view[pos : pos + read.length]])
            pos += read.length
        return views

    def release(self, batch: Batch, views: Views) -> None:
        buffer = self._busy.popleft()
        with torch.cuda.stream(self.stream):
            for target, dst, src, length in _copy_runs(batch):
                if self.touched is not None:
                    self.touched.add(target)
                self.targets[target][dst : dst + length].copy_(
                    buffer[src : src + length], non_blocking=True
                )
            event = torch.cuda.Event()
            event.record(self.stream)
        self._free.append((buffer, event))
        if self.landing is not None:
            self._copying.append((batch, event))
            self._tell_landed()

    def finish(self) -> None:
        self.stream.synchronize()
        self._tell_landed()

    def _tell_landed(self) -> None:
        """Tell ``landing`` of the batches whose copies have completed, in batch order."""
        copying, landing = self._copying, self.landing
        while landing is not None and copying and copying[0][1].query():
            batch, _ = copying.popleft()
            for read in batch.reads:
                landing.landed(read)


def _copy_runs(batch: Batch) -> Iterator[tuple[int, int, int, int]]:
    """``(target, target_offset, staging_offset, length)`` runs of a staged batch."""
    run: list[int] | None = None
    src = 0
    for read in batch.reads:
        for seg in read.segments:
            if run is not None and run[0] == seg.target and run[1] + run[3] == seg.target_offset:
                run[3] += seg.length
            else:
                if run is not None:
                    yield run[0], run[1], run[2], run[3]
                run = [seg.target, seg.target_offset, src, seg.length]
            src += seg.length
    if run is not None:
        yield run[0], run[1], run[2], run[3]
