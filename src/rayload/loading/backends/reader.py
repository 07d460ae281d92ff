"""rayload's own file reader: parallel positional reads of exact byte ranges into
preallocated destinations, with bounded memory.

The caller describes *what* goes *where* as :class:`Segment` s (file bytes -> offset in a
destination buffer). :func:`plan_reads` turns them into :class:`Read` s of at most
``chunk_bytes``: a large segment is split so its chunks are read in parallel, segments
that touch in the file are merged into one ``os.preadv`` with one buffer per segment
(scatter read, no intermediate copy), and the strided rows of a split-1 shard stay one
``os.preadv`` per row (they are not contiguous in the file). :func:`batch_reads` groups
consecutive reads so a thread hand-off costs one per ``chunk_bytes``, not one per row.

:func:`run_reads` executes the batches on a thread pool, at most ``window`` in flight,
and releases each finished batch to its sink in order. An ``on_read`` hook runs on the
reader thread right after each read, while the bytes are fresh (the converted backend's
checksums: CPU work spread over the reader threads, overlapping the other threads'
reads, never holding up the next read). Two sinks decide where bytes land:

* :class:`HostSink`: straight into the destination host buffers (CPU loads, convert).
* :class:`StagedDeviceSink`: into a ring of pinned host buffers, then ``non_blocking``
  host-to-device copies on a side stream; a staging buffer is reused only after the copy
  out of it has finished (an event), so reads and copies overlap.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from rayload.errors import CheckpointError
from rayload.loading.backends.base import ReaderOptions
from rayload.loading.dtypes import torch_dtype
from rayload.loading.plan import ByteRange, RowRanges, TensorShard

_IOV_MAX = 1024
_MAX_BATCH_READS = 1024
"""Reads per batch at most: tiny strided rows still spread over every thread."""


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` bytes at ``offset`` of ``file`` go to ``target_offset`` of destination
    ``target``. ``tensor`` names the tensor for error messages.

    With ``row > 0`` the file bytes are strided: ``length // row`` rows of ``row`` bytes,
    ``stride`` apart from ``offset`` on (the rows of a split-1 shard); they land one
    after the other at ``target_offset``. One such segment replaces thousands of
    per-row objects; the rows are still read one ``os.preadv`` each, on a reader thread.
    """

    file: str
    offset: int
    length: int
    target: int
    target_offset: int
    tensor: str
    row: int = 0
    stride: int = 0


@dataclass(frozen=True, slots=True)
class Read:
    """One ``os.preadv``: ``length`` file-contiguous bytes from ``offset``, scattered over
    ``segments``; or, with ``row > 0``, the rows of its single strided segment."""

    file: str
    offset: int
    length: int
    segments: tuple[Segment, ...]
    row: int = 0
    stride: int = 0


@dataclass(frozen=True, slots=True)
class Batch:
    """Consecutive reads one thread performs in a row (one staging buffer's worth)."""

    reads: tuple[Read, ...]
    length: int


def plan_reads(segments: Iterable[Segment], chunk_bytes: int) -> list[Read]:
    """Group ``segments`` (kept in order) into reads of at most ``chunk_bytes``."""
    reads: list[Read] = []
    current: list[Segment] = []
    size = 0
    for piece in _split(segments, chunk_bytes):
        if piece.row:
            if current:
                reads.append(Read(current[0].file, current[0].offset, size, tuple(current)))
                current, size = [], 0
            reads.append(
                Read(piece.file, piece.offset, piece.length, (piece,), piece.row, piece.stride)
            )
            continue
        if current:
            last = current[-1]
            touches = last.file == piece.file and last.offset + last.length == piece.offset
            if not touches or size + piece.length > chunk_bytes or len(current) >= _IOV_MAX:
                reads.append(Read(current[0].file, current[0].offset, size, tuple(current)))
                current, size = [], 0
        current.append(piece)
        size += piece.length
    if current:
        reads.append(Read(current[0].file, current[0].offset, size, tuple(current)))
    return reads


def batch_reads(reads: Iterable[Read], chunk_bytes: int) -> list[Batch]:
    """Group consecutive ``reads`` into batches of at most ``chunk_bytes`` (and at most
    ``_MAX_BATCH_READS`` reads), so a thread hand-off is paid per batch, not per row."""
    batches: list[Batch] = []
    current: list[Read] = []
    size = 0
    for read in reads:
        if current and (size + read.length > chunk_bytes or len(current) >= _MAX_BATCH_READS):
            batches.append(Batch(tuple(current), size))
            current, size = [], 0
        current.append(read)
        size += read.length
    if current:
        batches.append(Batch(tuple(current), size))
    return batches


