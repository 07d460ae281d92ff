"""From samples to figures: medians per case, ratios to the limit and to the peers, the
cross-case consistency check, and the issue's targets.

Definitions (also in docs/benchmarks.md):

* ``wall_s``: median over repetitions of the case's wall time (first rank start to last
  rank end).
* ``gbps``: checkpoint bytes (every file's size) / ``wall_s``: how fast the TP group as a
  whole got through the checkpoint. For ``tp=1`` and the limit it is the read rate.
* ``rank_bytes_read``: the most any rank read (``rchar`` + memory-mapped pages touched).
* ``read_amplification``: bytes read by all ranks together / checkpoint bytes.
* ``rss_peak_delta``: the largest per-rank rise of resident memory during the load; the
  rank's shard stays resident, so ``rss_overhead = rss_peak_delta - host shard bytes``
  (on a GPU the shard is in device memory: all of the rise is overhead, e.g. pinned
  staging buffers).
* ``x_limit``: ``wall_s`` / the limit's ``wall_s`` in the same cache state (1.0 = as fast
  as one sequential read of the checkpoint into a reused buffer). ``x_limit_alloc``: the
  same against ``limit_alloc``, the sequential read into newly allocated memory.
  ``speedup[peer]``: the peer's ``wall_s`` / this case's ``wall_s`` at the same TP size
  and cache state (> 1: this case is faster).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rayload.benchmark.cases import CASES
from rayload.benchmark.runner import CaseSample

MB = 1 << 20
_LIMITS = frozenset(name for name, case in CASES.items() if case.kind == "limit")
_PARALLEL_LIMIT = {"scratch": "limit_parallel", "converted": "limit_rank_files"}
"""The limit case that reads with the parallelism of each rayload reader: every CPU on
the original files, or each rank process on its own converted files."""


@dataclass(frozen=True)
class CaseSummary:
    """Medians of one (case, tp, cache) over its successful repetitions."""

    case: str
    kind: str
    tp_size: int
    cache: str
    runs: int
    failures: int
    wall_s: float
    wall_s_min: float
    wall_s_max: float
    gbps: float
    rank_seconds_max: float
    rank_bytes_read: int
    read_amplification: float
    rss_peak_delta: int
    shard_bytes: int
    rss_overhead: int
    cached_before: float
    effective: tuple[str, ...]
    x_limit: float | None = None
    x_limit_alloc: float | None = None
    speedup: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def summarize(samples: Sequence[CaseSample], checkpoint_bytes: int) -> list[CaseSummary]:
    """One :class:`CaseSummary` per (case, tp, cache), in the order the cases first ran."""
    groups: dict[tuple[str, int, str], list[CaseSample]] = defaultdict(list)
    for s in samples:
        groups[(s.case, s.tp_size, s.cache)].append(s)
    firsts = [_one(key, runs, checkpoint_bytes) for key, runs in groups.items()]
    limits = {s.cache: s.wall_s for s in firsts if s.case == "limit" and s.runs}
    allocs = {s.cache: s.wall_s for s in firsts if s.case == "limit_alloc" and s.runs}
    by_key = {(s.case, s.tp_size, s.cache): s for s in firsts if s.runs}
    peers = [c.name for c in CASES.values() if c.kind == "peer"]
    return [
        replace(
            s,
            x_limit=s.wall_s / limits[s.cache] if s.runs and s.cache in limits else None,
            x_limit_alloc=s.wall_s / allocs[s.cache] if s.runs and s.cache in allocs else None,
            speedup={
                p: by_key[(p, s.tp_size, s.cache)].wall_s / s.wall_s
                for p in peers
                if s.runs and p != s.case and (p, s.tp_size, s.cache) in by_key
            },
        )
        for s in firsts
    ]


def _one(key: tuple[str, int, str], runs: list[CaseSample], ckpt_bytes: int) -> CaseSummary:
    case, tp, cache = key
    ok = [r for r in runs if r.error is None]

    def median(f: Callable[[CaseSample], float]) -> float:
        return statistics.median(f(r) for r in ok) if ok else float("nan")

    wall = median(lambda r: r.wall_s)
    shard = max((x.shard_bytes for r in ok for x in r.ranks), default=0)
    rss = int(median(lambda r: max(x.rss_peak_delta for x in r.ranks))) if ok else 0
    host_shard = max((x.host_shard_bytes for r in ok for x in r.ranks), default=0)
    return CaseSummary(
        case=case,
        kind=CASES[case].kind,
        tp_size=tp,
        cache=cache,
        runs=len(ok),
        failures=len(runs) - len(ok),
        wall_s=wall,
        wall_s_min=min((r.wall_s for r in ok), default=float("nan")),
        wall_s_max=max((r.wall_s for r in ok), default=float("nan")),
        gbps=ckpt_bytes / wall / 1e9 if ok else float("nan"),
        rank_seconds_max=median(lambda r: max(x.seconds for x in r.ranks)),
        rank_bytes_read=int(median(lambda r: max(x.bytes_read for x in r.ranks))) if ok else 0,
        read_amplification=median(lambda r: sum(x.bytes_read for x in r.ranks) / ckpt_bytes),
        rss_peak_delta=rss,
        shard_bytes=shard,
        rss_overhead=rss - host_shard,
        cached_before=median(lambda r: r.cached_before),
        effective=tuple(sorted({x.effective for r in ok for x in r.ranks if x.effective})),
        error=next((r.error for r in runs if r.error), None),
    )


def consistency(samples: Iterable[CaseSample]) -> list[str]:
    """Problems found comparing cases: every case must give each rank the same tensors
    (digest, count and bytes) in every repetition. Empty when all agree."""
    seen: dict[tuple[int, int], dict[tuple[Any, ...], list[str]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for s in samples:
        if s.error or CASES[s.case].kind == "limit":
            continue
        for r in s.ranks:
            seen[(s.tp_size, r.rank)][(r.digest, r.tensors, r.shard_bytes)].append(
                f"{s.case}#{s.repetition}/{s.cache}"
            )
    problems = []
    for (tp, rank), outcomes in sorted(seen.items()):
        if len(outcomes) > 1:
            detail = "; ".join(
                f"{', '.join(sorted(set(who)))} -> {key[1]} tensors, {key[2]} bytes, "
                f"digest {key[0]}"
                for key, who in outcomes.items()
            )
            problems.append(f"tp={tp} rank {rank}: cases disagree: {detail}")
    return problems


@dataclass(frozen=True)
class Target:
    """One of issue 5's targets and whether this run met it (None: not measured)."""

    name: str
    threshold: str
    measured: str
    met: bool | None
    note: str = ""


