"""The vLLM workers' trace without vLLM (rayload.integrations.vllm_trace imports vLLM only
where it asks vLLM something): a worker with no vLLM trace context records the root
itself, and the trace files appear once every rank of the trace has written its spans.
vLLM's tracer provider gets span ids a seed does not repeat. The engine test
(tests/vllm/test_trace.py) covers vLLM's context and its TP group."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

from rayload.integrations.vllm_trace import (
    TraceTarget,
    WorkerTrace,
    _merge_into,
    secure_span_ids,
)
from rayload.loading.model import MODEL_BUILD_PHASE, MODEL_FILL_PHASE
from rayload.tracing import schema
from rayload.tracing.decode import decode_spans


def _otlp_spans(trace_dir: Path) -> list[dict[str, Any]]:
    otlp = json.loads((trace_dir / "trace.otlp.json").read_text())
    return [s for r in otlp["resourceSpans"] for sc in r["scopeSpans"] for s in sc["spans"]]


def test_a_worker_without_vllms_context_records_the_root(tmp_path: Path) -> None:
    trace = WorkerTrace(TraceTarget(otlp=False, endpoint=None, trace_dir=tmp_path))
    with trace.phase(MODEL_BUILD_PHASE):
        pass
    with trace.phase(MODEL_FILL_PHASE):
        pass
    trace.finish(0, 1, None, None)
    spans = _otlp_spans(tmp_path)
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == sorted(
        [schema.ROOT_SPAN, schema.RANK_SPAN, MODEL_BUILD_PHASE, MODEL_FILL_PHASE]
    )
    root, rank_load = by_name[schema.ROOT_SPAN], by_name[schema.RANK_SPAN]
    assert not root.get("parentSpanId")
    assert rank_load["parentSpanId"] == root["spanId"]
    assert by_name[MODEL_FILL_PHASE]["parentSpanId"] == rank_load["spanId"]
    assert len({s["traceId"] for s in spans}) == 1


def test_a_failed_load_is_an_error_span(tmp_path: Path) -> None:
    trace = WorkerTrace(TraceTarget(otlp=False, endpoint=None, trace_dir=tmp_path))
    trace.finish(0, 1, None, "ShardingError('model.embed_tokens.weight')")
    (rank_load,) = [s for s in _otlp_spans(tmp_path) if s["name"] == schema.RANK_SPAN]
    assert rank_load["status"]["code"] == 2


def test_no_target_records_nothing(tmp_path: Path) -> None:
    WorkerTrace(None).finish(0, 1, None, None)
    assert list(tmp_path.iterdir()) == []


def _one_rank(trace_dir: Path) -> list[ReadableSpan]:
    """The spans a single-rank worker writes: its root, rank.load."""
    trace_dir.mkdir()
    WorkerTrace(TraceTarget(otlp=False, endpoint=None, trace_dir=trace_dir)).finish(
        0, 1, None, None
    )
    (payload,) = trace_dir.glob("rank0-*.otlp.pb")
    return decode_spans(payload.read_bytes())


def test_the_files_wait_for_every_rank_of_their_trace(tmp_path: Path) -> None:
    ours, other = _one_rank(tmp_path / "ours"), _one_rank(tmp_path / "other")
    merged = tmp_path / "merged"
    merged.mkdir()
    assert _merge_into(merged, 0, 2, ours) is None
    assert _merge_into(merged, 1, 2, other) is None  # another trace's rank 1
    assert not (merged / "trace.otlp.json").exists()
    assert _merge_into(merged, 1, 2, ours) == 2 * len(ours)
    trace_id = ours[0].context.trace_id
    assert {s["traceId"] for s in _otlp_spans(merged)} == {f"{trace_id:032x}"}


def test_vllms_tracer_provider_gets_ids_a_seed_does_not_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM seeds `random` alike in every worker; its provider's default ids follow it."""

    def load_model_span_id(provider: TracerProvider) -> int:
        random.seed(0)
        span = provider.get_tracer("vllm.worker").start_span("Load model")
        span.end()
        return span.get_span_context().span_id

    workers = [TracerProvider(), TracerProvider()]
    assert load_model_span_id(workers[0]) == load_model_span_id(workers[1])
    for provider in workers:
        monkeypatch.setattr(trace_api, "get_tracer_provider", lambda p=provider: p)
        secure_span_ids()
    assert load_model_span_id(workers[0]) != load_model_span_id(workers[1])


def test_tracing_from_the_environment_alone_does_not_wait_for_other_workers(
    otlp_grpc_receiver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of 2, traced by its environment only: no broadcast (which would wait for
    rank 0 forever), its own root, sent to the environment's endpoint."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_grpc_receiver.endpoint)
    target = TraceTarget(otlp=True, endpoint=None, trace_dir=None, agreed=False)
    WorkerTrace(target).finish(1, 2, None, None)
    assert otlp_grpc_receiver.wait_for_requests(1)
    spans = {s.name: s for s in otlp_grpc_receiver.spans()}
    assert set(spans) == {schema.ROOT_SPAN, schema.RANK_SPAN}
    assert spans[schema.RANK_SPAN].parent.span_id == spans[schema.ROOT_SPAN].context.span_id
    assert spans[schema.RANK_SPAN].resource.attributes[schema.RANK] == 1
