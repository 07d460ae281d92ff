"""trace.otlp.json follows the OTLP/JSON encoding and round-trips to the same protobuf."""

from __future__ import annotations

import base64
import copy
import re
from typing import Any

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from rayload.tracing import to_otlp_json


def _spans_of(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        span
        for resource_spans in document["resourceSpans"]
        for scope_spans in resource_spans["scopeSpans"]
        for span in scope_spans["spans"]
    ]


def test_otlp_json_ids_hex_times_strings_enums_integers(tp4_trace: Any) -> None:
    spans = _spans_of(to_otlp_json(tp4_trace.spans))
    assert len(spans) == len(tp4_trace.spans)
    for span in spans:
        assert span["traceId"] == tp4_trace.trace_id
        assert re.fullmatch(r"[0-9a-f]{16}", span["spanId"])
        assert "parentSpanId" not in span or re.fullmatch(r"[0-9a-f]{16}", span["parentSpanId"])
        assert isinstance(span["startTimeUnixNano"], str) and span["startTimeUnixNano"].isdigit()
        assert span["kind"] == 1  # SPAN_KIND_INTERNAL, as an integer
    root = next(s for s in spans if s["name"] == "rayload.load")
    assert root["spanId"] == f"{tp4_trace.root_span_id:016x}"


def test_otlp_json_keeps_one_resource_per_process(tp4_trace: Any) -> None:
    document = to_otlp_json(tp4_trace.spans)
    services = sorted(
        next(
            a["value"]["stringValue"]
            for a in rs["resource"]["attributes"]
            if a["key"] == "service.name"
        )
        for rs in document["resourceSpans"]
    )
    assert services == ["rayload", *["rayload-rank"] * tp4_trace.tp_size]


def test_otlp_json_round_trips_to_exported_protobuf(tp4_trace: Any) -> None:
    document = copy.deepcopy(to_otlp_json(tp4_trace.spans))
    for span in _spans_of(document):  # back to protobuf's own base64 id mapping
        for field in ("traceId", "spanId", "parentSpanId"):
            if field in span:
                span[field] = base64.b64encode(bytes.fromhex(span[field])).decode()
    parsed = json_format.ParseDict(document, ExportTraceServiceRequest())
    assert parsed == encode_spans(tp4_trace.spans)