def targets(
    summaries: Sequence[CaseSummary],
    *,
    tp: int,
    load_breakdown: Mapping[str, Any] | None = None,
    amplification: Sequence[Mapping[str, Any]] | None = None,
) -> list[Target]:
    """Issue 5's targets for the rayload cases at TP size ``tp``."""
    by = {(s.case, s.tp_size, s.cache): s for s in summaries if s.runs}
    out: list[Target] = []

    def check(
        case: str,
        cache: str,
        name: str,
        threshold: str,
        value: Callable[[CaseSummary], float | None],
        ok: Callable[[float], bool],
        fmt: str,
        note: str = "",
    ) -> None:
        s = by.get((case, tp, cache))
        v = value(s) if s is not None else None
        if v is None:
            out.append(Target(name, threshold, "not measured", None))
        else:
            out.append(Target(name, threshold, fmt.format(v), ok(v), note))

    def ceiling(peer: str, cache: str) -> str:
        """How much faster than ``peer`` the fastest limit case ran in this run: about
        what a reader as fast as the disk (cold) or memory (warm) allows would gain."""
        limits = [s for (c, t, k), s in by.items() if k == cache and c in _LIMITS and t in (1, tp)]
        if (p := by.get((peer, tp, cache))) is None or not limits:
            return ""
        fastest = min(limits, key=lambda s: s.wall_s)
        return f"{fastest.case} ran {p.wall_s / fastest.wall_s:.2f}x faster than {peer}"

    def own_limit(case: str, cache: str) -> str:
        """What plain reads with ``case``'s parallelism took against the one-stream limit:
        when the disk serves parallel streams slower, so must the case."""
        name = _PARALLEL_LIMIT[case]
        s = next((by[key] for t in (tp, 1) if (key := (name, t, cache)) in by), None)
        return f"{name} took {s.x_limit:.2f}x limit" if s and s.x_limit else ""

    for case in ("scratch", "converted"):
        check(
            case,
            "cold",
            f"{case} cold vs limit",
            "<= 1.15x",
            lambda s: s.x_limit,
            lambda v: v <= 1.15,
            "{:.2f}x",
            own_limit(case, "cold"),
        )
        check(
            case,
            "warm",
            f"{case} warm vs limit",
            "<= 1.3x",
            lambda s: s.x_limit,
            lambda v: v <= 1.3,
            "{:.2f}x",
        )
        check(
            case,
            "cold",
            f"{case} cold vs safe_open_slice",
            ">= 1.5x faster",
            lambda s: s.speedup.get("safe_open_slice"),
            lambda v: v >= 1.5,
            "{:.2f}x",
            ceiling("safe_open_slice", "cold"),
        )
        check(
            case,
            "cold",
            f"{case} cold vs fastsafetensors_whole",
            ">= 4x faster",
            lambda s: s.speedup.get("fastsafetensors_whole"),
            lambda v: v >= 4,
            "{:.2f}x",
            ceiling("fastsafetensors_whole", "cold"),
        )
        for cache in ("cold", "warm"):
            check(
                case,
                cache,
                f"{case} {cache} peak RSS per rank",
                "<= shard + 256 MB",
                lambda s: s.rss_overhead / MB,
                lambda v: v <= 256,
                "shard + {:.0f} MB",
            )
    check(
        "scratch_model",
        "warm",
        "scratch_model warm peak RSS per rank (model= filled in place)",
        "<= shard + 64 MB",
        lambda s: s.rss_overhead / MB,
        lambda v: v <= 64,
        "shard + {:.0f} MB",
    )
    for row in amplification or []:
        if row["case"] not in ("scratch", "converted"):
            continue
        name = f"{row['case']} read amplification, {row['kind']} (tp={row['tp_size']})"
        value = row["amplification"]
        if row["kind"] == "split 1":
            measured = "failed" if value is None else f"{value:.3f}"
            out.append(Target(name, "documented, no target", measured, None))
        elif value is None:
            out.append(Target(name, "<= 1.05", "failed", False, str(row["error"])))
        else:
            out.append(Target(name, "<= 1.05", f"{value:.3f}", value <= 1.05))
    out.extend(_tracing_targets(load_breakdown))
    return out


