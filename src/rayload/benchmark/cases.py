"""What a benchmark case does inside one rank process.

A case is one way of getting a TP rank's weights into memory: rayload's own load methods
(through :func:`rayload.loading.load_rank`), the peers as their users run them, and the
limit (one sequential read of every checkpoint byte). Each case returns the rank's
tensors *materialized*: copied into memory the rank owns, as a model's weight loader would
copy them into its parameters. safetensors 0.8 hands out lazily mapped tensors, so without
that copy a peer would be timed for reading nothing.

The cases of one layout (:mod:`rayload.benchmark.layouts`) hand each rank the same
tensors, cut on the same dimensions (those of rayload's plan), so their outputs can be
compared byte for byte; the peers and limits are all of the ``tp`` layout. From an
``s3://`` checkpoint only the cases whose ``storages`` name ``s3`` run: rayload's own
(the ranks fetch their ranges) and the limit, there the server's. On a
mixture-of-experts checkpoint, ``scratch_ep`` (expert parallel) and ``whole_experts``
(every rank every expert whole) hold other tensors than ``scratch`` (each expert split).

Past 400 lines on purpose: every case's function sits beside its entry in :data:`CASES`,
the one table the runner, the report and ``rayload bench --methods`` read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch

from rayload.benchmark import probes
from rayload.benchmark.layouts import EP, TP, WHOLE_EXPERTS, LoadOptions
from rayload.loading.report import RankReport
from rayload.loading.storage import StorageCounters, is_remote, storage_for
from rayload.loading.storage.base import StorageKind

Kind = Literal["rayload", "peer", "limit"]


@dataclass(frozen=True)
class RankJob:
    """What one rank process runs. Picklable: it crosses into the rank process."""

    case: str
    rank: int
    tp_size: int
    checkpoint: str
    files: tuple[str, ...]
    splits: Mapping[str, int | None]
    converted: str | None = None
    device: str = "cpu"
    verify: bool = False
    options: LoadOptions = field(default_factory=LoadOptions)
    """What ``load_rank`` is given for the case's layout (rayload cases)."""


