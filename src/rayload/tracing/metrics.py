"""Startup metrics: what each rank spent its start-up on, the aggregate over ranks, the
CLI's rank x phase table and Ray gauges.

Keys (docs/design.md, seconds unless named otherwise; ``draft_``-prefixed for a draft model)::

    total_model_loading_seconds     RankReport.start_ns (config parsing) to its end_ns
    checkpoint_preparation_seconds  rank.resolve + rank.plan
    weight_population_seconds       rank.read + rank.to_device + rank.sync
    post_load_processing_seconds    rank.post_load
    actor_startup_seconds           driver-measured actor launch to ready (rayload.spawn)
    placement_seconds               placement group ready; driver-wide, same for every rank
    bytes_read                      bytes read from the checkpoint's files
    read_gbps                       bytes_read / rank.read seconds, in GB/s (1e9 bytes)
    bytes_from_storage              bytes read from the checkpoint's files (= bytes_read)
    bytes_from_peers                bytes copied from a rank of another replica (peer)

Shape of :func:`startup_metrics`::

    {"model_role": "main", "method": "scratch", "slowest_rank": 1,
     "aggregate": {KEY: {"max", "mean", "min", "slowest_rank", "method"}, ...,
                   "read_gbps": {..., "total"}, "bytes_*": {..., "total"}},
     "ranks": [{"rank", "node_id", "method", "fallback_reason", "peer_switch", KEY: value,
                "phases": {"rank.read": seconds, ...}}, ...]}

``method`` is the effective load method: per rank, and on every aggregate figure (the
distinct methods joined by "," when ranks differ). ``slowest_rank`` of a figure is the
rank with the worst value: the largest, except for ``read_gbps`` where it is the smallest;
None for ``placement_seconds``, which no rank owns, and for ``bytes_read``, where more is
not worse (nor for the other byte figures). ``read_gbps``'s aggregate also has ``total``:
the bytes of all ranks over the longest ``weight_population_seconds`` (the load's own
throughput); each byte figure's (``bytes_read``, ``bytes_from_storage``,
``bytes_from_peers``) has ``total``: the sum over the ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from statistics import fmean
from typing import Any

from rayload.loading import report as phases
from rayload.loading.report import (
    PHASES,
    PLAN,
    READ,
    RESOLVE,
    SYNC,
    TO_DEVICE,
    RankReport,
)

logger = logging.getLogger(__name__)

TOTAL = "total_model_loading_seconds"
PREPARATION = "checkpoint_preparation_seconds"
POPULATION = "weight_population_seconds"
POST_LOAD = "post_load_processing_seconds"
ACTOR_STARTUP = "actor_startup_seconds"
PLACEMENT = "placement_seconds"
BYTES_READ = "bytes_read"
READ_GBPS = "read_gbps"
BYTES_FROM_STORAGE = "bytes_from_storage"
BYTES_FROM_PEERS = "bytes_from_peers"
METRIC_KEYS = (
    TOTAL,
    PREPARATION,
    POPULATION,
    POST_LOAD,
    ACTOR_STARTUP,
    PLACEMENT,
    BYTES_READ,
    READ_GBPS,
    BYTES_FROM_STORAGE,
    BYTES_FROM_PEERS,
)

_PREPARATION_PHASES = (RESOLVE, PLAN)
_POPULATION_PHASES = (READ, TO_DEVICE, SYNC)
_LOWER_IS_WORSE = frozenset({READ_GBPS})
_BYTES = frozenset({BYTES_READ, BYTES_FROM_STORAGE, BYTES_FROM_PEERS})
"""Byte counts: integer means, and a ``total`` over the ranks in the aggregate."""
_NO_SLOWEST = frozenset({PLACEMENT}) | _BYTES
"""Figures where no rank is "slowest": driver-wide, or where more is not worse."""


def metric_key(key: str, model_role: str = "main") -> str:
    """``key`` as reported for ``model_role``: ``draft_`` + key for a draft model."""
    return f"draft_{key}" if model_role == "draft" else key


def startup_metrics(
    reports: Sequence[RankReport],
    *,
    placement_seconds: float,
    actor_startup_seconds: Mapping[int, float],
    model_role: str = "main",
) -> dict[str, Any]:
    """Per-rank and aggregated startup metrics (shape in the module docstring).

    ``actor_startup_seconds`` is keyed by rank (``replica * tp_size + rank`` in a load of
    several replicas). A rank missing from it reports None there and is left out of
    that figure's aggregate. Raises ValueError for no reports.
    """
    if not reports:
        raise ValueError("startup_metrics needs the report of at least one rank")
    ranks = [
        _rank_metrics(
            report,
            placement_seconds,
            actor_startup_seconds.get(report.replica * report.tp_size + report.rank),
            model_role,
        )
        for report in sorted(reports, key=lambda r: (r.replica, r.rank))
    ]
    method = _joined_methods(ranks)
    aggregate = {
        metric_key(key, model_role): _aggregate(ranks, metric_key(key, model_role), key, method)
        for key in METRIC_KEYS
    }
    aggregate[metric_key(READ_GBPS, model_role)]["total"] = _total_gbps(ranks, model_role)
    for key in _BYTES:
        name = metric_key(key, model_role)
        aggregate[name]["total"] = sum(r[name] for r in ranks)
    return {
        "model_role": model_role,
        "method": method,
        "slowest_rank": aggregate[metric_key(TOTAL, model_role)]["slowest_rank"],
        "aggregate": aggregate,
        "ranks": ranks,
    }


def _rank_metrics(
    report: RankReport, placement: float, actor_startup: float | None, model_role: str
) -> dict[str, Any]:
    read_seconds = report.phase_seconds(READ)
    values: dict[str, Any] = {
        TOTAL: _seconds(report.seconds),
        PREPARATION: _seconds(sum(report.phase_seconds(p) for p in _PREPARATION_PHASES)),
        POPULATION: _seconds(sum(report.phase_seconds(p) for p in _POPULATION_PHASES)),
        POST_LOAD: _seconds(report.phase_seconds(phases.POST_LOAD)),
        ACTOR_STARTUP: None if actor_startup is None else _seconds(actor_startup),
        PLACEMENT: _seconds(placement),
        BYTES_READ: report.bytes_read,
        READ_GBPS: round(report.bytes_read / 1e9 / read_seconds, 3) if read_seconds > 0 else 0.0,
        BYTES_FROM_STORAGE: report.bytes_from_storage,
        BYTES_FROM_PEERS: report.bytes_from_peers,
    }
    return {
        "rank": report.rank,
        "replica": report.replica,
        "node_id": report.node_id,
        "method": report.method.effective.value,
        "fallback_reason": report.method.fallback_reason,
        "peer_switch": report.peer_switch,
        **{metric_key(key, model_role): value for key, value in values.items()},
        "phases": {name: _seconds(report.phase_seconds(name)) for name in PHASES},
    }


def _aggregate(ranks: list[dict[str, Any]], key: str, base_key: str, method: str) -> dict[str, Any]:
    present = [(r["rank"], r[key]) for r in ranks if r[key] is not None]
    if not present:
        return {"max": None, "mean": None, "min": None, "slowest_rank": None, "method": method}
    values = [value for _, value in present]
    pick = min if base_key in _LOWER_IS_WORSE else max
    slowest = pick(present, key=lambda item: item[1])[0]
    mean = fmean(values)
    return {
        "max": max(values),
        "mean": round(mean) if base_key in _BYTES else round(mean, 6),
        "min": min(values),
        "slowest_rank": None if base_key in _NO_SLOWEST else slowest,
        "method": method,
    }


def _total_gbps(ranks: list[dict[str, Any]], model_role: str) -> float:
    """The load's own throughput: every rank's bytes over the longest weight population
    (the ranks read in parallel, so the slowest one bounds the whole read)."""
    total_bytes = sum(r[metric_key(BYTES_READ, model_role)] for r in ranks)
    longest = max(r[metric_key(POPULATION, model_role)] for r in ranks)
    return round(total_bytes / 1e9 / longest, 3) if longest > 0 else 0.0


def _joined_methods(ranks: list[dict[str, Any]]) -> str:
    return ",".join(sorted({r["method"] for r in ranks}))


def _seconds(value: float) -> float:
    return round(value, 6)


_PHASE_COLUMNS = tuple(name.removeprefix("rank.") for name in PHASES)


def _slowest_entry(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """The per-rank entry the table marks: of the ranks numbered ``slowest_rank`` (one per
    replica), the one with the longest total."""
    total = metric_key(TOTAL, metrics["model_role"])
    candidates = [r for r in metrics["ranks"] if r["rank"] == metrics["slowest_rank"]]
    return max(candidates, key=lambda r: r[total] or 0.0, default=None)


def format_metrics_table(metrics: dict[str, Any]) -> str:
    """A fixed-width rank x phase table of :func:`startup_metrics` output, in seconds.

    The slowest rank is marked ``*``; ``GB`` are read from storage, ``peer_GB`` copied from
    other replicas; placement and any fallback follow the table.
    """
    role = metrics["model_role"]
    header = ["rank", "method", "actor", *_PHASE_COLUMNS, "total", "GB", "peer_GB", "GB/s"]
    rows: list[list[str]] = []
    several = any(rank.get("replica") for rank in metrics["ranks"])
    slowest = _slowest_entry(metrics)
    for rank in metrics["ranks"]:
        marker = "*" if rank is slowest else ""
        who = f"{rank.get('replica', 0)}/{rank['rank']}" if several else str(rank["rank"])
        rows.append(
            [
                f"{who}{marker}",
                rank["method"],
                _num(rank[metric_key(ACTOR_STARTUP, role)]),
                *(_num(rank["phases"][name]) for name in PHASES),
                _num(rank[metric_key(TOTAL, role)]),
                _num(rank[metric_key(BYTES_FROM_STORAGE, role)] / 1e9),
                _num(rank[metric_key(BYTES_FROM_PEERS, role)] / 1e9),
                _num(rank[metric_key(READ_GBPS, role)]),
            ]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.rjust(w) if i > 1 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = metrics["aggregate"][metric_key(TOTAL, role)]
    lines.append("")
    placement = metrics["aggregate"][metric_key(PLACEMENT, role)]["max"]
    lines.append(
        f"{'draft ' if role == 'draft' else ''}placement {_num(placement)} s"
        f" · total max {_num(total['max'])} s, mean {_num(total['mean'])} s"
        f" · slowest rank {metrics['slowest_rank']} (*)"
    )
    for rank in metrics["ranks"]:
        if rank["fallback_reason"]:
            lines.append(f"rank {rank['rank']} fell back: {rank['fallback_reason']}")
        elif rank["peer_switch"]:
            lines.append(f"rank {rank['rank']} switched peers: {rank['peer_switch']}")
    return "\n".join(lines)


def publish_ray_metrics(metrics: dict[str, Any]) -> None:
    """Publish every per-rank figure as a ``ray.util.metrics.Gauge`` (Ray's Prometheus
    endpoint and dashboard), tagged ``rank``, ``method``, ``model_role`` and, for the
    per-phase gauge ``rayload_phase_seconds``, ``phase``.

    Gauges are named ``rayload_<key>`` (``rayload_draft_<key>`` for a draft model);
    ``placement_seconds`` is published once, with rank ``driver``. Without an initialized
    Ray this does nothing (debug log).
    """
    try:
        import ray
        from ray.util.metrics import Gauge
    except ImportError:
        logger.debug("Ray is not installed; startup metrics are not published")
        return
    if not ray.is_initialized():
        logger.debug("Ray is not initialized; startup metrics are not published")
        return
    role = metrics["model_role"]
    for rank in metrics["ranks"]:
        tags = {"rank": str(rank["rank"]), "method": rank["method"], "model_role": role}
        for base in METRIC_KEYS:
            name = metric_key(base, role)
            if base == PLACEMENT or rank[name] is None:
                continue
            _gauge(Gauge, f"rayload_{name}", "rayload startup metric " + name).set(
                float(rank[name]), tags=tags
            )
        phase_gauge = _gauge(Gauge, "rayload_phase_seconds", "seconds a rank spent in a phase")
        for phase, seconds in rank["phases"].items():
            phase_gauge.set(float(seconds), tags={**tags, "phase": phase})
    placement = metric_key(PLACEMENT, role)
    _gauge(Gauge, f"rayload_{placement}", "rayload startup metric " + placement).set(
        float(metrics["aggregate"][placement]["max"]),
        tags={"rank": "driver", "method": metrics["method"], "model_role": role},
    )


_TAG_KEYS = ("rank", "method", "model_role")
_gauges: dict[str, Any] = {}


def _gauge(gauge_type: Any, name: str, description: str) -> Any:
    """One Gauge per name per process (Ray registers each on creation)."""
    if name not in _gauges:
        tag_keys = (*_TAG_KEYS, "phase") if name == "rayload_phase_seconds" else _TAG_KEYS
        _gauges[name] = gauge_type(name, description=description, tag_keys=tag_keys)
    return _gauges[name]


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}"
