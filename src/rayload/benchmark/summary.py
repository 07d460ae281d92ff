"""From samples to figures: medians per case, ratios to the limit and to the peers (the
targets they are judged by: :mod:`rayload.benchmark.targets`).

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
MOE_CASES = ("scratch", "scratch_ep", "whole_experts")
"""The cases compared on a mixture-of-experts checkpoint: plain TP, expert parallel and
every rank reading every expert whole."""


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


def to_jsonable(items: Iterable[Any]) -> list[Mapping[str, Any]]:
    return [asdict(i) for i in items]
