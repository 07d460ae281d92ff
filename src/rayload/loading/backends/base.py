"""The backend contract: one class per load method, registered by method.

A backend executes one rank's :class:`~rayload.loading.plan.RankPlan` on one device. The
public :meth:`Backend.load` checks the result once (every planned tensor, with its shard
shape and dtype, on the device) and times the device synchronization; implementations
override :meth:`Backend._load` and record ``rank.read`` and ``rank.to_device`` themselves;
a phase that queues device work ends with :func:`synchronize`.
A backend never branches on the method name: methods that differ in one setting are two
classes sharing a base.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from rayload.errors import CheckpointError
from rayload.loading.checkpoint import Checkpoint
from rayload.loading.dtypes import torch_dtype
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import RankPlan
from rayload.loading.probe import EnvProbe
from rayload.loading.report import PhaseTimer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReaderOptions:
    """How rayload's own reader (scratch, converted, convert) reads files.

    Memory stays bounded by ``threads * chunk_bytes`` of reads in flight (plus a 1 MiB
    bounce buffer per thread for closely strided split-1 rows and, on CUDA,
    ``staging_buffers * chunk_bytes`` of pinned host memory), whatever the shard size.
    """

    threads: int | None = None
    """Reader threads issuing positional reads in parallel. None: 4 for host
    destinations; for CUDA destinations one per CPU this process may run on, 4 to 12.
    A GPU load from the page cache is bound by the threads' copies out of the page cache
    into pinned memory: on 16-core H200 hosts, 8 GB went at 12-17 GB/s with 4 threads,
    24-28 GB/s with 8 or 12, and no faster (on one host slower) with 16
    (docs/benchmarks.md)."""
    chunk_bytes: int | None = None
    """The most bytes one read request covers; large tensors are split into chunks so
    they are read in parallel, and small file-contiguous tensors are merged up to it.
    None: 32 MiB for host destinations, 8 MiB for CUDA ones, where each read in flight
    holds a pinned staging buffer of this size: page-locking new memory is slow (with
    576 MiB of 32 MiB buffers a fresh process took 0.44 s longer than a warmed one on the
    H200 host), and 8 MiB reads were as fast as 32 MiB ones there with 12 or 16 threads."""
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

    def for_device(self, device: torch.device) -> ReadSettings:
        """These options decided for reading into ``device``."""
        cuda = device.type == "cuda"
        threads = self.threads or (min(12, max(4, len(os.sched_getaffinity(0)))) if cuda else 4)
        chunk = self.chunk_bytes or ((8 if cuda else 32) << 20)
        return ReadSettings(threads, chunk, self.staging_buffers or threads + 2)


@dataclass(frozen=True)
class ReadSettings:
    """:class:`ReaderOptions` decided for one destination device."""

    threads: int
    chunk_bytes: int
    window: int
    """Reads in flight at once (on CUDA, one pinned staging buffer each)."""


@dataclass(frozen=True)
class BackendResult:
    """What a backend loaded.

    ``effective`` is the method that really ran; ``fallback_reason`` is set exactly when it
    differs from the backend's own method (e.g. fastsafetensors silently used its CPU
    copier instead of GDS).
    """

    tensors: dict[str, torch.Tensor]
    bytes_read: int
    effective: LoadMethod
    fallback_reason: str | None = None


class Backend(ABC):
    """Loads one rank's shards onto a device.

    ``checkpoint`` is the opened checkpoint (the converted backend reads its manifest);
    ``options`` tune rayload's own reader.
    """

    method: ClassVar[LoadMethod]

    def __init__(
        self,
        probe: EnvProbe,
        *,
        checkpoint: Checkpoint | None = None,
        options: ReaderOptions | None = None,
    ) -> None:
        self.probe = probe
        self.checkpoint = checkpoint
        self.options = options or ReaderOptions()

    def load(self, plan: RankPlan, device: torch.device | str, timer: PhaseTimer) -> BackendResult:
        """Load every shard of ``plan`` onto ``device``; phases go to ``timer``.

        Postcondition (checked): exactly the plan's tensors, each with its shard shape and
        dtype, on ``device``, and the device synchronized inside a ``rank.sync`` phase.
        """
        target = torch.device(device)
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", 0)
        result = self._load(plan, target, timer)
        with timer.phase("rank.sync", device=str(target)):
            synchronize(target)
        _check_result(plan, result, target)
        return result

    @abstractmethod
    def _load(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        """Read ``plan`` onto ``device``, timing ``rank.read`` and ``rank.to_device``."""


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished all queued work (no-op on CPU). A phase timing
    device work calls it last, so the phase ends when the work does, not when it was
    queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BACKENDS: dict[LoadMethod, type[Backend]] = {}
"""Load method -> backend class, filled by :func:`register`."""

_B = TypeVar("_B", bound=type[Backend])


def register(method: LoadMethod) -> Callable[[_B], _B]:
    """Class decorator: ``@register(LoadMethod.SCRATCH)`` makes the class the backend of
    ``method``. Registering a method twice is a programming error."""

    def decorator(cls: _B) -> _B:
        if method in BACKENDS:
            raise RuntimeError(f"{method} already has backend {BACKENDS[method].__name__}")
        cls.method = method
        BACKENDS[method] = cls
        return cls

    return decorator


def _check_result(plan: RankPlan, result: BackendResult, device: torch.device) -> None:
    expected = {s.name for s in plan.shards}
    if missing := expected - result.tensors.keys():
        raise CheckpointError(
            f"rank {plan.rank}: backend {result.effective} returned no tensor for "
            f"{sorted(missing)[:5]}",
            tensor=min(missing),
        )
    for shard in plan.shards:
        tensor = result.tensors[shard.name]
        want = (shard.shape, torch_dtype(shard.dtype), device)
        got = (tuple(tensor.shape), tensor.dtype, tensor.device)
        if got != want:
            raise CheckpointError(
                f"rank {plan.rank}: tensor {shard.name!r} was loaded as "
                f"(shape, dtype, device)={got}, the plan says {want}",
                tensor=shard.name,
            )
