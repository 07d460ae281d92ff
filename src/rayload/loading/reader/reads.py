"""rayload's own reader: parallel reads of exact byte ranges into preallocated
destinations, with bounded memory; positional reads of local files, or ranged GETs of
objects in object storage (the storage's ``read_into``), for the same read plan.

What is read into where is planned by :mod:`~rayload.loading.reader.readplan`; where
the bytes land (host buffers, or pinned staging + host-to-device copies) is a sink of
:mod:`~rayload.loading.reader.sinks`.

:func:`run_reads` executes the batches on a thread pool, at most ``window`` in flight,
and releases each finished batch to its sink in order. An ``on_read`` hook runs on the
reader thread right after each read, while the bytes are fresh (the converted backend's
checksums: CPU work spread over the reader threads, overlapping the other threads'
reads, never holding up the next read).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from rayload.errors import CheckpointError
from rayload.loading.arrivals import Arrivals
from rayload.loading.dtypes import torch_dtype
from rayload.loading.plan import TensorShard
from rayload.loading.reader.options import ReaderOptions, ReadSettings, run_on
from rayload.loading.reader.pages import prefault
from rayload.loading.reader.readplan import Batch, Read, Segment, batch_reads, plan_reads
from rayload.loading.reader.sinks import (
    HostSink,
    Sink,
    StagedDeviceSink,
    Views,
    host_buffers,
    host_view,
)
from rayload.loading.storage import Storage, is_remote, storage_for
from rayload.loading.storage.base import Progress

ReadHook = Callable[["Read", list[memoryview]], None]
"""Called with each read and the buffers it filled, on the reader thread, right after the
read; reads of one run call it concurrently and in no particular order."""


def run_reads(
    batches: Sequence[Batch],
    sink: Sink,
    settings: ReadSettings,
    *,
    on_read: ReadHook | None = None,
    landing: Landing | None = None,
) -> int:
    """Execute ``batches`` into ``sink`` on ``settings.threads`` threads, at most
    ``settings.window`` in flight; return the bytes read (the sum of what ``os.preadv``
    returned). ``on_read`` (thread-safe) sees every read on the thread that performed it,
    before its batch is released. ``landing`` is told of the bytes as they land (host
    destinations only: a sink whose views are the destinations). A file shorter than a
    read is a CheckpointError naming it."""
    total = 0
    files = (r.file for b in batches for r in b.reads)
    pool = ThreadPoolExecutor(
        settings.threads,
        thread_name_prefix="rayload-read",
        initializer=run_on,
        initargs=(settings.cpus,),
    )
    with _open_ranges(files) as fds:
        inflight: deque[tuple[Batch, Views, Future[int]]] = deque()
        try:
            for batch in batches:
                if len(inflight) >= settings.window:
                    total += _finish(inflight.popleft(), sink)
                views = sink.acquire(batch)
                future = pool.submit(
                    _pread_batch, fds, batch, views, on_read, sink.prefault, landing
                )
                inflight.append((batch, views, future))
            while inflight:
                total += _finish(inflight.popleft(), sink)
        except BaseException:
            # Threads may still be reading into the buffers or from the files, a device
            # sink copying to the device: wait for both.
            pool.shutdown(wait=True, cancel_futures=True)
            with contextlib.suppress(Exception):
                sink.finish()
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


def _pread_batch(
    fds: Mapping[str, RangeSource],
    batch: Batch,
    views: Views,
    on_read: ReadHook | None,
    fresh: bool,
    landing: Landing | None = None,
) -> int:
    """``batch``'s reads into ``views``; ``fresh``: the views may be memory not yet
    faulted in, so each is faulted in at once before its read (:func:`.pages.prefault`)."""
    total = 0
    for read, read_views in zip(batch.reads, views, strict=True):
        if fresh:
            for view in read_views:
                prefault(view)
        progress = None if landing is None else landing.progress(read)
        total += _pread_all(fds[read.file], read, read_views, progress)
        if landing is not None:
            landing.landed(read)
        if on_read is not None:
            on_read(read, read_views)
    return total


class Landing:
    """Tells ``arrivals`` which destination bytes a read has filled: as an object store's
    body comes (:meth:`progress`), and all of them once the read is done (:meth:`landed`).
    Destinations past the arrivals' tensors (a read's own buffers, such as the TP group's
    whole tensors) are not told. Thread-safe (the arrivals are)."""

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = self._arrivals = arrivals
        self._count = len(arrivals.sizes)

    def progress(self, read: Read) -> Progress | None:
        """``progress(done)`` for ``read``: its first ``done`` bytes are in place (its
        segments are file-contiguous, in order); None for strided rows."""
        if read.row:
            return None
        arrivals = self._arrivals

        def progress(done: int) -> None:
            for segment in read.segments:
                covered = min(segment.length, done - (segment.offset - read.offset))
                if covered <= 0:
                    return
                if segment.target < self._count:
                    arrivals.landed(segment.target, segment.target_offset, covered)

        return progress

    def landed(self, read: Read) -> None:
        for segment in read.segments:
            if segment.target < self._count:
                self._arrivals.landed(segment.target, segment.target_offset, segment.length)


def _pread_all(
    fd: RangeSource, read: Read, views: list[memoryview], progress: Progress | None = None
) -> int:
    """Perform ``read`` into ``views``: one ``os.preadv`` (or ranged GET); when strided, one
    per row, or (rows closer than the storage's ``gather_gap``, a page for files) one per
    run of rows through a bounce buffer."""
    if not read.row:
        return _pread_exact(fd, read, read.offset, views, read.length, progress)
    [view] = views
    row, stride = read.row, read.stride
    gap, span_bytes = (
        (GATHER_GAP, _GATHER_BYTES) if isinstance(fd, int) else (fd.gather_gap, fd.gather_bytes)
    )
    per_span = span_bytes // stride if stride - row < gap else 0
    if per_span < 2:
        for i, pos in enumerate(range(0, read.length, row)):
            _pread_exact(fd, read, read.offset + i * stride, [view[pos : pos + row]], row)
        return read.length
    rows = read.length // row
    bounce = _bounce_buffer(span_bytes)
    dst = np.frombuffer(view, dtype=np.uint8).reshape(rows, row)
    total = 0
    for first in range(0, rows, per_span):
        n = min(per_span, rows - first)
        span = (n - 1) * stride + row
        total += _pread_exact(fd, read, read.offset + first * stride, [bounce.data[:span]], span)
        dst[first : first + n] = as_strided(bounce, (n, row), (stride, 1))
    return total


GATHER_GAP = 4096
"""Strided rows less than this apart (a page) are read as whole runs, gaps included, and
gathered: every page of such a run holds row bytes, so the disk reads the same pages
either way, and one system call replaces up to thousands (rows of 256 and 512 bytes at
tp 2: a rank's reads took 60 ms instead of 209). Wider gaps are skipped, one
``os.preadv`` per row."""
_GATHER_BYTES = 1 << 20
_local = threading.local()


def _bounce_buffer(nbytes: int) -> np.ndarray:
    """This reader thread's bounce buffer for gathered rows, of at least ``nbytes`` (the
    storage's ``gather_bytes``)."""
    buffer = getattr(_local, "bounce", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _local.bounce = np.empty(nbytes, dtype=np.uint8)
    return buffer


def _pread_exact(
    fd: RangeSource,
    read: Read,
    offset: int,
    views: list[memoryview],
    size: int,
    progress: Progress | None = None,
) -> int:
    """Fill ``views`` (``size`` bytes) from ``offset``; short reads are retried, end of
    file is a CheckpointError. An object storage fills them itself, exactly or raising,
    telling ``progress`` as its body comes."""
    if not isinstance(fd, int):
        return fd.read_into(read.file, offset, views, size, progress)
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
    raise truncated_error(read.file, at, tensor)


def truncated_error(path: str, at: int, tensor: str) -> CheckpointError:
    """The file at ``path`` ends at byte ``at``, inside ``tensor``."""
    return CheckpointError(
        f"{path}: the file ends at byte {at}, inside tensor {tensor!r}; the file is "
        "truncated: download or convert it again",
        file=path,
        tensor=tensor,
    )


def unreadable_error(path: str, exc: OSError) -> CheckpointError:
    """The file at ``path`` cannot be opened for reading (``exc`` says why)."""
    return CheckpointError(
        f"{path}: cannot open for reading ({exc.strerror or exc}); check that the "
        "checkpoint is complete and readable",
        file=path,
    )


RangeSource = int | Storage
"""How a file is read: a local file's descriptor, or the object storage holding it."""


@contextmanager
def _open_ranges(paths: Iterable[str]) -> Iterator[dict[str, RangeSource]]:
    fds: dict[str, RangeSource] = {}
    try:
        for path in dict.fromkeys(paths):
            if is_remote(path):
                fds[path] = storage_for(path)
                continue
            try:
                fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise unreadable_error(path, exc) from exc
        yield fds
    finally:
        for fd in fds.values():
            if isinstance(fd, int):
                os.close(fd)


def read_segments(
    segments: Sequence[Segment],
    sizes: Sequence[int],
    device: torch.device,
    options: ReaderOptions,
    *,
    on_read: ReadHook | None = None,
    targets: Sequence[torch.Tensor] = (),
    touched: set[int] | None = None,
    publish: Callable[[Sequence[torch.Tensor]], Arrivals] | None = None,
    arrivals_out: list[Arrivals] | None = None,
    keep: int = 0,
) -> tuple[list[torch.Tensor], Sink, int]:
    """Read ``segments`` into one byte buffer of ``sizes[i]`` per destination on
    ``device``. The first destinations are ``targets`` when given: existing byte buffers
    (:func:`byte_view` of resident tensors), filled in place; the others are allocated.
    ``touched`` collects the indices of the destinations the reader began writing.
    ``publish`` is given the buffers before the first read and returns the
    :class:`~rayload.loading.arrivals.Arrivals` to mark as the bytes land (on a device:
    as each staging batch's copy completes; appended
    to ``arrivals_out`` when given, for a caller that fills some destinations itself).
    ``keep``: the first ``keep`` destinations are the load's tensors, which outlive the
    read; on the host those it allocates share one allocation (:func:`host_buffers`: a
    peer channel forwards runs of them with no packing copy), the others (scratch) do
    not. Returns the buffers, the sink (call ``finish()`` before using device buffers)
    and the bytes read."""
    remote = bool(segments) and is_remote(segments[0].file)
    settings = options.for_device(device, remote=remote)
    for i, target in enumerate(targets):
        if target.dtype != torch.uint8 or target.dim() != 1 or target.numel() != sizes[i]:
            raise ValueError(
                f"destination {i} is {target.dtype} {tuple(target.shape)}, expected "
                f"{sizes[i]} bytes as a 1-D uint8 view"
            )
    together = sizes[len(targets) : keep] if device.type == "cpu" else []
    buffers = [
        *targets,
        *host_buffers(together),
        *(
            torch.empty(n, dtype=torch.uint8, device=device)
            for n in sizes[len(targets) + len(together) :]
        ),
    ]
    landing = None
    if publish is not None:
        landing = Landing(publish(buffers))
        if arrivals_out is not None:
            arrivals_out.append(landing.arrivals)
    if device.type == "cuda":  # told as each batch's copy completes
        sink: Sink = StagedDeviceSink(buffers, settings, touched, landing)
        landing = None
    else:  # the host sink reads in place: told as each read ends
        sink = HostSink([host_view(b) for b in buffers], touched)
    chunk = settings.chunk_bytes
    batches = batch_reads(plan_reads(segments, chunk), chunk)
    return buffers, sink, run_reads(batches, sink, settings, on_read=on_read, landing=landing)


def byte_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """The bytes of ``tensor`` as a 1-D uint8 view of its own memory (no copy), None when
    it has none (not contiguous): what lets a reader write straight into a resident
    tensor."""
    if not tensor.is_contiguous():
        return None
    return tensor.reshape(-1).view(torch.uint8)


def shard_tensors(
    shards: Sequence[TensorShard], buffers: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """View ``buffers[i]``, the raw bytes of ``shards[i]``, as its dtype and shape (no copy).
    ``buffers`` may hold more (scratch) buffers after the shards'."""
    return {
        shard.name: buffers[i].view(torch_dtype(shard.dtype)).reshape(shard.shape)
        for i, shard in enumerate(shards)
    }
