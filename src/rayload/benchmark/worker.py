"""The rank process: wait at the barrier with the other ranks, run one case, measure it.

The runner forks one of these per TP rank from a forkserver that has already imported
torch, safetensors, fastsafetensors and ``rayload.loading`` (so no rank pays, or reads
files for, an import inside the measured block) and sends back one :class:`RankSample`.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import logging
import pkgutil
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from rayload.benchmark import probes
from rayload.benchmark.cases import CASES, Loaded, RankJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSample:
    """One rank's measurements of one case run.

    ``start_ns``/``end_ns`` are ``time.monotonic_ns()``, one clock for every process on the
    machine, so a case's wall time is ``max(end) - min(start)`` over its ranks.
    ``bytes_read`` = ``rchar`` delta + file pages touched through memory maps; from object
    storage, the bytes received from it instead (``storage_bytes``: sockets are read
    with ``recv``, which ``rchar`` does not count, while ``rchar`` there is the client's
    own files, botocore's service models, not the checkpoint's).
    ``rss_peak_delta`` = peak RSS during the case - RSS just before it; the returned
    tensors are still resident at the end, so it is at least ``host_shard_bytes``, the
    part of ``shard_bytes`` in host memory (all of it on CPU, none on a GPU).
    """

    rank: int
    start_ns: int = 0
    end_ns: int = 0
    rchar_bytes: int = 0
    mapped_bytes: int = 0
    storage_bytes: int | None = None
    rss_before: int = 0
    rss_peak: int = 0
    tensors: int = 0
    shard_bytes: int = 0
    host_shard_bytes: int = 0
    digest: str | None = None
    effective: str | None = None
    fallback_reason: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def bytes_read(self) -> int:
        if self.storage_bytes is not None:
            return self.storage_bytes
        return self.rchar_bytes + self.mapped_bytes

    @property
    def rss_peak_delta(self) -> int:
        return self.rss_peak - self.rss_before

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "seconds": round(self.seconds, 6),
            "bytes_read": self.bytes_read,
            "rchar_bytes": self.rchar_bytes,
            "mapped_bytes": self.mapped_bytes,
            "storage_bytes": self.storage_bytes,
            "rss_before": self.rss_before,
            "rss_peak_delta": self.rss_peak_delta,
            "tensors": self.tensors,
            "shard_bytes": self.shard_bytes,
            "host_shard_bytes": self.host_shard_bytes,
            "digest": self.digest,
            "effective": self.effective,
            "fallback_reason": self.fallback_reason,
            "phases": {name: round(seconds, 6) for name, seconds in self.phases.items()},
            "error": self.error,
        }


def preload() -> None:
    """Import everything a case may import, so that imports are not measured."""
    import fastsafetensors  # noqa: F401
    import safetensors.torch  # noqa: F401

    try:
        import boto3  # noqa: F401  (s3:// checkpoints)
    except ImportError as exc:
        log.debug("not preloading boto3: %s", exc)

    import rayload.loading

    for module in pkgutil.walk_packages(rayload.loading.__path__, "rayload.loading."):
        try:
            importlib.import_module(module.name)
        except ImportError as exc:
            log.debug("not preloading %s: %s", module.name, exc)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of names, dtypes, shapes and bytes, so cases can be checked against each other."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _measure(job: RankJob, barrier: Any, barrier_timeout_s: float) -> RankSample:
    case = CASES[job.case]
    if job.device.startswith("cuda"):
        # A serving process has its CUDA context before it loads weights: not timed here.
        torch.zeros(1, device=job.device)
        torch.cuda.synchronize()
    gc.collect()
    rss_before = probes.rss_bytes()
    probes.reset_peak_rss()
    rchar_before = probes.rchar()
    barrier.wait(barrier_timeout_s)
    start = time.monotonic_ns()
    loaded: Loaded = case.run(job)
    if job.device.startswith("cuda"):
        torch.cuda.synchronize()
    end = time.monotonic_ns()
    rchar_bytes = probes.rchar() - rchar_before
    rss_peak = probes.peak_rss_bytes()
    return RankSample(
        rank=job.rank,
        start_ns=start,
        end_ns=end,
        rchar_bytes=rchar_bytes,
        mapped_bytes=loaded.mapped_bytes,
        storage_bytes=loaded.storage_bytes,
        rss_before=rss_before,
        rss_peak=rss_peak,
        tensors=len(loaded.tensors),
        shard_bytes=sum(t.nbytes for t in loaded.tensors.values()),
        host_shard_bytes=sum(t.nbytes for t in loaded.tensors.values() if t.device.type == "cpu"),
        digest=digest(loaded.tensors) if job.verify and loaded.tensors else None,
        effective=loaded.effective,
        fallback_reason=loaded.fallback_reason,
        phases=loaded.phases,
    )


def rank_main(job: RankJob, barrier: Any, conn: Connection, barrier_timeout_s: float) -> None:
    """Process entry point: run ``job`` once and send its :class:`RankSample` on ``conn``.

    A failing rank breaks the barrier so that the others stop waiting, and reports its
    error instead of raising (the runner decides what a failed case means).
    """
    try:
        sample = _measure(job, barrier, barrier_timeout_s)
    except BaseException as exc:  # reported to the runner, which records and shows it
        barrier.abort()
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        log.debug("rank %d of case %s failed:\n%s", job.rank, job.case, traceback.format_exc())
        sample = RankSample(rank=job.rank, error=detail)
    conn.send(sample)
    conn.close()