def _tracing_targets(load_breakdown: Mapping[str, Any] | None) -> list[Target]:
    """Tracing overhead judged on the timed tracing work (the critical path of span
    recording, merge, trace files and OTLP encoding) as a share of the whole
    ``rayload.load``; the with/without trace files difference is kept as a cross-check."""
    name = "tracing overhead on rayload.load"
    if load_breakdown is None:
        return [Target(name, "<= 3%", "not measured", None)]
    pct = load_breakdown["trace_overhead_pct"]
    lo, hi = load_breakdown["wall_s_spread_without"]
    noise = 100 * (hi - lo) / load_breakdown["without_trace_files"]["wall_s"]
    cross_check = Target(
        "trace files on vs off, whole rayload.load (cross-check)",
        "documented, no target",
        f"{pct:+.1f}%",
        None,
        f"run-to-run spread without trace files: {noise:.0f}%",
    )
    tracing = load_breakdown.get("tracing")
    if tracing is None:
        return [Target(name, "<= 3%", "not measured", None), cross_check]
    share = tracing["pct_of_load"]
    timed = Target(
        name,
        "<= 3%",
        f"{share:.2f}% ({1000 * tracing['critical_path_s']:.1f} ms timed)",
        share <= 3,
        f"{tracing['pct_of_model_loading']:.1f}% of the ranks' model loading time",
    )
    return [timed, cross_check]


def to_jsonable(items: Iterable[Any]) -> list[Mapping[str, Any]]:
    return [asdict(i) for i in items]
