"""Run every benchmark case, interleaved, one process per TP rank, and collect samples.

Order: for each repetition, for each cache state, for each TP size, the limits first and
then every case (A B C A B C ...), so slow drift of a shared machine spreads over all
cases instead of biasing one. Each repetition takes its own row of a Williams design
(:func:`balanced_order`), so every case runs right after every other case equally often
and what one case leaves behind lands on all the others alike (docs/benchmarks.md,
"Order and repetitions", has the runs that showed why).

Before a cold case every file any case may read (checkpoint and converted copies) is
evicted from the page cache; before a warm case the files the case reads are read once.
The fraction of those files cached when the case starts is recorded, so a reader can
check that "cold" was cold.

An ``s3://`` checkpoint is benchmarked where it is: nothing of it is copied to this
machine, so the cases that read local files (the peers, ``converted``, fastsafetensors)
are skipped with that reason, the limit is the server's (every byte as raw ranged GETs),
and the page cache does not apply: its one cache state is :data:`REMOTE`.

Past 400 lines on purpose: preparing, ordering and running the cases is one sequence, read
top to bottom here; what each case does lives in :mod:`~rayload.benchmark.cases`, the
medians and targets computed from the samples in ``summary.py`` and ``targets.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rayload.benchmark import probes
from rayload.benchmark.cases import CASES, Case, RankJob
from rayload.benchmark.layouts import TP, LayoutPlan, LoadOptions, load_options, summarize_layout
from rayload.benchmark.worker import RankSample
from rayload.errors import ConfigError, ShardingError
from rayload.loading.storage import is_remote, storage_for

log = logging.getLogger(__name__)

CACHES = ("cold", "warm")
REMOTE = "remote"
"""The cache state of an ``s3://`` checkpoint: its objects come from the server on every
load, never from this machine's page cache, so there is nothing to evict or warm."""
Progress = Callable[[str], None]


def no_cache_states(checkpoint: str) -> ConfigError:
    """The error for page cache states asked of an ``s3://`` checkpoint."""
    return ConfigError(
        f"--cache does not apply to {checkpoint}: its objects are fetched from the server on "
        "every load, never from this machine's page cache; drop --cache"
    )


@dataclass(frozen=True)
class BenchConfig:
    """What to benchmark. Validated on construction (``ConfigError`` on bad values)."""

    size_gb: float = 1.0
    """Size of the generated checkpoint (ignored with ``checkpoint``)."""
    tp_sizes: tuple[int, ...] = (1, 2, 4)
    caches: tuple[str, ...] = CACHES
    """Page cache states to run each case in. An ``s3://`` checkpoint has one,
    :data:`REMOTE`, which the default (both) becomes there; any other is an error."""
    repeat: int = 3
    """Repetitions of every case; the summary reports medians."""
    methods: tuple[str, ...] | None = None
    """Case names to run (see ``cases.CASES``); None: every case this machine can run.
    The limit always runs: every ratio refers to it."""
    workdir: str = "/tmp/rayload-bench"
    """Where the generated checkpoint and converted copies live (kept between runs)."""
    checkpoint: str | None = None
    """Benchmark this existing checkpoint (a directory, or ``s3://bucket/prefix``)
    instead of generating one."""
    preset: str = "llama-1b"
    dtype: str = "bf16"
    device: str = "cpu"
    verify: bool = True
    """Hash every rank's tensors (after timing) and check that all cases agree."""
    rank_timeout_s: float = 900.0
    split_probe: bool = True
    """Also measure read amplification by kind of tensor (split 0 + replicated, split 1)
    on small one-layer checkpoints, at the largest TP size."""
    startup: bool = True
    """Also time whole ``rayload.load`` calls (Ray start, placement, actors, weights) at
    the largest TP size, with and without trace files."""

    def __post_init__(self) -> None:
        if not self.size_gb > 0:
            raise ConfigError(f"--size-gb must be positive, got {self.size_gb}")
        if not self.tp_sizes or any(tp < 1 for tp in self.tp_sizes):
            raise ConfigError(f"--tp needs sizes >= 1, got {list(self.tp_sizes)}")
        remote = self.checkpoint is not None and is_remote(self.checkpoint)
        if remote and self.caches not in (CACHES, (REMOTE,)):
            raise no_cache_states(str(self.checkpoint))
        if remote:
            object.__setattr__(self, "caches", (REMOTE,))
        elif bad := [c for c in self.caches if c not in CACHES] or not self.caches:
            raise ConfigError(f"--cache takes {' and/or '.join(CACHES)}, got {bad or 'none'}")
        if self.repeat < 1:
            raise ConfigError(f"--repeat must be >= 1, got {self.repeat}")
        if self.methods is not None and (bad := [m for m in self.methods if m not in CASES]):
            raise ConfigError(f"unknown benchmark case(s) {bad}; choose from {', '.join(CASES)}")
        if self.checkpoint is not None and not remote and not os.path.isdir(self.checkpoint):
            raise ConfigError(f"checkpoint {self.checkpoint} is not a directory")

    @property
    def remote(self) -> bool:
        """Whether the checkpoint is in object storage (``s3://``)."""
        return self.checkpoint is not None and is_remote(self.checkpoint)

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class CaseSample:
    """One run of one case: every rank's sample. ``wall_s`` spans the first rank's start to
    the last rank's end (the TP group is loaded when its slowest rank is)."""

    case: str
    tp_size: int
    cache: str
    repetition: int
    cached_before: float
    ranks: tuple[RankSample, ...]

    @property
    def error(self) -> str | None:
        errors = [f"rank {r.rank}: {r.error}" for r in self.ranks if r.error]
        return "; ".join(errors) or None

    @property
    def wall_s(self) -> float:
        return (max(r.end_ns for r in self.ranks) - min(r.start_ns for r in self.ranks)) / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "tp_size": self.tp_size,
            "cache": self.cache,
            "repetition": self.repetition,
            "cached_before": round(self.cached_before, 4),
            "wall_s": None if self.error else round(self.wall_s, 6),
            "error": self.error,
            "ranks": [r.to_dict() for r in self.ranks],
        }


