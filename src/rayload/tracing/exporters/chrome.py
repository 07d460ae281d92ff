"""``trace.chrome.json``: the Chrome trace event format, for Perfetto and chrome://tracing.

One process (``pid``) for the driver and one per rank, named by ``M`` metadata events
("rank 0 (node ...)"); one thread (``tid``) per lane of :mod:`.timeline`, so the ``X``
complete events on a thread always nest. Times are microseconds from the trace's start
(``otherData.start_unix_ns``); span events (exceptions) are thread-scoped instants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

from rayload.tracing.exporters.timeline import Placed, Process, group_processes


def to_chrome_trace(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """The ``{"traceEvents": [...]}`` document of ``spans``."""
    starts = [s.start_time for s in spans if s.start_time is not None]
    origin = min(starts) if starts else 0
    events: list[dict[str, Any]] = []
    for pid, process in enumerate(group_processes(spans), start=1):
        events.extend(_metadata(pid, process))
        for placed in process.spans:
            events.extend(_span_events(pid, placed, origin))
    trace_ids = sorted({f"{s.context.trace_id:032x}" for s in spans if s.context is not None})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"trace_id": ",".join(trace_ids), "start_unix_ns": origin},
    }


def _metadata(pid: int, process: Process) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process.label}},
        {
            "name": "process_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"sort_index": pid},
        },
    ]
    for lane in sorted({p.lane for p in process.spans}):
        name = "spans" if lane == 0 else f"concurrent {lane}"
        events.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": lane, "args": {"name": name}}
        )
    return events


def _span_events(pid: int, placed: Placed, origin: int) -> list[dict[str, Any]]:
    span = placed.span
    args: dict[str, Any] = dict(span.attributes or {})
    if span.context is not None:
        args["span_id"] = f"{span.context.span_id:016x}"
    if span.parent is not None:
        args["parent_span_id"] = f"{span.parent.span_id:016x}"
    args["status"] = span.status.status_code.name
    if span.status.description:
        args["error"] = span.status.description
    events = [
        {
            "name": span.name,
            "cat": "rank" if span.name.startswith("rank.") else "driver",
            "ph": "X",
            "ts": (placed.start_ns - origin) / 1000,
            "dur": (placed.end_ns - placed.start_ns) / 1000,
            "pid": pid,
            "tid": placed.lane,
            "args": args,
        }
    ]
    for event in span.events:
        events.append(
            {
                "name": event.name,
                "cat": "event",
                "ph": "i",
                "s": "t",
                "ts": (event.timestamp - origin) / 1000,
                "pid": pid,
                "tid": placed.lane,
                "args": dict(event.attributes or {}),
            }
        )
    return events
