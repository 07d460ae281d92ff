"""trace.jaeger.json has the structure the Jaeger UI's trace upload parses.

The UI (packages/jaeger-ui/src/types/trace.tsx) reads ``data[]`` of TraceData: traceID,
processes {id: {serviceName, tags}}, and SpanData: spanID, traceID, processID,
operationName, startTime and duration in microseconds, logs [{timestamp, fields}],
tags [{key, type, value}], references [{refType, traceID, spanID}], warnings.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rayload.tracing import to_jaeger_json

_TAG_TYPES = {"string": str, "bool": bool, "int64": int, "float64": float}


def _tag_map(tags: list[dict[str, Any]]) -> dict[str, Any]:
    return {tag["key"]: tag["value"] for tag in tags}


def _check_tags(tags: list[dict[str, Any]]) -> None:
    for tag in tags:
        assert set(tag) == {"key", "type", "value"}
        assert isinstance(tag["value"], _TAG_TYPES[tag["type"]]), tag


def test_jaeger_json_matches_ui_trace_model(tp4_trace: Any) -> None:
    document = json.loads(json.dumps(to_jaeger_json(tp4_trace.spans)))
    [trace] = document["data"]
    assert trace["traceID"] == tp4_trace.trace_id
    spans, processes = trace["spans"], trace["processes"]
    assert len(spans) == len(tp4_trace.spans)
    span_ids = {span["spanID"] for span in spans}
    for span in spans:
        assert span["traceID"] == tp4_trace.trace_id
        assert re.fullmatch(r"[0-9a-f]{16}", span["spanID"])
        assert isinstance(span["operationName"], str) and span["operationName"]
        assert isinstance(span["startTime"], int) and isinstance(span["duration"], int)
        assert span["duration"] >= 0
        assert span["processID"] in processes
        assert span["warnings"] is None
        _check_tags(span["tags"])
        for log in span["logs"]:
            assert isinstance(log["timestamp"], int)
            _check_tags(log["fields"])
        for reference in span["references"]:
            assert reference["refType"] == "CHILD_OF"
            assert reference["traceID"] == tp4_trace.trace_id
            assert reference["spanID"] in span_ids
    roots = [span for span in spans if not span["references"]]
    assert [root["operationName"] for root in roots] == ["rayload.load"]
    assert roots[0]["startTime"] == tp4_trace.root_start_ns // 1000
    assert roots[0]["duration"] == (tp4_trace.root_end_ns - tp4_trace.root_start_ns) // 1000
    for process in processes.values():
        assert isinstance(process["serviceName"], str)
        _check_tags(process["tags"])


def test_jaeger_json_one_process_per_rank_with_host(tp4_trace: Any) -> None:
    [trace] = to_jaeger_json(tp4_trace.spans)["data"]
    processes = trace["processes"]
    ranks = {
        _tag_map(p["tags"])["rayload.rank"]: _tag_map(p["tags"])["host.name"]
        for p in processes.values()
        if p["serviceName"] == "rayload-rank"
    }
    assert ranks == {rank: f"node-{rank}" for rank in range(tp4_trace.tp_size)}
    assert sum(p["serviceName"] == "rayload" for p in processes.values()) == 1
    for span in trace["spans"]:
        tags = _tag_map(span["tags"])
        if "rayload.rank" in tags and span["operationName"].startswith("rank."):
            process_tags = _tag_map(processes[span["processID"]]["tags"])
            assert process_tags["rayload.rank"] == tags["rayload.rank"]


def test_jaeger_json_marks_errors_the_jaeger_way(make_tp4_trace: Any) -> None:
    synthetic = make_tp4_trace(failed_rank=1)
    [trace] = to_jaeger_json(synthetic.spans)["data"]
    failed = [s for s in trace["spans"] if _tag_map(s["tags"]).get("error") is True]
    assert sorted(s["operationName"] for s in failed) == ["rank.load", "rank.read"]
    read = next(s for s in failed if s["operationName"] == "rank.read")
    assert _tag_map(read["tags"])["otel.status_code"] == "ERROR"
    [log] = read["logs"]
    fields = _tag_map(log["fields"])
    assert fields["event"] == "exception"
    assert fields["exception.type"] == "OSError"