@dataclass(frozen=True)
class Prepared:
    """The checkpoint under test and everything derived from it before timing starts."""

    checkpoint: str
    files: tuple[str, ...]
    checkpoint_bytes: int
    splits: Mapping[int, Mapping[str, int | None]]
    plan_rank_bytes: Mapping[int, tuple[int, ...]]
    converted: Mapping[int, str]
    converted_files: Mapping[int, tuple[str, ...]]
    skipped: Mapping[str, str] = field(default_factory=dict)
    """Case name -> why it cannot run here."""
    options: Mapping[str, LoadOptions] = field(default_factory=lambda: {TP: LoadOptions()})
    """Layout -> what ``load_rank`` is given for it, for every layout that runs."""
    layouts: tuple[LayoutPlan, ...] = ()
    """What each layout that runs gives each rank, per TP size."""


def unavailable_reason(case: Case, checkpoint: str | None = None) -> str | None:
    """Why ``case`` cannot run on this machine (or on ``checkpoint``), or None."""
    storage = "s3" if checkpoint is not None and is_remote(checkpoint) else "file"
    if storage not in case.storages:
        return (
            f"{case.why_local_only or 'reads local files'}; an {storage}:// checkpoint is "
            "benchmarked where it is, nothing of it copied to this machine"
        )
    if case.needs_cuda:
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA device"
    return None


def prepare(config: BenchConfig, progress: Progress) -> Prepared:
    """Generate (or reuse) the checkpoint, plan every TP size, convert where needed."""
    requested = selected_cases(config)
    skipped = {
        n: r
        for n in requested
        if (r := unavailable_reason(CASES[n], config.checkpoint)) is not None
    }
    checkpoint = config.checkpoint or _generated_checkpoint(config, progress)
    return prepare_checkpoint(
        checkpoint,
        config.tp_sizes,
        config.workdir,
        progress,
        cases=[n for n in requested if n not in skipped],
        skipped=skipped,
    )


