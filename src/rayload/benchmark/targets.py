"""The targets a benchmark run is judged by: each a :class:`Bound` (one value, written in the
report and checked against the measured figure) and a :class:`Target` row per figure.

Rows whose threshold reads "documented, no target" are figures kept beside the targets for
the reader (cross-checks, comparisons without a goal); their ``met`` is None.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rayload.benchmark.cases import CASES
from rayload.benchmark.layouts import EP, TP, WHOLE_EXPERTS, LayoutPlan
from rayload.benchmark.summary import MB, CaseSummary

_LIMITS = frozenset(name for name, case in CASES.items() if case.kind == "limit")
_PARALLEL_LIMIT = {"scratch": "limit_parallel", "converted": "limit_rank_files"}
"""The limit case that reads with the parallelism of each rayload reader: every CPU on
the original files, or each rank process on its own converted files."""


@dataclass(frozen=True)
class Bound:
    """A target's threshold: one value, used both to write the target and to check it.

    ``unit`` places the value in the label (``"{}x"`` reads ``<= 1.15x``)."""

    value: float
    at_most: bool = True
    unit: str = "{}"

    @property
    def label(self) -> str:
        return f"{'<=' if self.at_most else '>='} {self.unit.format(f'{self.value:g}')}"

    def met(self, measured: float) -> bool:
        return measured <= self.value if self.at_most else measured >= self.value


COLD_VS_LIMIT = Bound(1.15, unit="{}x")
WARM_VS_LIMIT = Bound(1.3, unit="{}x")
FASTER_THAN_SAFE_OPEN = Bound(1.5, at_most=False, unit="{}x faster")
FASTER_THAN_FASTSAFETENSORS_WHOLE = Bound(4, at_most=False, unit="{}x faster")
RSS_OVER_SHARD_MB = Bound(256, unit="shard + {} MB")
MODEL_RSS_OVER_SHARD_MB = Bound(64, unit="shard + {} MB")
READ_AMPLIFICATION = Bound(1.05)
TRACING_SHARE_PCT = Bound(3, unit="{}%")
SPAWN_VS_FLOOR = Bound(1.2, unit="{}x floor")
RELOAD_VS_POPULATION = Bound(1.2, unit="{}x fresh weight population")
RELOAD_VS_CLOSE_AND_LOAD = Bound(3, at_most=False, unit="{}x faster")


@dataclass(frozen=True)
class Target:
    """One benchmark target and whether this run met it (None: not measured, or a figure
    documented without a target)."""

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
    layouts: Sequence[LayoutPlan] = (),
) -> list[Target]:
    """The targets for the rayload cases at TP size ``tp``. A case that did not run at
    ``tp`` in that cache state has no rows; one that ran and failed reads "not measured"."""
    by = {(s.case, s.tp_size, s.cache): s for s in summaries if s.runs}
    ran = {(s.case, s.tp_size, s.cache) for s in summaries}
    out: list[Target] = []

    def check(
        case: str,
        cache: str,
        name: str,
        bound: Bound,
        value: Callable[[CaseSummary], float | None],
        fmt: str,
        note: str = "",
    ) -> None:
        if (case, tp, cache) not in ran:
            return
        s = by.get((case, tp, cache))
        v = value(s) if s is not None else None
        if v is None:
            out.append(Target(name, bound.label, "not measured", None))
        else:
            out.append(Target(name, bound.label, fmt.format(v), bound.met(v), note))

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
            COLD_VS_LIMIT,
            lambda s: s.x_limit,
            "{:.2f}x",
            own_limit(case, "cold"),
        )
        check(case, "warm", f"{case} warm vs limit", WARM_VS_LIMIT, lambda s: s.x_limit, "{:.2f}x")
        check(
            case,
            "cold",
            f"{case} cold vs safe_open_slice",
            FASTER_THAN_SAFE_OPEN,
            lambda s: s.speedup.get("safe_open_slice"),
            "{:.2f}x",
            ceiling("safe_open_slice", "cold"),
        )
        check(
            case,
            "cold",
            f"{case} cold vs fastsafetensors_whole",
            FASTER_THAN_FASTSAFETENSORS_WHOLE,
            lambda s: s.speedup.get("fastsafetensors_whole"),
            "{:.2f}x",
            ceiling("fastsafetensors_whole", "cold"),
        )
        for cache in ("cold", "warm"):
            check(
                case,
                cache,
                f"{case} {cache} peak RSS per rank",
                RSS_OVER_SHARD_MB,
                lambda s: s.rss_overhead / MB,
                "shard + {:.0f} MB",
            )
    check(
        "scratch_model",
        "warm",
        "scratch_model warm peak RSS per rank (model= filled in place)",
        MODEL_RSS_OVER_SHARD_MB,
        lambda s: s.rss_overhead / MB,
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
            out.append(Target(name, READ_AMPLIFICATION.label, "failed", False, str(row["error"])))
        else:
            out.append(
                Target(
                    name, READ_AMPLIFICATION.label, f"{value:.3f}", READ_AMPLIFICATION.met(value)
                )
            )
    out.extend(_expert_targets(by, tp, layouts))
    out.extend(_tracing_targets(load_breakdown))
    out.extend(start_up_targets((load_breakdown or {}).get("start_up")))
    return out


def _expert_targets(
    by: Mapping[tuple[str, int, str], CaseSummary], tp: int, layouts: Sequence[LayoutPlan]
) -> list[Target]:
    """Expert parallel (``scratch_ep``) at ``tp`` against plain TP (``scratch``) and every
    rank reading every expert whole (``whole_experts``): the experts each EP rank holds by
    the plan, then the bytes each rank read (first cache state: bytes do not depend on it)
    and the wall times measured. Empty when ``scratch_ep`` did not run at ``tp``."""
    plans = {p.layout: p for p in layouts if p.tp_size == tp}
    caches = [c for c in ("cold", "warm") if ("scratch_ep", tp, c) in by]
    if not caches or EP not in plans:
        return []
    ep = plans[EP]
    out = [
        Target(
            f"scratch_ep expert bytes per rank (plan, tp={tp})",
            f"= all experts' / {tp}",
            f"1/{ep.all_expert_bytes / max(ep.expert_bytes):.2f} "
            f"({max(ep.expert_bytes) / MB:.1f} of {ep.all_expert_bytes / MB:.1f} MB)",
            all(e * tp == ep.all_expert_bytes for e in ep.expert_bytes),
            "experts by rank: " + ", ".join(f"{r[0]}-{r[-1]}" for r in ep.experts),
        )
    ]
    cache = caches[0]
    mine = by[("scratch_ep", tp, cache)]
    amplification = mine.rank_bytes_read / mine.shard_bytes
    out.append(
        Target(
            f"scratch_ep {cache} bytes read per rank / its shard",
            READ_AMPLIFICATION.label,
            f"{amplification:.3f}",
            READ_AMPLIFICATION.met(amplification),
            f"{mine.rank_bytes_read / MB:.0f} MB read, shard {mine.shard_bytes / MB:.0f} MB",
        )
    )
    others = (("whole_experts", WHOLE_EXPERTS), ("scratch", TP))
    for other, layout in others:
        if (o := by.get((other, tp, cache))) is not None:
            planned = plans[layout].rank_bytes[0] / ep.rank_bytes[0]
            out.append(
                Target(
                    f"{other} / scratch_ep {cache} bytes read per rank",
                    "documented, no target",
                    f"{o.rank_bytes_read / mine.rank_bytes_read:.2f}x",
                    None,
                    f"their plans' shards: {planned:.2f}x",
                )
            )
    for cache in caches:
        mine = by[("scratch_ep", tp, cache)]
        for other, _ in others:
            if (o := by.get((other, tp, cache))) is not None:
                out.append(
                    Target(
                        f"scratch_ep {cache} vs {other}",
                        "documented, no target",
                        f"{o.wall_s / mine.wall_s:.2f}x faster",
                        None,
                        f"{mine.wall_s:.3f} s against {o.wall_s:.3f} s",
                    )
                )
    return out


def _tracing_targets(load_breakdown: Mapping[str, Any] | None) -> list[Target]:
    """Tracing overhead judged on the timed tracing work (the critical path of span
    recording, merge, trace files and OTLP encoding) as a share of the whole
    ``rayload.load``; the with/without trace files difference is kept as a cross-check."""
    name = "tracing overhead on rayload.load"
    if load_breakdown is None:
        return [Target(name, TRACING_SHARE_PCT.label, "not measured", None)]
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
        return [Target(name, TRACING_SHARE_PCT.label, "not measured", None), cross_check]
    share = tracing["pct_of_load"]
    timed = Target(
        name,
        TRACING_SHARE_PCT.label,
        f"{share:.2f}% ({1000 * tracing['critical_path_s']:.1f} ms timed)",
        TRACING_SHARE_PCT.met(share),
        f"{tracing['pct_of_model_loading']:.1f}% of the ranks' model loading time",
    )
    return [timed, cross_check]


def ray_floor_ratios(runs: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each repetition's two rayload spawns (the fresh load, and the load after close)
    against the floor measured just before them in that repetition."""
    return [
        r[key] / r["ray_floor_s"]
        for r in runs
        if r.get("ray_floor_s")
        for key in ("spawn_s", "second_spawn_s")
        if key in r
    ]


