"""The driver's StartupTrace: one trace, every rank merged on the driver's clock."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.trace import StatusCode

from rayload.loading.report import PhaseRecord
from rayload.tracing import StartupTrace, decode_spans, rank_spans_payload


def test_merged_trace_has_one_tree_with_every_rank(
    tp4_trace: Any, assert_startup_trace: Callable[..., None]
) -> None:
    assert_startup_trace(tp4_trace.spans, tp4_trace)
    assert tp4_trace.spans[0].name == "rayload.load"
    assert len(tp4_trace.trace_id) == 32
    int(tp4_trace.trace_id, 16)


def test_skewed_rank_spans_nest_inside_root_after_correction(tp4_trace: Any) -> None:
    rank = tp4_trace.skewed_rank
    offset, rtt = tp4_trace.offsets[rank]
    assert abs(offset - tp4_trace.skew_ns) <= rtt // 2
    merged = [s for s in tp4_trace.spans if s.resource.attributes.get("rayload.rank") == rank]
    assert len(merged) == 7
    for span in merged:
        assert tp4_trace.root_start_ns <= span.start_time <= span.end_time <= tp4_trace.root_end_ns
        assert span.attributes["rayload.clock_offset_ms"] == pytest.approx(offset / 1e6)
    # The same spans as the rank sent them (its own clock) would lie outside the root.
    raw = decode_spans(tp4_trace.payloads[rank])
    assert all(span.end_time > tp4_trace.root_end_ns for span in raw)


def test_missing_rank_gets_error_stand_in(make_tp4_trace: Callable[..., Any]) -> None:
    trace = make_tp4_trace(missing_rank=2)
    rank_spans = [s for s in trace.spans if s.resource.attributes.get("rayload.rank") == 2]
    [stand_in] = rank_spans
    assert stand_in.name == "rank.load"
    assert stand_in.parent is not None and stand_in.parent.span_id == trace.root_span_id
    assert stand_in.status.status_code is StatusCode.ERROR
    assert "actor died" in (stand_in.status.description or "")
    assert stand_in.attributes["rayload.node_id"].startswith("02")
    assert stand_in.attributes["rayload.spans_lost"] is True
    assert stand_in.events[0].attributes["exception.type"] == "RayActorError"


def test_finish_with_error_marks_root(make_tp4_trace: Callable[..., Any]) -> None:
    trace = make_tp4_trace(failed_rank=0, root_error="RankFailedError('rank 0 failed')")
    root = trace.spans[0]
    assert root.status.status_code is StatusCode.ERROR
    assert root.events[0].name == "exception"
    failed = {s.name: s for s in trace.spans if s.resource.attributes.get("rayload.rank") == 0}
    assert failed["rank.read"].status.status_code is StatusCode.ERROR
    assert failed["rank.load"].status.status_code is StatusCode.ERROR
    assert "rank.to_device" not in failed  # the rank stopped at the failing phase


def test_finish_twice_returns_same_spans_and_blocks_additions() -> None:
    trace = StartupTrace(tp_size=1)
    first = trace.finish()
    assert trace.finish() is first
    with pytest.raises(RuntimeError, match="already finished"):
        trace.add_span("rayload.placement", 0, 1)


def test_driver_span_attributes_are_prefixed_and_parented() -> None:
    trace = StartupTrace(tp_size=2, model_role="draft", service_name="my-engine")
    trace.add_span("rayload.spawn", 10, 20, {"rank": 1}, error="RuntimeError('boom')")
    root, spawn = trace.finish()
    assert root.attributes["rayload.model_role"] == "draft"
    assert root.resource.attributes["service.name"] == "my-engine"
    assert spawn.parent is not None and spawn.parent.span_id == root.context.span_id
    assert spawn.attributes["rayload.rank"] == 1
    assert spawn.status.status_code is StatusCode.ERROR
    assert trace.traceparent() == f"00-{trace.trace_id}-{root.context.span_id:016x}-01"


def test_add_rank_drops_other_trace_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    other = StartupTrace(tp_size=1)
    payload = rank_spans_payload(
        traceparent=other.traceparent(),
        rank=0,
        tp_size=1,
        start_ns=1,
        end_ns=2,
        phases=[PhaseRecord("rank.read", 1, 2)],
        attributes={},
    )
    trace = StartupTrace(tp_size=1)
    with caplog.at_level(logging.WARNING, logger="rayload.tracing.trace"):
        trace.add_rank(payload, 0)
    assert [s.name for s in trace.finish()] == ["rayload.load"]
    assert "was the rank given this trace's traceparent" in caplog.text


def test_add_rank_ignores_undecodable_payload_with_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace = StartupTrace(tp_size=1)
    with caplog.at_level(logging.WARNING, logger="rayload.tracing.trace"):
        trace.add_rank(b"\xff\xff not protobuf", 0)
    assert [s.name for s in trace.finish()] == ["rayload.load"]
    assert "is not OTLP" in caplog.text
