"""The startup trace of a real load: every driver and rank span in one trace, and rank spans
moved onto the driver's clock even when a rank's clock runs seconds ahead (one load read
by both: ``skewed_load``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import rayload

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_trace_has_root_placement_spawn_and_rank_phases_for_every_rank(
    skewed_load: Any,
) -> None:
    spans = skewed_load.spans
    names = Counter(s.name for s in spans)
    assert names["rayload.load"] == 1 and names["rayload.placement"] == 1
    assert names["rayload.prepare"] == 1 and names["rayload.connect"] == 1
    (root,) = [s for s in spans if s.name == "rayload.load"]
    (prepare,) = [s for s in spans if s.name == "rayload.prepare"]
    # The root's total includes the driver's config and header parsing: it starts with it.
    assert root.start_ns == prepare.start_ns <= prepare.end_ns <= root.end_ns
    assert names["rayload.spawn"] == 2 and names["rank.load"] == 2
    for phase in ("rank.resolve", "rank.plan", "rank.read", "rank.to_device", "rank.sync"):
        assert names[phase] == 2, phase
    assert not any(s.error for s in spans)
    spawns = {s.rank: s for s in spans if s.name == "rayload.spawn"}
    assert set(spawns) == {0, 1} and all(s.end_ns >= s.start_ns for s in spawns.values())


def test_rank_clock_skew_is_corrected_into_root_span(skewed_load: Any) -> None:
    spans = skewed_load.spans
    (root,) = [s for s in spans if s.name == "rayload.load"]
    skewed = [s for s in spans if s.rank == 1 and s.name.startswith("rank.")]
    assert skewed
    for span in skewed:
        assert abs(span.attributes["rayload.clock_offset_ms"] - skewed_load.skew_ns / 1e6) < 1000
        assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns, span.name
    # The report itself keeps the rank's own clock: only the trace is corrected.
    assert skewed_load.rank_1.start_ns > root.end_ns


def test_load_exports_its_trace_to_an_otlp_receiver(
    tiny_llama: Path, otlp_http_receiver: Any, no_leaks: object
) -> None:
    endpoint = otlp_http_receiver.endpoint
    with rayload.load(tiny_llama, 2, method="dummy", device="cpu", otlp_endpoint=endpoint) as r:
        trace_id = r.trace_id
    assert otlp_http_receiver.wait_for_requests(1)
    spans = otlp_http_receiver.spans()
    assert {f"{s.context.trace_id:032x}" for s in spans} == {trace_id}
    assert Counter(s.name for s in spans)["rank.load"] == 2


def test_load_succeeds_when_otlp_collector_never_answers(
    tiny_llama: Path, black_hole: Any, no_leaks: object
) -> None:
    endpoint = f"http://127.0.0.1:{black_hole.port}/v1/traces"
    with rayload.load(tiny_llama, 1, method="dummy", device="cpu", otlp_endpoint=endpoint) as r:
        assert len(r.ranks) == 1


RANK_ATTRIBUTES = (
    "rayload.rank",
    "rayload.tp_size",
    "rayload.node_id",
    "rayload.device",
    "rayload.method.requested",
    "rayload.method.selected",
    "rayload.method.effective",
    "rayload.bytes",
    "rayload.model_role",
    "rayload.clock_offset_ms",
)


def test_tp4_load_exports_one_complete_trace_to_grpc_and_http_receivers(
    tiny_llama: Path,
    otlp_grpc_receiver: Any,
    otlp_http_receiver: Any,
    monkeypatch: pytest.MonkeyPatch,
    no_leaks: object,
) -> None:
    # gRPC through --otlp-endpoint, HTTP through the standard variable: both at once is not
    # possible in one load, so the HTTP receiver gets a second load via OTEL_EXPORTER_*.
    with rayload.load(
        tiny_llama, 4, method="scratch", device="cpu", otlp_endpoint=otlp_grpc_receiver.endpoint
    ) as result:
        grpc_trace_id = result.trace_id
        nodes = {r.rank: r.node_id for r in result.ranks}
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_http_receiver.endpoint)
    with rayload.load(tiny_llama, 4, method="auto", device="cpu") as result:
        http_trace_id = result.trace_id
    for receiver, trace_id, requested in (
        (otlp_grpc_receiver, grpc_trace_id, "scratch"),
        (otlp_http_receiver, http_trace_id, "auto"),
    ):
        assert receiver.wait_for_requests(1)
        spans = receiver.spans()
        assert {f"{s.context.trace_id:032x}" for s in spans} == {trace_id}
        ids = {s.context.span_id for s in spans}
        (root,) = [s for s in spans if s.name == "rayload.load"]
        assert root.parent is None
        assert all(s.parent is not None and s.parent.span_id in ids for s in spans if s is not root)
        rank_loads = {s.attributes["rayload.rank"]: s for s in spans if s.name == "rank.load"}
        assert sorted(rank_loads) == [0, 1, 2, 3]
        for rank, span in rank_loads.items():
            assert span.parent.span_id == root.context.span_id
            for key in RANK_ATTRIBUTES:
                assert key in span.attributes, (rank, key)
            assert span.attributes["rayload.method.requested"] == requested
            assert span.attributes["rayload.method.selected"] == "scratch"
            assert span.attributes["rayload.method.effective"] == "scratch"
            assert span.attributes["rayload.tp_size"] == 4
            assert span.resource.attributes["host.name"]
            children = {
                s.name for s in spans if s.parent and s.parent.span_id == span.context.span_id
            }
            assert {"rank.resolve", "rank.plan", "rank.read", "rank.sync"} <= children
            if trace_id == grpc_trace_id:
                assert span.attributes["rayload.node_id"] == nodes[rank]