def start_up_targets(start_up: Mapping[str, Any] | None) -> list[Target]:
    """rayload's spawn against Ray's floor (Ray actors that only import torch and rayload,
    in a placement group made as rayload makes one: ``ray_floor_s``,
    :mod:`rayload.benchmark.startfloor`), and ``reload()`` against a fresh load's weight
    population and against close + fresh load; empty when not measured."""
    if not start_up:
        return []
    m, spawn = start_up["medians"], start_up["rayload_spawn_s"]
    reload, population = m["reload_wall_s"], m["fresh_population_s"]
    ratios = ray_floor_ratios(start_up["runs"])
    measured = statistics.median(ratios) if ratios else spawn / m["ray_floor_s"]
    return [
        Target(
            f"rayload spawn vs Ray's floor (tp={start_up['tp_size']}: actors importing torch "
            "+ rayload)",
            SPAWN_VS_FLOOR.label,
            f"{measured:.2f}x",
            SPAWN_VS_FLOOR.met(measured),
            "median of each repetition's two loads against that repetition's floor ("
            + ", ".join(f"{r:.2f}x" for r in ratios)
            + f"); medians over the run: {spawn:.2f} s ({start_up['rayload_spawns']} "
            f"loads) against {m['ray_floor_s']:.2f} s",
        ),
        Target(
            "reload vs a fresh load's weight population",
            RELOAD_VS_POPULATION.label,
            f"{reload / population:.2f}x",
            RELOAD_VS_POPULATION.met(reload / population),
            f"reload() {reload:.3f} s, fresh weight population {population:.3f} s",
        ),
        Target(
            "reload vs close + fresh load",
            RELOAD_VS_CLOSE_AND_LOAD.label,
            f"{m['close_and_fresh_s'] / reload:.1f}x faster",
            RELOAD_VS_CLOSE_AND_LOAD.met(m["close_and_fresh_s"] / reload),
            f"close + rayload.load {m['close_and_fresh_s']:.2f} s",
        ),
    ]
