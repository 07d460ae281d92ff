"""Span ids must not collide across rank processes that seed ``random`` identically."""

from __future__ import annotations

import json
import subprocess
import sys

from rayload.tracing.ids import SecureIdGenerator

_RANK_PROCESS = """
import json, random, time
random.seed(0)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from rayload.loading.report import PhaseRecord
from rayload.tracing import StartupTrace, rank_spans_payload
now = time.time_ns()
trace = StartupTrace(tp_size=1)
phases = [PhaseRecord(f"rank.phase{i}", now, now + 1) for i in range(20)]
payload = rank_spans_payload(traceparent=trace.traceparent(), rank=0, tp_size=1,
                             start_ns=now, end_ns=now + 1, phases=phases, attributes={})
request = ExportTraceServiceRequest.FromString(payload)
ids = [s.span_id.hex() for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
print(json.dumps({"trace_id": trace.trace_id, "span_ids": ids}))
"""


def _ids_from_seeded_process() -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _RANK_PROCESS], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_span_ids_disjoint_across_identically_seeded_processes() -> None:
    first, second = _ids_from_seeded_process(), _ids_from_seeded_process()
    assert len(first["span_ids"]) == 21  # rank.load + 20 phases
    assert set(first["span_ids"]).isdisjoint(second["span_ids"])
    assert first["trace_id"] != second["trace_id"]


def test_generator_ids_ignore_random_seed() -> None:
    import random

    generator = SecureIdGenerator()
    random.seed(0)
    first = [generator.generate_span_id() for _ in range(5)]
    random.seed(0)
    second = [generator.generate_span_id() for _ in range(5)]
    assert set(first).isdisjoint(second)
    assert all(0 < i < 2**64 for i in first)
    assert 0 < generator.generate_trace_id() < 2**128
