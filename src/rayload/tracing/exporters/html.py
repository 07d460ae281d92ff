"""``trace.html``: a self-contained timeline of the startup trace, one lane per process.

The driver's lane comes first, then one per rank; phases are coloured (with a legend),
the slowest rank is highlighted, and any fallback or error is written out on its lane.
Hovering a bar shows its attributes. The page embeds its data and fetches nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from rayload.loading.report import PLAN, POST_LOAD, READ, RESOLVE, SYNC, TO_DEVICE
from rayload.tracing import schema
from rayload.tracing.exporters.html_template import DATA_TOKEN, TEMPLATE
from rayload.tracing.exporters.timeline import Process, group_processes

# Okabe-Ito colours for the phases (distinguishable with colour-blindness), greys for
# the enclosing spans.
COLORS: dict[str, str] = {
    schema.ROOT_SPAN: "#9aa5b1",
    schema.RELOAD_ROOT_SPAN: "#9aa5b1",
    schema.PREPARE_SPAN: "#b8a9c9",
    schema.CONNECT_SPAN: "#8fb9a8",
    schema.PLACEMENT_SPAN: "#f0e442",
    schema.SPAWN_SPAN: "#cbd2d9",
    schema.RANK_SPAN: "#d9dde2",
    RESOLVE: "#e69f00",
    PLAN: "#56b4e9",
    READ: "#009e73",
    TO_DEVICE: "#0072b2",
    SYNC: "#cc79a7",
    POST_LOAD: "#d55e00",
}
_OTHER_COLOR = "#7b8794"
_LIGHT_TEXT = {"#009e73", "#0072b2", "#d55e00"}


def render_html(spans: Sequence[ReadableSpan]) -> str:
    """The complete ``trace.html`` page for ``spans``."""
    blob = json.dumps(timeline_data(spans), separators=(",", ":"))
    # "<" never appears raw inside the <script> element, so "</script>" cannot end it.
    return TEMPLATE.replace(DATA_TOKEN, blob.replace("<", "\\u003c"))


def timeline_data(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """What the page draws, as plain JSON-ready data (times in ms from the trace start)."""
    starts = [s.start_time for s in spans if s.start_time is not None]
    ends = [s.end_time for s in spans if s.end_time is not None]
    origin = min(starts) if starts else 0
    processes = group_processes(spans)
    slowest = _slowest(processes)
    lanes = [_lane(p, origin, slowest is not None and p.rank == slowest[0]) for p in processes]
    names = {s.name for s in spans}
    trace_ids = sorted({f"{s.context.trace_id:032x}" for s in spans if s.context is not None})
    return {
        "traceId": ", ".join(trace_ids),
        "tpSize": len([p for p in processes if p.rank is not None]),
        "startUnixNs": origin,
        "durationMs": ((max(ends) if ends else origin) - origin) / 1e6,
        "slowest": None if slowest is None else {"rank": slowest[0], "ms": slowest[1] / 1e6},
        "fallbacks": sum(1 for lane in lanes if lane["fallback"]),
        "errors": sum(1 for lane in lanes if lane["error"]),
        "legend": [
            {"name": name, "color": color} for name, color in COLORS.items() if name in names
        ],
        "lanes": lanes,
    }


def _slowest(processes: list[Process]) -> tuple[int, int] | None:
    """``(rank, duration_ns)`` of the rank whose ``rank.load`` took longest."""
    durations = [
        (p.rank, (main.end_time or 0) - (main.start_time or 0))
        for p in processes
        if p.rank is not None and (main := p.main_span) is not None
    ]
    if not durations:
        return None
    rank, duration = max(durations, key=lambda item: item[1])
    assert rank is not None
    return rank, duration


def _lane(process: Process, origin: int, slowest: bool) -> dict[str, Any]:
    rows = {key: row for row, key in enumerate(sorted({(p.lane, p.depth) for p in process.spans}))}
    main = process.main_span
    errors = [
        f"{p.span.name}: {p.span.status.description}"
        for p in process.spans
        if p.span.status.status_code is StatusCode.ERROR and p.span.status.description
    ]
    method = process.attribute(schema.METHOD_EFFECTIVE)
    fallback = process.attribute(schema.FALLBACK_REASON)
    return {
        "key": process.key,
        "label": process.label,
        "rank": process.rank,
        "method": None if method is None else str(method),
        "fallback": None if fallback is None else str(fallback),
        "error": errors[0] if errors else None,
        "slowest": slowest,
        "durationMs": None
        if main is None
        else ((main.end_time or 0) - (main.start_time or 0)) / 1e6,
        "rows": max(len(rows), 1),
        "spans": [
            _bar(p.span, rows[(p.lane, p.depth)], origin)
            for p in sorted(process.spans, key=lambda p: (p.lane, p.depth, p.start_ns))
        ],
    }


def _bar(span: ReadableSpan, row: int, origin: int) -> dict[str, Any]:
    start = span.start_time or origin
    end = span.end_time or start
    color = COLORS.get(span.name, _OTHER_COLOR)
    attributes = span.attributes or {}
    label = span.name
    if span.name == schema.SPAWN_SPAN and schema.RANK in attributes:
        label = f"spawn rank {attributes[schema.RANK]!s}"
    is_error = span.status.status_code is StatusCode.ERROR
    return {
        "name": span.name,
        "label": label,
        "row": row,
        "startMs": (start - origin) / 1e6,
        "endMs": (end - origin) / 1e6,
        "color": color,
        "lightText": color in _LIGHT_TEXT,
        "status": span.status.status_code.name,
        "error": (span.status.description or "error") if is_error else None,
        "attrs": {key: _text(value) for key, value in sorted(attributes.items())},
    }


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return str(value)