@dataclass
class Loaded:
    """A case's result: the rank's tensors, plus what the case knows about its own reads.

    ``mapped_bytes`` are file pages a memory-mapped reader touched (invisible to
    ``rchar``); ``effective`` is the load method that really ran and ``phases`` where its
    time went (rayload cases).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    mapped_bytes: int = 0
    storage_bytes: int | None = None
    """Bytes received from object storage (``s3://``), which ``rchar`` does not see;
    None for local files."""
    effective: str | None = None
    fallback_reason: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per ``rank.*`` phase of the rank's load (rayload cases)."""


@dataclass(frozen=True)
class Case:
    """One benchmarked way of loading. ``per_rank`` cases run one process per TP rank;
    the limit runs once, in one process, whatever the TP size."""

    name: str
    kind: Kind
    description: str
    run: Callable[[RankJob], Loaded]
    per_rank: bool = True
    needs_cuda: bool = False
    reads_converted: bool = False
    """It reads the converted copy for the TP size (``RankJob.converted``)."""
    layout: str = TP
    """How its TP group divides the tensors, so which reference it is checked against."""
    method: str | None = None
    """The rayload load method it runs (rayload cases), as their reports name it."""
    storages: tuple[StorageKind, ...] = ("file",)
    """The storages it can read a checkpoint from."""
    why_local_only: str = ""
    """Why it reads local files only (when ``storages`` lacks ``s3``)."""


def shard_index(
    shape: tuple[int, ...], split: int | None, rank: int, tp_size: int
) -> tuple[slice, ...]:
    """The index of rank ``rank``'s shard of a tensor of ``shape`` cut along ``split``."""
    index = [slice(None)] * len(shape)
    if split is not None:
        size = shape[split] // tp_size
        index[split] = slice(rank * size, (rank + 1) * size)
    return tuple(index)


def _materialize(t: torch.Tensor, device: str) -> torch.Tensor:
    """An owned, contiguous copy of ``t`` on ``device`` (what a weight loader keeps)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t)
    return out


def _rayload(method: str) -> Callable[[RankJob], Loaded]:
    def run(job: RankJob) -> Loaded:
        from rayload.loading import load_rank

        path = _converted_dir(job) if method == "converted" else job.checkpoint
        tensors, report = load_rank(
            path,
            job.rank,
            job.tp_size,
            method=method,
            device=job.device,
            rules=job.options.rules,
            expert_parallel=job.options.expert_parallel,
        )
        return Loaded(
            dict(tensors),
            storage_bytes=_remote_bytes(report),
            effective=str(report.method.effective),
            fallback_reason=report.method.fallback_reason,
            phases={p.name: p.seconds for p in report.phases},
        )

    return run


def _remote_bytes(report: RankReport) -> int | None:
    """What the rank received from object storage; None from local files (``rchar``)."""
    return report.bytes_from_storage if report.storage != "file" else None


def _scratch_model(job: RankJob) -> Loaded:
    """scratch, then the reference TP model built on the meta device and filled from the
    shards (``rayload.load(..., model=build_model)`` without Ray): what ``model=`` costs
    in time and memory on top of the load. The returned tensors live in the model."""
    from rayload.loading import load_rank
    from rayload.loading.checkpoint import open_checkpoint
    from rayload.loading.fill import fill_model
    from rayload.loading.model import MODEL_PHASE, ModelContext
    from rayload.models import build_model

    tensors, report = load_rank(job.checkpoint, job.rank, job.tp_size, "scratch", job.device)
    config = open_checkpoint(job.checkpoint).config or {}
    start = time.perf_counter()
    module = build_model(ModelContext(job.rank, job.tp_size, job.device, config))
    fill_model(module, tensors, rank=job.rank)
    phases = {p.name: p.seconds for p in report.phases}
    phases[MODEL_PHASE] = time.perf_counter() - start
    return Loaded(
        dict(tensors),
        storage_bytes=_remote_bytes(report),
        effective=str(report.method.effective),
        phases=phases,
    )


def _safe_open_slice(job: RankJob) -> Loaded:
    """safetensors ``safe_open`` + ``get_slice(name)[shard]``, file by file (vLLM's way)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    mapped = 0
    for path in job.files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                view = f.get_slice(name)
                index = shard_index(
                    tuple(view.get_shape()), job.splits[name], job.rank, job.tp_size
                )
                out[name] = _materialize(view[index], job.device)
            mapped += probes.mapped_bytes([path])
    return Loaded(out, mapped_bytes=mapped)


def _load_file_slice(job: RankJob) -> Loaded:
    """``safetensors.torch.load_file`` of every file, then each tensor sliced to the shard."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    mapped = 0
    for path in job.files:
        full = load_file(path)
        for name, t in full.items():
            index = shard_index(tuple(t.shape), job.splits[name], job.rank, job.tp_size)
            out[name] = _materialize(t[index], job.device)
        mapped += probes.mapped_bytes([path])
        del full
    return Loaded(out, mapped_bytes=mapped)


def _fastsafetensors_whole(job: RankJob) -> Loaded:
    """fastsafetensors loading every file of the checkpoint in this rank, then slicing:
    what a rank does when it has no process group to spread the files over."""
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    loader = SafeTensorsFileLoader(SingleGroup(), device=job.device, nogds=True)
    try:
        loader.add_filenames({0: list(job.files)})
        buffers = loader.copy_files_to_device()
        try:
            out = {}
            for name in loader.get_keys():
                t = buffers.get_tensor(name)
                index = shard_index(tuple(t.shape), job.splits[name], job.rank, job.tp_size)
                out[name] = _materialize(t[index], job.device)
        finally:
            buffers.close()
    finally:
        loader.close()
    return Loaded(out)


LIMIT_CHUNK = 16 << 20


def _sequential_read(job: RankJob) -> Loaded:
    """The limit: every byte of every checkpoint file, read once, in order, with large
    reads into one reused buffer (the kernel's sequential readahead at its widest).
    From object storage, the server's limit (:func:`_ranged_gets`)."""
    if is_remote(job.checkpoint):
        return _ranged_gets(job.files, allocate=False)
    _read_in_order(job.files)
    return Loaded()


def _ranged_gets(paths: Sequence[str], *, allocate: bool) -> Loaded:
    """The server's limit: every byte of the objects ``paths`` as raw ranged GETs of
    ``gather_bytes`` (the longest GET rayload makes), as many in flight as a rayload
    rank's reader has, through the storage rayload reads with (one client, its retries),
    building no tensor; into one reused buffer per thread, or (``allocate``) into new
    memory holding the whole checkpoint, as a loader's destination is."""
    from rayload.loading.reader.options import REMOTE_THREADS

    storage = storage_for(paths[0])
    chunk = storage.gather_bytes
    pieces = [(p, off) for p in paths for off in range(0, storage.size(p), chunk)]
    local = threading.local()
    kept: list[torch.Tensor] = []

    def get(piece: tuple[str, int]) -> int:
        path, offset = piece
        size = min(chunk, storage.size(path) - offset)
        if allocate:
            buf = torch.empty(size, dtype=torch.uint8)
            kept.append(buf)
            view = buf.numpy().data.cast("B")
        else:
            if not hasattr(local, "view"):
                local.view = memoryview(bytearray(chunk))
            view = local.view[:size]
        return storage.read_into(path, offset, [view], size)

    before = storage.counters()
    with ThreadPoolExecutor(REMOTE_THREADS) as pool:
        for _ in pool.map(get, pieces):
            pass
    fetched: StorageCounters = storage.counters() - before
    return Loaded(storage_bytes=fetched.bytes)


def _rank_files_read(job: RankJob) -> Loaded:
    """The limit of ``converted``: this rank's files of the converted copy, read the way
    the limit reads, one process per rank as ``converted`` runs. What the disk gives
    four separate file streams, against the one stream of ``limit``."""
    from rayload.loading.manifest import MANIFEST_NAME, read_manifest

    root = _converted_dir(job)
    manifest = read_manifest(os.path.join(root, MANIFEST_NAME))
    _read_in_order([os.path.join(root, name) for name in manifest.ranks[job.rank]])
    return Loaded()


def _converted_dir(job: RankJob) -> str:
    if job.converted is None:
        raise ValueError(f"case {job.case!r} needs a converted checkpoint for tp={job.tp_size}")
    return job.converted


def _read_in_order(paths: Sequence[str]) -> None:
    buf = bytearray(LIMIT_CHUNK)
    view = memoryview(buf)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while os.readv(fd, [view]):
                pass
        finally:
            os.close(fd)


def _parallel_read(job: RankJob) -> Loaded:
    """The limit of a machine with many cores, where one thread does not reach memory
    bandwidth: the same bytes read by one thread per CPU, each into a reused buffer of its
    own, in ``LIMIT_CHUNK`` pieces taken in file order."""
    pieces = [(p, off) for p in job.files for off in range(0, os.path.getsize(p), LIMIT_CHUNK)]
    fds = {p: os.open(p, os.O_RDONLY) for p in job.files}
    local = threading.local()

    def read(piece: tuple[str, int]) -> int:
        if not hasattr(local, "view"):
            local.view = memoryview(bytearray(LIMIT_CHUNK))
        return os.preadv(fds[piece[0]], [local.view], piece[1])

    try:
        with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
            for _ in pool.map(read, pieces):
                pass
    finally:
        for fd in fds.values():
            os.close(fd)
    return Loaded()


def _sequential_read_alloc(job: RankJob) -> Loaded:
    """The limit for a loader, whose destination is new memory: the same sequential read,
    but into freshly allocated buffers that together hold the whole checkpoint, so the
    kernel's page faults and zeroing of new pages are paid as every loader pays them.
    From object storage, the server's limit into new memory (:func:`_ranged_gets`)."""
    if is_remote(job.checkpoint):
        return _ranged_gets(job.files, allocate=True)
    buffers = []
    for path in job.files:
        buf = torch.empty(os.path.getsize(path), dtype=torch.uint8)
        view = buf.numpy().data.cast("B")
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            pos = 0
            while n := os.preadv(fd, [view[pos : pos + LIMIT_CHUNK]], pos):
                pos += n
        finally:
            os.close(fd)
        buffers.append(buf)
    return Loaded()


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case(
            "limit",
            "limit",
            "one sequential read of the whole checkpoint (s3://: every byte as ranged GETs, "
            "a rank's reader threads in flight, reused buffers)",
            _sequential_read,
            per_rank=False,
            storages=("file", "s3"),
        ),
        Case(
            "limit_alloc",
            "limit",
            "the same sequential read into newly allocated memory (page faults paid)",
            _sequential_read_alloc,
            per_rank=False,
            storages=("file", "s3"),
        ),
        Case(
            "limit_parallel",
            "limit",
            "the same bytes read by one thread per CPU into reused buffers",
            _parallel_read,
            per_rank=False,
            why_local_only="reads local files (from s3:// the limit itself is parallel)",
        ),
        Case(
            "limit_rank_files",
            "limit",
            "each rank's files of the converted copy read the limit's way, one process per rank",
            _rank_files_read,
            reads_converted=True,
            why_local_only="reads a converted copy on local disk",
        ),
        Case(
            "scratch",
            "rayload",
            "rayload load_rank(method='scratch')",
            _rayload("scratch"),
            method="scratch",
            storages=("file", "s3"),
        ),
        Case(
            "converted",
            "rayload",
            "rayload load_rank(method='converted') on a converted copy",
            _rayload("converted"),
            reads_converted=True,
            method="converted",
            why_local_only="reads a converted copy on local disk",
        ),
        Case(
            "fastsafetensors",
            "rayload",
            "rayload load_rank(method='fastsafetensors')",
            _rayload("fastsafetensors"),
            method="fastsafetensors",
            why_local_only="fastsafetensors opens local files (from s3:// it falls back)",
        ),
        Case(
            "fastsafetensors_gdr",
            "rayload",
            "rayload load_rank(method='fastsafetensors_gdr')",
            _rayload("fastsafetensors_gdr"),
            needs_cuda=True,
            method="fastsafetensors_gdr",
            why_local_only="fastsafetensors opens local files (from s3:// it falls back)",
        ),
        Case(
            "scratch_model",
            "rayload",
            "scratch + the reference TP model (meta) filled in place, as load(model=...)",
            _scratch_model,
            method="scratch",
            storages=("file", "s3"),
        ),
        Case(
            "scratch_ep",
            "rayload",
            "rayload load_rank(method='scratch', expert_parallel=True): each rank its "
            "contiguous block of experts, whole",
            _rayload("scratch"),
            layout=EP,
            method="scratch",
            storages=("file", "s3"),
        ),
        Case(
            "whole_experts",
            "rayload",
            "rayload load_rank(method='scratch') with rules that replicate the experts' "
            "tensors: every rank reads every expert whole",
            _rayload("scratch"),
            layout=WHOLE_EXPERTS,
            method="scratch",
            storages=("file", "s3"),
        ),
        Case(
            "safe_open_slice",
            "peer",
            "safetensors safe_open + get_slice(name)[shard]",
            _safe_open_slice,
            why_local_only="safetensors opens local files",
        ),
        Case(
            "fastsafetensors_whole",
            "peer",
            "fastsafetensors, whole checkpoint per rank, sliced",
            _fastsafetensors_whole,
            why_local_only="fastsafetensors opens local files",
        ),
        Case(
            "load_file_slice",
            "peer",
            "safetensors.torch.load_file per file, sliced",
            _load_file_slice,
            why_local_only="safetensors opens local files",
        ),
    )
}
"""Every case by name, in the order the tables list them."""