def prepare_checkpoint(
    checkpoint: str,
    tp_sizes: Sequence[int],
    workdir: str,
    progress: Progress,
    *,
    cases: Sequence[str],
    skipped: Mapping[str, str] | None = None,
) -> Prepared:
    """Plan ``checkpoint`` for every TP size in the layout of each of ``cases``, and make
    converted copies when one of them reads them. A case whose layout this checkpoint
    cannot have (experts divided, but there are none) is added to ``skipped``, with why."""
    from rayload.loading.checkpoint import open_checkpoint
    from rayload.loading.plan import plan_shards

    ckpt = open_checkpoint(checkpoint)
    files = tuple(ckpt.files)
    splits, plan_bytes, converted, converted_files = {}, {}, {}, {}
    for tp in tp_sizes:
        plan = plan_shards(ckpt, tp)
        splits[tp] = dict(plan.splits)
        plan_bytes[tp] = tuple(r.nbytes for r in plan.ranks)
        if any(CASES[n].reads_converted for n in cases):
            out = _converted_copy(checkpoint, files, tp, workdir, progress)
            converted[tp] = out
            converted_files[tp] = tuple(open_checkpoint(out).files)
    skipped = dict(skipped or {})
    options: dict[str, LoadOptions] = {}
    layouts: list[LayoutPlan] = []
    for layout in dict.fromkeys([TP, *(CASES[n].layout for n in cases)]):
        try:
            options[layout] = load_options(layout, ckpt)
            layouts += [summarize_layout(layout, ckpt, tp, options[layout]) for tp in tp_sizes]
        except (ConfigError, ShardingError) as exc:
            options.pop(layout, None)
            skipped.update({n: str(exc) for n in cases if CASES[n].layout == layout})
    return Prepared(
        checkpoint=str(checkpoint),
        files=files,
        checkpoint_bytes=sum(storage_for(f).size(f) for f in files),
        splits=splits,
        plan_rank_bytes=plan_bytes,
        converted=converted,
        converted_files=converted_files,
        skipped=skipped,
        options=options,
        layouts=tuple(layouts),
    )