def _split(segments: Iterable[Segment], chunk_bytes: int) -> Iterator[Segment]:
    """Pieces of at most ``chunk_bytes`` (whole rows for strided segments)."""
    for seg in segments:
        if seg.length <= chunk_bytes:
            if seg.length:
                yield seg
            continue
        if seg.row:
            yield from _split_rows(seg, chunk_bytes)
            continue
        for start in range(0, seg.length, chunk_bytes):
            length = min(chunk_bytes, seg.length - start)
            yield Segment(
                seg.file,
                seg.offset + start,
                length,
                seg.target,
                seg.target_offset + start,
                seg.tensor,
            )


def _split_rows(seg: Segment, chunk_bytes: int) -> Iterator[Segment]:
    rows = seg.length // seg.row
    per_piece = max(1, chunk_bytes // seg.row)
    for first in range(0, rows, per_piece):
        count = min(per_piece, rows - first)
        yield Segment(
            seg.file,
            seg.offset + first * seg.stride,
            count * seg.row,
            seg.target,
            seg.target_offset + first * seg.row,
            seg.tensor,
            seg.row if count > 1 else 0,
            seg.stride if count > 1 else 0,
        )


Views = list[list[memoryview]]
"""Per read of a batch, the buffers ``os.preadv`` fills."""

ReadHook = Callable[["Read", list[memoryview]], None]
"""Called with each read and the buffers it filled, on the reader thread, right after the
read; reads of one run call it concurrently and in no particular order."""


class Sink(Protocol):
    """Where a batch's bytes land: ``acquire`` gives the buffers to read into,
    ``release`` is called once the batch is read, in batch order."""

    def acquire(self, batch: Batch) -> Views: ...

    def release(self, batch: Batch, views: Views) -> None: ...

    def finish(self) -> None:
        """Wait until every released batch is in its destination."""


def host_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    return tensor.view(torch.uint8).reshape(-1).numpy().data.cast("B")


class HostSink:
    """Reads straight into host destination buffers, one view per segment."""

    def __init__(self, targets: Sequence[memoryview]) -> None:
        self.targets = targets

    def acquire(self, batch: Batch) -> Views:
        targets = self.targets
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
    (the rows of a split-1 shard become one copy). ``finish()`` waits for the last copy."""

    def __init__(self, targets: Sequence[torch.Tensor], options: ReaderOptions) -> None:
        self.targets = targets
        self.device = targets[0].device if targets else torch.device("cuda", 0)
        self.stream = torch.cuda.Stream(self.device)
        self._free: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque(
            (torch.empty(options.chunk_bytes, dtype=torch.uint8, pin_memory=True), None)
            for _ in range(options.window)
        )
        self._busy: deque[torch.Tensor] = deque()  # acquired, in batch order

    def acquire(self, batch: Batch) -> Views:
        buffer, copied = self._free.popleft()
        if copied is not None:
            copied.synchronize()
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
                self.targets[target][dst : dst + length].copy_(
                    buffer[src : src + length], non_blocking=True
                )
            event = torch.cuda.Event()
            event.record(self.stream)
        self._free.append((buffer, event))

    def finish(self) -> None:
        self.stream.synchronize()


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


def run_reads(
    batches: Sequence[Batch],
    sink: Sink,
    options: ReaderOptions,
    *,
    on_read: ReadHook | None = None,
) -> int:
    """Execute ``batches`` into ``sink`` on ``options.threads`` threads, at most
    ``options.window`` in flight; return the bytes read (the sum of what ``os.preadv``
    returned). ``on_read`` (thread-safe) sees every read on the thread that performed it,
    before its batch is released. A file shorter than a read is a CheckpointError naming
    it."""
    total = 0
    files = (r.file for b in batches for r in b.reads)
    pool = ThreadPoolExecutor(options.threads, thread_name_prefix="rayload-read")
    with _open_files(files) as fds:
        inflight: deque[tuple[Batch, Views, Future[int]]] = deque()
        try:
            for batch in batches:
                if len(inflight) >= options.window:
                    total += _finish(inflight.popleft(), sink)
                views = sink.acquire(batch)
                future = pool.submit(_pread_batch, fds, batch, views, on_read)
                inflight.append((batch, views, future))
            while inflight:
                total += _finish(inflight.popleft(), sink)
        except BaseException:
            # Threads may still be reading into the buffers or from the files: wait.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    # Every read has finished: the idle threads exit on their own. Joining them would
    # wait for a wake-up per thread (0.2 ms median here, several ms on a busy machine).
    pool.shutdown(wait=False)
    return total


def _finish(item: tuple[Batch, Views, Future[int]], sink: Sink) -> int:
    batch, views, future = item
    n = future.result()
    sink.release(batch, views)
    return n


def _pread_batch(fds: dict[str, int], batch: Batch, views: Views, on_read: ReadHook | None) -> int:
    total = 0
    for read, read_views in zip(batch.reads, views, strict=True):
        total += _pread_all(fds[read.file], read, read_views)
        if on_read is not None:
            on_read(read, read_views)
    return total


def _pread_all(fd: int, read: Read, views: list[memoryview]) -> int:
    """Perform ``read`` into ``views``: one ``os.preadv``, or one per row when strided."""
    if not read.row:
        return _pread_exact(fd, read, read.offset, views, read.length)
    [view] = views
    row, stride = read.row, read.stride
    for i, pos in enumerate(range(0, read.length, row)):
        _pread_exact(fd, read, read.offset + i * stride, [view[pos : pos + row]], row)
    return read.length


def _pread_exact(fd: int, read: Read, offset: int, views: list[memoryview], size: int) -> int:
    """Fill ``views`` (``size`` bytes) from ``offset``; short reads are retried, end of
    file is a CheckpointError."""
    n = os.preadv(fd, views, offset)
    if n == size:
        return n
    pending = list(views)
    done = 0
    while True:
        if n == 0:
            _raise_truncated(read, offset + done)
        done += n
        while n:
            if n >= len(pending[0]):
                n -= len(pending.pop(0))
            else:
                pending[0] = pending[0][n:]
                n = 0
        if not pending:
            return done
        n = os.preadv(fd, pending, offset + done)


def _raise_truncated(read: Read, at: int) -> None:
    tensor = next(
        (s.tensor for s in read.segments if s.offset <= at < s.offset + s.length),
        read.segments[-1].tensor,
    )
    raise CheckpointError(
        f"{read.file}: the file ends at byte {at}, inside tensor {tensor!r}; the file is "
        "truncated: download or convert it again",
        file=read.file,
        tensor=tensor,
    )


@contextmanager
def _open_files(paths: Iterable[str]) -> Iterator[dict[str, int]]:
    fds: dict[str, int] = {}
    try:
        for path in dict.fromkeys(paths):
            try:
                fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise CheckpointError(
                    f"{path}: cannot open for reading ({exc.strerror}); check that the "
                    "checkpoint is complete and readable",
                    file=path,
                ) from exc
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def shard_segments(shards: Sequence[TensorShard]) -> list[Segment]:
    """Segments that put shard ``i``'s ranges, in order, into destination ``i``. Runs of
    equal-length ranges a constant stride apart (split-1 rows) become one strided
    segment."""
    segments = []
    for index, shard in enumerate(shards):
        ranges = shard.ranges
        if isinstance(ranges, RowRanges) and ranges.rows > 1 and ranges.stride > ranges.length:
            segments.append(
                Segment(
                    ranges.file,
                    ranges.offset,
                    ranges.rows * ranges.length,
                    index,
                    0,
                    shard.name,
                    ranges.length,
                    ranges.stride,
                )
            )
            continue
        pos = i = 0
        while i < len(ranges):
            first = ranges[i]
            end = _row_run_end(ranges, i)
            if end - i > 1:
                length = (end - i) * first.length
                stride = ranges[i + 1].offset - first.offset
                segments.append(
                    Segment(
                        first.file,
                        first.offset,
                        length,
                        index,
                        pos,
                        shard.name,
                        first.length,
                        stride,
                    )
                )
            else:
                length = first.length
                segments.append(Segment(first.file, first.offset, length, index, pos, shard.name))
            pos += length
            i = end
    return segments


def _row_run_end(ranges: Sequence[ByteRange], i: int) -> int:
    """End (exclusive) of the run of rows starting at ``ranges[i]``: same file and length,
    a constant stride larger than the length apart."""
    first = ranges[i]
    if i + 1 >= len(ranges):
        return i + 1
    stride = ranges[i + 1].offset - first.offset
    if stride <= first.length:
        return i + 1
    end = i + 1
    while (
        end < len(ranges)
        and ranges[end].file == first.file
        and ranges[end].length == first.length
        and ranges[end].offset - ranges[end - 1].offset == stride
    ):
        end += 1
    return end


def read_segments(
    segments: Sequence[Segment],
    sizes: Sequence[int],
    device: torch.device,
    options: ReaderOptions,
    *,
    on_read: ReadHook | None = None,
) -> tuple[list[torch.Tensor], Sink, int]:
    """Allocate one byte buffer of ``sizes[i]`` per destination on ``device`` and read
    ``segments`` into them. Returns the buffers, the sink (call ``finish()`` before using
    device buffers) and the bytes read."""
    if device.type == "cuda":
        buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        sink: Sink = StagedDeviceSink(buffers, options)
    else:
        buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        sink = HostSink([host_view(b) for b in buffers])
    batches = batch_reads(plan_reads(segments, options.chunk_bytes), options.chunk_bytes)
    return buffers, sink, run_reads(batches, sink, options, on_read=on_read)


def shard_tensors(
    shards: Sequence[TensorShard], buffers: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """View ``buffers[i]``, the raw bytes of ``shards[i]``, as its dtype and shape (no copy).
    ``buffers`` may hold more (scratch) buffers after the shards'."""
    return {
        shard.name: buffers[i].view(torch_dtype(shard.dtype)).reshape(shard.shape)
        for i, shard in enumerate(shards)
    }
