"""``trace.jaeger.json``: the JSON the Jaeger UI accepts through "Upload" (JSON File).

The shape is the Jaeger query API's ``/api/traces/{id}`` response, which is what the
UI's file reader parses: ``{"data": [{"traceID", "spans", "processes", "warnings"}]}``
with microsecond times, typed tags and one process per OpenTelemetry resource. Status
and kind follow the collector's OTLP-to-Jaeger translation (``otel.status_code``,
``error=true``, ``span.kind``) so the UI marks failed spans the usual way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode


def to_jaeger_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """The Jaeger upload document holding one trace per trace id found in ``spans``."""
    by_trace: dict[int, list[ReadableSpan]] = {}
    for span in spans:
        if span.context is not None:
            by_trace.setdefault(span.context.trace_id, []).append(span)
    return {
        "data": [_trace(trace_id, members) for trace_id, members in by_trace.items()],
        "total": 0,
        "limit": 0,
        "offset": 0,
        "errors": None,
    }


def _trace(trace_id: int, spans: list[ReadableSpan]) -> dict[str, Any]:
    process_ids: dict[Resource, str] = {}
    for span in spans:
        process_ids.setdefault(span.resource, f"p{len(process_ids) + 1}")
    return {
        "traceID": f"{trace_id:032x}",
        "spans": [_span(span, process_ids[span.resource]) for span in spans],
        "processes": {pid: _process(resource) for resource, pid in process_ids.items()},
        "warnings": None,
    }


def _span(span: ReadableSpan, process_id: str) -> dict[str, Any]:
    assert span.context is not None
    trace_id = f"{span.context.trace_id:032x}"
    references = []
    if span.parent is not None:
        references.append(
            {"refType": "CHILD_OF", "traceID": trace_id, "spanID": f"{span.parent.span_id:016x}"}
        )
    start = span.start_time or 0
    end = span.end_time or start
    return {
        "traceID": trace_id,
        "spanID": f"{span.context.span_id:016x}",
        "operationName": span.name,
        "references": references,
        "startTime": start // 1000,
        "duration": (end - start) // 1000,
        "tags": _tags(span.attributes or {}) + _status_tags(span),
        "logs": [
            {
                "timestamp": event.timestamp // 1000,
                "fields": _tags({"event": event.name, **dict(event.attributes or {})}),
            }
            for event in span.events
        ],
        "processID": process_id,
        "warnings": None,
        "flags": 1,
    }


def _status_tags(span: ReadableSpan) -> list[dict[str, Any]]:
    extra: dict[str, Any] = {}
    if span.instrumentation_scope is not None:
        extra["otel.scope.name"] = span.instrumentation_scope.name
    if span.kind is not SpanKind.INTERNAL:
        extra["span.kind"] = span.kind.name.lower()
    if span.status.status_code is not StatusCode.UNSET:
        extra["otel.status_code"] = span.status.status_code.name
    if span.status.status_code is StatusCode.ERROR:
        extra["error"] = True
        if span.status.description:
            extra["otel.status_description"] = span.status.description
    return _tags(extra)


def _process(resource: Resource) -> dict[str, Any]:
    attributes = dict(resource.attributes)
    service = str(attributes.pop("service.name", "unknown_service"))
    return {"serviceName": service, "tags": _tags(attributes)}


def _tags(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [_tag(key, value) for key, value in attributes.items()]


def _tag(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, str):
        return {"key": key, "type": "string", "value": value}
    return {"key": key, "type": "string", "value": json.dumps(list(value))}