def _generated_checkpoint(config: BenchConfig, progress: Progress) -> str:
    """The synthetic checkpoint for ``config``, written once into the work directory."""
    from rayload.loading.synthetic import write_checkpoint

    name = f"{config.preset}-{config.size_gb:g}gb-{config.dtype}"
    final = Path(config.workdir) / name
    if final.is_dir():
        return str(final)
    progress(f"writing a {config.size_gb:g} GB {config.preset} checkpoint to {final}")
    partial = final.with_name(name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_checkpoint(partial, preset=config.preset, size_gb=config.size_gb, dtype=config.dtype)
    partial.rename(final)
    return str(final)


def _converted_copy(
    checkpoint: str, files: Sequence[str], tp: int, workdir: str, progress: Progress
) -> str:
    """A converted copy for ``tp``, reused while it is newer than every checkpoint file."""
    from rayload.loading.convert import convert_checkpoint

    out = Path(workdir) / f"{Path(checkpoint).name}-converted-tp{tp}"
    manifest = out / "rayload-manifest.json"
    newest = max(os.path.getmtime(f) for f in files)
    if manifest.is_file() and manifest.stat().st_mtime > newest:
        return str(out)
    progress(f"converting for tp={tp} into {out} (not timed)")
    shutil.rmtree(out, ignore_errors=True)
    convert_checkpoint(checkpoint, out, tp)
    return str(out)


def _case_files(case: Case, tp: int, prep: Prepared) -> tuple[str, ...]:
    return prep.converted_files[tp] if case.reads_converted else prep.files


def _all_files(prep: Prepared) -> tuple[str, ...]:
    return prep.files + tuple(f for fs in prep.converted_files.values() for f in fs)


def run_case(
    case: Case, tp: int, cache: str, repetition: int, prep: Prepared, config: BenchConfig
) -> CaseSample:
    """Set the page cache, start one process per rank (one for the limit), return samples."""
    files = _case_files(case, tp, prep)
    if cache == "cold":
        probes.evict(_all_files(prep))
    elif cache == "warm":
        probes.warm(files)
    cached = 0.0 if cache == REMOTE else probes.cached_fraction(files)
    ranks = tp if case.per_rank else 1
    jobs = [
        RankJob(
            case=case.name,
            rank=rank,
            tp_size=tp if case.per_rank else 1,
            checkpoint=prep.checkpoint,
            files=prep.files,
            splits=prep.splits[tp] if case.per_rank else {},
            converted=prep.converted.get(tp),
            # The local GPU by index: fastsafetensors refuses a bare "cuda".
            device="cuda:0" if config.device == "cuda" else config.device,
            verify=config.verify,
            options=prep.options[case.layout],
        )
        for rank in range(ranks)
    ]
    samples = _run_processes(jobs, config.rank_timeout_s)
    return CaseSample(case.name, tp, cache, repetition, cached, samples)


_context: Any = None


def _mp_context() -> Any:
    """A forkserver that has imported torch and the readers once; each rank is a fresh
    fork of it (cheap, no import inside a measured block, a clean peak-RSS counter)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["rayload.benchmark.worker"])
    return _context


def _run_processes(jobs: Sequence[RankJob], timeout_s: float) -> tuple[RankSample, ...]:
    from rayload.benchmark.worker import rank_main

    ctx = _mp_context()
    barrier = ctx.Barrier(len(jobs))
    procs, conns = [], []
    for job in jobs:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=rank_main, args=(job, barrier, child, timeout_s), name=f"bench-rank{job.rank}"
        )
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    deadline = time.monotonic() + timeout_s
    samples = []
    for job, proc, conn in zip(jobs, procs, conns, strict=True):
        sample: RankSample | None = None
        if conn.poll(max(0.0, deadline - time.monotonic())):
            try:
                sample = conn.recv()
            except EOFError:
                sample = None
        proc.join(timeout=max(1.0, deadline - time.monotonic()))
        if proc.is_alive():
            log.warning("killing rank %d process %d of case %s", job.rank, proc.pid, job.case)
            proc.kill()
            proc.join()
            sample = sample or RankSample(job.rank, error=f"no result within {timeout_s:g} s")
        samples.append(sample or RankSample(job.rank, error=f"process died ({proc.exitcode})"))
        conn.close()
    return tuple(samples)


def run_all(config: BenchConfig, prep: Prepared, progress: Progress) -> list[CaseSample]:
    """Every (repetition, cache, tp, case), interleaved as described in the module doc."""
    names = [n for n in selected_cases(config) if n not in prep.skipped]
    limits = [CASES[n] for n in names if not CASES[n].per_rank]
    cases = [CASES[n] for n in names if CASES[n].per_rank]
    samples: list[CaseSample] = []
    for rep in range(config.repeat):
        for cache in config.caches:
            for limit in balanced_order(limits, rep):
                samples.append(run_case(limit, 1, cache, rep, prep, config))
                _report(samples[-1], progress)
            for tp in config.tp_sizes:
                for case in balanced_order(cases, rep):
                    samples.append(run_case(case, tp, cache, rep, prep, config))
                    _report(samples[-1], progress)
    return samples


T = TypeVar("T")


def balanced_order(items: Sequence[T], rep: int) -> list[T]:
    """Repetition ``rep``'s order of ``items``: row ``rep`` of a Williams design, a Latin
    square in which, over n repetitions (2n for an odd number n of items), every item runs
    directly after every other item equally often. Whatever a case leaves behind (freed
    memory, the disk's state) then lands on every other case alike; a rotation (A B C,
    B C A, C A B) would keep C right after B in every repetition but one."""
    n = len(items)
    first = [0]  # 0, 1, n-1, 2, n-2, ...: consecutive differences all distinct mod n
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    row = rep % (2 * n if n % 2 else n)
    order = [(i + row) % n for i in first]
    return [items[i] for i in (order[::-1] if row >= n else order)]


def selected_cases(config: BenchConfig) -> tuple[str, ...]:
    """The cases ``config`` asks for, in table order; the limit is always one of them."""
    chosen = config.methods or tuple(CASES)
    return tuple(n for n in CASES if n in chosen or n == "limit")


def _report(sample: CaseSample, progress: Progress) -> None:
    outcome = f"FAILED: {sample.error}" if sample.error else f"{sample.wall_s:.3f} s"
    progress(
        f"rep {sample.repetition} {sample.cache:4} tp={sample.tp_size} {sample.case:22} {outcome}"
    )
