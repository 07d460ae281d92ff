"""rayload's own file reader: parallel positional reads of exact byte ranges into
preallocated destinations, with bounded memory.

The caller describes *what* goes *where* as :class:`Segment` s (file bytes -> offset in a
destination buffer). :func:`plan_reads` turns them into read requests of at most
``chunk_bytes``: a large segment is split so its chunks are read in parallel, and
segments that touch in the file are merged into one ``os.preadv`` with one buffer per
segment (scatter read, no intermediate copy). Split-1 tensors stay one segment per row
because their rows are strided in the file.

:func:`run_reads` executes the requests on a thread pool, at most ``window`` in flight,
and hands each finished request to the caller *in request order* (so a running checksum
can follow the file). Two sinks decide where bytes land:

* :class:`HostSink`: straight into the destination host buffers (CPU loads, convert).
* :class:`StagedDeviceSink`: into a ring of pinned host buffers, then a ``non_blocking``
  host-to-device copy on a side stream; a staging buffer is reused only after the
  copy out of it has finished (an event), so reads and copies overlap.
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
from rayload.loading.plan import TensorShard

_IOV_MAX = 1024


@dataclass(frozen=True)
class Segment:
    """``length`` bytes at ``offset`` of ``file`` go to ``target_offset`` of destination
    ``target``. ``tensor`` names the tensor for error messages."""

    file: str
    offset: int
    length: int
    target: int
    target_offset: int
    tensor: str


@dataclass(frozen=True)
class Read:
    """One positional read: file-contiguous segments starting at ``offset``."""

    file: str
    offset: int
    segments: tuple[Segment, ...]

    @property
    def length(self) -> int:
        return sum(s.length for s in self.segments)


def plan_reads(segments: Iterable[Segment], chunk_bytes: int) -> list[Read]:
    """Group ``segments`` (kept in order) into reads of at most ``chunk_bytes``."""
    reads: list[Read] = []
    current: list[Segment] = []
    size = 0
    for piece in _split(segments, chunk_bytes):
        last = current[-1] if current else None
        touches = (
            last is not None
            and last.file == piece.file
            and last.offset + last.length == piece.offset
        )
        if not touches or size + piece.length > chunk_bytes or len(current) >= _IOV_MAX:
            if current:
                reads.append(Read(current[0].file, current[0].offset, tuple(current)))
            current, size = [], 0
        current.append(piece)
        size += piece.length
    if current:
        reads.append(Read(current[0].file, current[0].offset, tuple(current)))
    return reads


def _split(segments: Iterable[Segment], chunk_bytes: int) -> Iterator[Segment]:
    for seg in segments:
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


class Sink(Protocol):
    """Where a read's bytes land: ``acquire`` gives the buffers to read into, ``release``
    is called once the read finished, in request order."""

    def acquire(self, read: Read) -> list[memoryview]: ...

    def release(self, read: Read, views: list[memoryview]) -> None: ...

    def finish(self) -> None:
        """Wait until every released read is in its destination."""


def host_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    return tensor.view(torch.uint8).reshape(-1).numpy().data.cast("B")


class HostSink:
    """Reads straight into host destination buffers, one view per segment."""

    def __init__(self, targets: Sequence[memoryview]) -> None:
        self.targets = targets

    def acquire(self, read: Read) -> list[memoryview]:
        return [
            self.targets[s.target][s.target_offset : s.target_offset + s.length]
            for s in read.segments
        ]

    def release(self, read: Read, views: list[memoryview]) -> None:
        pass

    def finish(self) -> None:
        pass


class StagedDeviceSink:
    """Reads into pinned staging buffers and copies them to device destinations on a side
    stream. ``finish()`` waits for the last copy; the destinations are complete after."""

    def __init__(self, targets: Sequence[torch.Tensor], options: ReaderOptions) -> None:
        self.targets = targets
        self.device = targets[0].device if targets else torch.device("cuda", 0)
        self.stream = torch.cuda.Stream(self.device)
        pin = torch.cuda.is_available()
        self._free: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque(
            (torch.empty(options.chunk_bytes, dtype=torch.uint8, pin_memory=pin), None)
            for _ in range(options.window)
        )
        self._busy: deque[torch.Tensor] = deque()  # acquired, in request order

    def acquire(self, read: Read) -> list[memoryview]:
        buffer, copied = self._free.popleft()
        if copied is not None:
            copied.synchronize()
        self._busy.append(buffer)
        return [host_view(buffer)[: read.length]]

    def release(self, read: Read, views: list[memoryview]) -> None:
        buffer = self._busy.popleft()
        pos = 0
        with torch.cuda.stream(self.stream):
            for seg in read.segments:
                dst = self.targets[seg.target][seg.target_offset : seg.target_offset + seg.length]
                dst.copy_(buffer[pos : pos + seg.length], non_blocking=True)
                pos += seg.length
            event = torch.cuda.Event()
            event.record(self.stream)
        self._free.append((buffer, event))

    def finish(self) -> None:
        self.stream.synchronize()


def run_reads(
    reads: Sequence[Read],
    sink: Sink,
    options: ReaderOptions,
    *,
    on_read: Callable[[Read, list[memoryview]], None] | None = None,
) -> int:
    """Execute ``reads`` into ``sink``; return the bytes read (the sum of what
    ``os.preadv`` returned). ``on_read`` sees every finished read in request order,
    before ``sink.release``. A file shorter than a read is a CheckpointError naming it."""
    total = 0
    with (
        _open_files(r.file for r in reads) as fds,
        ThreadPoolExecutor(options.threads, thread_name_prefix="rayload-read") as pool,
    ):
        inflight: deque[tuple[Read, list[memoryview], Future[int]]] = deque()
        try:
            for read in reads:
                if len(inflight) >= options.window:
                    total += _finish(inflight.popleft(), sink, on_read)
                views = sink.acquire(read)
                inflight.append((read, views, pool.submit(_pread_all, fds[read.file], read, views)))
            while inflight:
                total += _finish(inflight.popleft(), sink, on_read)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return total


def _finish(
    item: tuple[Read, list[memoryview], Future[int]],
    sink: Sink,
    on_read: Callable[[Read, list[memoryview]], None] | None,
) -> int:
    read, views, future = item
    n = future.result()
    if on_read is not None:
        on_read(read, views)
    sink.release(read, views)
    return n


def _pread_all(fd: int, read: Read, views: list[memoryview]) -> int:
    """Fill ``views`` from ``read.offset`` on; short reads are retried, EOF is an error."""
    pending = [v for v in views if len(v)]
    done = 0
    while pending:
        n = os.preadv(fd, pending, read.offset + done)
        if n == 0:
            _raise_truncated(read, done)
        done += n
        while n:
            if n >= len(pending[0]):
                n -= len(pending.pop(0))
            else:
                pending[0] = pending[0][n:]
                n = 0
    return done


def _raise_truncated(read: Read, done: int) -> None:
    at = read.offset + done
    tensor = next(
        (s.tensor for s in read.segments if s.offset <= at < s.offset + s.length),
        read.segments[-1].tensor,
    )
    raise CheckpointError(
        f"{read.file}: file ends at byte {at} but tensor {tensor!r} needs bytes up to "
        f"{read.offset + read.length}; the file is truncated: download or convert it again",
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
    """Segments that put shard ``i``'s ranges, in order, into destination ``i``."""
    segments = []
    for index, shard in enumerate(shards):
        pos = 0
        for r in shard.ranges:
            segments.append(Segment(r.file, r.offset, r.length, index, pos, shard.name))
            pos += r.length
    return segments


def read_segments(
    segments: Sequence[Segment],
    sizes: Sequence[int],
    device: torch.device,
    options: ReaderOptions,
    *,
    on_read: Callable[[Read, list[memoryview]], None] | None = None,
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
    reads = plan_reads(segments, options.chunk_bytes)
    return buffers, sink, run_reads(reads, sink, options, on_read=on_read)


def shard_tensors(
    shards: Sequence[TensorShard], buffers: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """View ``buffers[i]``, the raw bytes of ``shards[i]``, as its dtype and shape (no copy).
    ``buffers`` may hold more (scratch) buffers after the shards'."""
    return {
        shard.name: buffers[i].view(torch_dtype(shard.dtype)).reshape(shard.shape)
        for i, shard in enumerate(shards)
    }
