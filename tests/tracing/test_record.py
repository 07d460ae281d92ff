"""The rank side: PhaseRecords -> spans -> OTLP protobuf bytes."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import StatusCode

from rayload.loading.report import PhaseRecord
from rayload.tracing import decode_spans, rank_spans_payload

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
T0 = 1_750_000_000_000_000_000


def _payload(**overrides: object) -> bytes:
    arguments: dict[str, object] = {
        "traceparent": TRACEPARENT,
        "rank": 2,
        "tp_size": 4,
        "start_ns": T0,
        "end_ns": T0 + 50,
        "phases": [
            PhaseRecord("rank.resolve", T0 + 1, T0 + 10, {"method.selected": "scratch"}),
            PhaseRecord(
                "rank.read", T0 + 10, T0 + 40, {"rayload.bytes": 4096, "files": ["a", "b"]}
            ),
        ],
        "attributes": {"device": "cpu", "fallback_reason": None, "method.effective": "scratch"},
        "host_name": "gpu-node-7",
    }
    arguments.update(overrides)
    return rank_spans_payload(**arguments)  # type: ignore[arg-type]


def test_payload_is_otlp_export_request_with_rank_resource() -> None:
    request = ExportTraceServiceRequest.FromString(_payload())
    assert len(request.resource_spans) == 1
    resource = {kv.key: kv.value for kv in request.resource_spans[0].resource.attributes}
    assert resource["service.name"].string_value == "rayload-rank"
    assert resource["host.name"].string_value == "gpu-node-7"
    assert resource["rayload.rank"].int_value == 2


def test_rank_load_is_child_of_traceparent_span() -> None:
    spans = {s.name: s for s in decode_spans(_payload())}
    rank_load = spans["rank.load"]
    assert rank_load.parent is not None
    assert f"{rank_load.parent.span_id:016x}" == PARENT_ID
    assert rank_load.parent.is_remote
    assert all(f"{s.context.trace_id:032x}" == TRACE_ID for s in spans.values())
    assert (rank_load.start_time, rank_load.end_time) == (T0, T0 + 50)


def test_phases_are_children_with_prefixed_attributes() -> None:
    spans = {s.name: s for s in decode_spans(_payload())}
    rank_load_id = spans["rank.load"].context.span_id
    read = spans["rank.read"]
    assert read.parent is not None and read.parent.span_id == rank_load_id
    assert (read.start_time, read.end_time) == (T0 + 10, T0 + 40)
    assert read.attributes["rayload.bytes"] == 4096
    assert list(read.attributes["rayload.files"]) == ["a", "b"]
    assert read.attributes["rayload.rank"] == 2
    assert spans["rank.resolve"].attributes["rayload.method.selected"] == "scratch"
    rank_attrs = spans["rank.load"].attributes
    assert rank_attrs["rayload.device"] == "cpu"
    assert rank_attrs["rayload.tp_size"] == 4
    assert "rayload.fallback_reason" not in rank_attrs  # None means not applicable


def test_failed_phase_marks_phase_and_rank_load_error() -> None:
    phases = [
        PhaseRecord("rank.resolve", T0 + 1, T0 + 10),
        PhaseRecord("rank.read", T0 + 10, T0 + 20, {}, "OSError(5, 'Input/output error')"),
    ]
    spans = {s.name: s for s in decode_spans(_payload(phases=phases))}
    read = spans["rank.read"]
    assert read.status.status_code is StatusCode.ERROR
    assert read.status.description == "OSError(5, 'Input/output error')"
    [event] = read.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "OSError"
    assert event.timestamp == T0 + 20
    assert spans["rank.load"].status.status_code is StatusCode.ERROR
    assert spans["rank.resolve"].status.status_code is StatusCode.UNSET


def test_rank_error_without_failed_phase_marks_rank_load() -> None:
    spans = {s.name: s for s in decode_spans(_payload(error="custom failure", phases=[]))}
    rank_load = spans["rank.load"]
    assert rank_load.status.status_code is StatusCode.ERROR
    assert rank_load.events[0].attributes["exception.type"] == "Error"
    assert rank_load.events[0].attributes["exception.message"] == "custom failure"


def test_unsampled_traceparent_still_records_spans() -> None:
    spans = decode_spans(_payload(traceparent=f"00-{TRACE_ID}-{PARENT_ID}-00"))
    assert sorted(s.name for s in spans) == ["rank.load", "rank.read", "rank.resolve"]


@pytest.mark.parametrize("traceparent", ["", "garbage", f"00-{'0' * 32}-{PARENT_ID}-01"])
def test_invalid_traceparent_raises_value_error(traceparent: str) -> None:
    with pytest.raises(ValueError, match="traceparent"):
        _payload(traceparent=traceparent)
