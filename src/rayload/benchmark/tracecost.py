"""The cost of rayload's tracing, timed directly on a real load's rank reports.

Comparing whole ``rayload.load`` calls with and without trace files cannot resolve a few
percent where actor start varies far more between calls (docs/benchmarks.md). So this
replays the tracing work of one load on that load's own
:class:`~rayload.loading.report.RankReport` s, in the benchmark's driver process, and
times each step on its own:

``rank_payload_s``  one rank: its phases -> OTLP protobuf bytes (``rank_spans_payload``),
                    done in every rank actor after its load, in parallel: the critical
                    path pays the slowest rank's (``rank_payload_max_s``)
``merge_s``         driver: a :class:`~rayload.tracing.trace.StartupTrace` with the driver
                    spans (prepare, connect, placement, one spawn per rank), decoding and
                    clock-correcting every rank's payload, ``finish``
``files_s``         driver: ``write_trace_files`` (OTLP JSON, Jaeger, Chrome, HTML)
``otlp_encode_s``   driver: the OTLP protobuf an exporter would send (no network)

``critical_path_s = rank_payload_max_s + merge_s + files_s + otlp_encode_s``: what
tracing adds to the wall time of a load that writes every trace file and exports. Each
step is the median of ``repeat`` replays.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan

from rayload.loading.report import RankReport
from rayload.tracing import metrics, schema
from rayload.tracing.exporters.files import write_trace_files
from rayload.tracing.rank_spans import rank_spans_payload, report_attributes
from rayload.tracing.trace import StartupTrace

_T = TypeVar("_T")

STEPS = ("rank_payload_max_s", "merge_s", "files_s", "otlp_encode_s")


def tracing_cost(reports: Sequence[RankReport], *, repeat: int = 5) -> dict[str, float]:
    """Time the tracing work of one load whose ranks reported ``reports`` (medians of
    ``repeat`` replays, seconds); see the module docstring for the steps."""
    if not reports:
        raise ValueError("tracing_cost needs the rank reports of a load")
    runs = [_replay(reports) for _ in range(repeat)]
    cost = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    cost["critical_path_s"] = sum(cost[k] for k in STEPS)
    return cost


def _replay(reports: Sequence[RankReport]) -> dict[str, float]:
    tp = len(reports)
    start_ns = min(r.start_ns for r in reports)
    trace, merge_s = _timed(lambda: _driver_trace(tp, start_ns))
    payloads: list[bytes] = []
    per_rank: list[float] = []
    traceparent = trace.traceparent()
    for report in reports:
        start = time.perf_counter()
        payloads.append(_rank_payload(traceparent, report, tp))
        per_rank.append(time.perf_counter() - start)

    def merge() -> list[ReadableSpan]:
        for payload in payloads:
            trace.add_rank(payload, 0, None)
        return trace.finish()

    spans, seconds = _timed(merge)
    with tempfile.TemporaryDirectory(prefix="rayload-bench-tracecost-") as tmp:
        _, files_s = _timed(lambda: write_trace_files(spans, tmp))
    _, encode_s = _timed(lambda: encode_spans(spans).SerializeToString())
    return {
        "rank_payload_s": statistics.median(per_rank),
        "rank_payload_max_s": max(per_rank),
        "merge_s": merge_s + seconds,
        "files_s": files_s,
        "otlp_encode_s": encode_s,
        "spans": float(len(spans)),
    }


def _driver_trace(tp: int, start_ns: int) -> StartupTrace:
    """A startup trace holding the driver spans a real load records."""
    trace = StartupTrace(tp_size=tp, start_ns=start_ns)
    now = time.time_ns()
    trace.add_span(schema.PREPARE_SPAN, start_ns, now, {"tp_size": tp})
    trace.add_span(schema.CONNECT_SPAN, start_ns, now, {"ray.started": False})
    trace.add_span(schema.PLACEMENT_SPAN, start_ns, now, {"strategy": "PACK", "bundles": tp})
    for rank in range(tp):
        trace.add_span(
            schema.SPAWN_SPAN,
            start_ns,
            now,
            {"rank": rank, "node_id": "0" * 56, "pid": 1000 + rank, "gpu_ids": ""},
        )
    return trace


def _rank_payload(traceparent: str, report: RankReport, tp: int) -> bytes:
    return rank_spans_payload(
        traceparent=traceparent,
        rank=report.rank,
        tp_size=tp,
        start_ns=report.start_ns,
        end_ns=report.end_ns,
        phases=report.phases,
        attributes=report_attributes(report),
    )


def _timed(fn: Callable[[], _T]) -> tuple[_T, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def cost_fractions(cost: dict[str, float], run: dict[str, Any]) -> dict[str, float]:
    """The critical path of ``cost`` as a percentage of one load's whole wall time and
    of its ranks' total model loading time (the slowest rank's)."""
    path = cost["critical_path_s"]
    return {
        "pct_of_load": 100 * path / run["wall_s"],
        "pct_of_model_loading": 100 * path / run[metrics.TOTAL],
    }
