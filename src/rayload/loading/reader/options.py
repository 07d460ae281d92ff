"""How rayload's reader reads: threads, chunk size and staging buffers, decided per
destination device."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

REMOTE_THREADS = 16
"""Ranged GETs in flight per rank by default when reading from object storage."""


@dataclass(frozen=True)
class ReaderOptions:
    """How rayload's own reader (scratch, converted, convert) reads files.

    Memory stays bounded by ``threads * chunk_bytes`` of reads in flight (plus a bounce
    buffer per thread for closely strided split-1 rows, the storage's ``gather_bytes``:
    1 MiB for files, 4 MiB for S3; and, on CUDA, ``staging_buffers * chunk_bytes`` of
    pinned host memory), whatever the shard size.
    """

    threads: int | None = None
    """Reader threads issuing positional reads in parallel. None: 4 for host
    destinations; for CUDA destinations one per CPU this process may run on, 4 to 12
    (a GPU load from the page cache is bound by the threads' copies into pinned memory;
    docs/benchmarks.md "GPU" has the figures behind these numbers)."""
    chunk_bytes: int | None = None
    """The most bytes one read request covers; large tensors are split into chunks so
    they are read in parallel, and small file-contiguous tensors are merged up to it.
    None: 32 MiB for host destinations, 8 MiB for CUDA ones, where each read in flight
    holds a pinned staging buffer of this size and page-locking new memory is slow
    (docs/benchmarks.md "GPU")."""
    staging_buffers: int = 0
    """Pinned host buffers of ``chunk_bytes`` for host-to-device copies; 0 means
    ``threads + 2`` (every thread busy while the oldest two chunks are being copied)."""

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.chunk_bytes is not None and self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {self.chunk_bytes}")
        if self.staging_buffers < 0:
            raise ValueError(f"staging_buffers must be >= 0, got {self.staging_buffers}")

    def for_device(self, device: torch.device, *, remote: bool = False) -> ReadSettings:
        """These options decided for reading into ``device``; ``remote``: from object
        storage, where a request waits on the network, not on a CPU: :data:`REMOTE_THREADS`
        ranged GETs in flight, of 16 MiB (8 MiB into CUDA: one pinned staging buffer each)."""
        cuda = device.type == "cuda"
        cpus = process_cpus()
        if remote:
            threads = self.threads or REMOTE_THREADS
            chunk = self.chunk_bytes or ((8 if cuda else 16) << 20)
            return ReadSettings(threads, chunk, self.staging_buffers or threads + 2, cpus)
        allowed = len(cpus) if cpus else len(os.sched_getaffinity(0))
        threads = self.threads or (min(12, max(4, allowed)) if cuda else 4)
        chunk = self.chunk_bytes or ((8 if cuda else 32) << 20)
        return ReadSettings(threads, chunk, self.staging_buffers or threads + 2, cpus)


def process_cpus() -> frozenset[int] | None:
    """The CPUs this process's threads run on together (the union of their affinities)
    when that is more than the calling thread's own; None otherwise or where unknown.

    An engine may pin its main thread to one core and its compute threads to the others:
    vLLM's CPU worker binds its main thread to the first CPU of the worker's set and one
    OpenMP thread to each other CPU of it. Threads inherit the affinity of the thread that
    starts them, so the reader's would all share the main thread's one core (in a TP 1
    worker of two CPUs, half of what the worker was given); :func:`run_on` widens them
    to the process's set, never beyond it.
    """
    try:
        own = os.sched_getaffinity(0)
        union = set(own)
        for task in os.listdir("/proc/self/task"):
            try:
                union |= os.sched_getaffinity(int(task))
            except OSError:  # the thread has exited
                continue
    except (OSError, AttributeError):
        return None
    return frozenset(union) if union > own else None


def run_on(cpus: frozenset[int] | None) -> None:
    """Run the calling thread on ``cpus`` (a reader thread's initializer; None: as it is)."""
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            return


@dataclass(frozen=True)
class ReadSettings:
    """:class:`ReaderOptions` decided for one destination device."""

    threads: int
    chunk_bytes: int
    window: int
    """Reads in flight at once (on CUDA, one pinned staging buffer each)."""
    cpus: frozenset[int] | None = None
    """The CPUs the reader threads run on (:func:`process_cpus`); None: those of the
    thread that starts them."""
