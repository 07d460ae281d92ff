"""Fixtures of the tracing tests: real OTLP receivers and a synthetic TP=4 startup trace.

The receivers live in ``receivers.py`` (loaded by path: tests cannot import each other
under ``--import-mode=importlib``); their fixtures are re-exported here.

``make_tp4_trace(...)`` builds the trace the way the driver and four rank actors do, with
the real ``StartupTrace`` / ``rank_spans_payload`` code on a hand-driven driver clock:

=====  ==========================  =====================================================
rank   method                      notes
=====  ==========================  =====================================================
0      scratch
1      fastsafetensors_gdr ->      falls back to fastsafetensors (``FALLBACK_REASON``)
       fastsafetensors
2      scratch                     slowest (longest rank.read)
3      scratch                     its clock runs ``SKEW_NS`` ahead of the driver's
=====  ==========================  =====================================================
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from rayload.loading.methods import LoadMethod, MethodReport
from rayload.loading.report import PhaseRecord, RankReport
from rayload.tracing import StartupTrace, best_clock_offset, report_spans_payload


def _load_receivers() -> object:
    name = "rayload_tests_tracing_receivers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("receivers.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


receivers = _load_receivers()
otlp_grpc_receiver = receivers.otlp_grpc_receiver  # type: ignore[attr-defined]
otlp_http_receiver = receivers.otlp_http_receiver  # type: ignore[attr-defined]
black_hole = receivers.black_hole  # type: ignore[attr-defined]
unused_port = receivers.unused_port  # type: ignore[attr-defined]

MS = 1_000_000
BASE_NS = 1_750_000_000_000_000_000
"""Driver wall clock at the start of the synthetic load (a fixed epoch time)."""
TP = 4
SKEWED_RANK = 3
SKEW_NS = 2_500 * MS
"""Rank 3's clock is 2.5 s ahead: uncorrected, its spans would end after the root."""
SLOWEST_RANK = 2
FALLBACK_RANK = 1
FALLBACK_REASON = "GPUDirect Storage is unavailable (no nvidia-fs); used the CPU bounce buffer"
ROOT_END_MS = 1_000
READ_MS = {0: 100, 1: 120, 2: 260, 3: 110}
BYTES_PER_RANK = 256 * 1024 * 1024
SPAWN_END_MS = {0: 300, 1: 315, 2: 330, 3: 345}


class DriverClock:
    """A driver wall clock the test moves by hand."""

    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns


@dataclass(frozen=True)
class SyntheticTrace:
    spans: list[ReadableSpan]
    trace_id: str
    root_span_id: int
    reports: dict[int, RankReport]
    """Per rank, in the rank's own clock (rank 3 is SKEW_NS ahead)."""
    payloads: dict[int, bytes]
    offsets: dict[int, tuple[int, int]]
    """Per rank, (offset_ns, rtt_ns) as best_clock_offset measured it."""
    root_start_ns: int
    root_end_ns: int
    skewed_rank: int = SKEWED_RANK
    skew_ns: int = SKEW_NS
    slowest_rank: int = SLOWEST_RANK
    fallback_rank: int = FALLBACK_RANK
    fallback_reason: str = FALLBACK_REASON
    tp_size: int = TP


def _method(rank: int) -> MethodReport:
    if rank == FALLBACK_RANK:
        return MethodReport(
            LoadMethod.AUTO,
            LoadMethod.FASTSAFETENSORS_GDR,
            LoadMethod.FASTSAFETENSORS,
            FALLBACK_REASON,
        )
    return MethodReport(LoadMethod.AUTO, LoadMethod.SCRATCH, LoadMethod.SCRATCH)


def rank_report(rank: int, *, skew_ns: int = 0, error: str | None = None) -> RankReport:
    """Rank ``rank``'s report; phase lengths resolve 2, plan 3, read READ_MS, to_device 30,
    sync 5, post_load 10 ms, starting at 360 ms driver time (+ ``skew_ns``)."""
    lengths = {
        "rank.resolve": 2,
        "rank.plan": 3,
        "rank.read": READ_MS[rank],
        "rank.to_device": 30,
        "rank.sync": 5,
        "rank.post_load": 10,
    }
    start = BASE_NS + 360 * MS + skew_ns
    cursor = start + 1 * MS  # config parsing before the first phase
    phases = []
    for name, length in lengths.items():
        attributes: dict[str, object] = {}
        if name == "rank.read":
            attributes = {"bytes": BYTES_PER_RANK, "files": 2}
        elif name == "rank.to_device":
            attributes = {"device": "cpu"}
        failed = error if (error and name == "rank.read") else None
        phases.append(PhaseRecord(name, cursor, cursor + length * MS, attributes, failed))
        cursor += length * MS
        if failed:
            break
    return RankReport(
        rank=rank,
        tp_size=TP,
        device="cpu",
        method=_method(rank),
        bytes_read=BYTES_PER_RANK,
        tensors=24,
        start_ns=start,
        end_ns=cursor,
        phases=tuple(phases),
        node_id=f"{rank:02d}" + "ab" * 27,
    )


def _clock_samples(skew_ns: int) -> list[tuple[int, int, int]]:
    """Three ping samples around 350 ms; the 0.3 ms one is the best."""
    samples = []
    for sent_ms, rtt_us, remote_at in ((350.0, 900, 0.7), (352.0, 300, 0.4), (354.0, 600, 0.5)):
        t_send = BASE_NS + int(sent_ms * MS)
        t_recv = t_send + rtt_us * 1000
        samples.append((t_send, t_send + int(remote_at * rtt_us * 1000) + skew_ns, t_recv))
    return samples


def build_tp4_trace(
    *,
    missing_rank: int | None = None,
    failed_rank: int | None = None,
    root_error: str | None = None,
) -> SyntheticTrace:
    """The synthetic TP=4 startup trace (see the module docstring)."""
    clock = DriverClock(BASE_NS)
    trace = StartupTrace(tp_size=TP, clock=clock)
    trace.add_span(
        "rayload.placement",
        BASE_NS + 1 * MS,
        BASE_NS + 21 * MS,
        {"strategy": "PACK", "bundles": TP},
    )
    reports: dict[int, RankReport] = {}
    payloads: dict[int, bytes] = {}
    offsets: dict[int, tuple[int, int]] = {}
    for rank in range(TP):
        trace.add_span(
            "rayload.spawn",
            BASE_NS + 21 * MS,
            BASE_NS + SPAWN_END_MS[rank] * MS,
            {"rank": rank, "node_id": f"{rank:02d}" + "ab" * 27},
        )
        if rank == missing_rank:
            trace.add_missing_rank(
                rank,
                f"{rank:02d}" + "ab" * 27,
                "RayActorError('The actor died unexpectedly before finishing this task.')",
                BASE_NS + 360 * MS,
                BASE_NS + 900 * MS,
            )
            continue
        skew = SKEW_NS if rank == SKEWED_RANK else 0
        error = "OSError(5, 'Input/output error')" if rank == failed_rank else None
        report = rank_report(rank, skew_ns=skew, error=error)
        offset, rtt = best_clock_offset(_clock_samples(skew))
        payload = report_spans_payload(
            report, traceparent=trace.traceparent(), error=error, host_name=f"node-{rank}"
        )
        trace.add_rank(payload, offset, rtt)
        reports[rank], payloads[rank], offsets[rank] = report, payload, (offset, rtt)
    clock.now_ns = BASE_NS + ROOT_END_MS * MS
    spans = trace.finish(error=root_error)
    root = spans[0]
    assert root.context is not None
    return SyntheticTrace(
        spans=spans,
        trace_id=trace.trace_id,
        root_span_id=root.context.span_id,
        reports=reports,
        payloads=payloads,
        offsets=offsets,
        root_start_ns=BASE_NS,
        root_end_ns=BASE_NS + ROOT_END_MS * MS,
    )


@pytest.fixture
def tp4_trace() -> SyntheticTrace:
    return build_tp4_trace()


@pytest.fixture(scope="session")
def make_tp4_trace() -> Callable[..., SyntheticTrace]:
    return build_tp4_trace


def check_startup_trace(spans: list[ReadableSpan], expected: SyntheticTrace) -> None:
    """Assert ``spans`` (merged, or as a receiver got them) are the whole synthetic trace:
    one trace id, the span tree of docs/design.md with every parent present, and the fixed
    attributes and resources."""
    assert {f"{s.context.trace_id:032x}" for s in spans if s.context} == {expected.trace_id}
    by_id = {s.context.span_id: s for s in spans if s.context}
    assert len(by_id) == len(spans), "span ids collide"
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["rayload.load"]
    root_id = expected.root_span_id
    assert roots[0].context is not None and roots[0].context.span_id == root_id
    for span in spans:
        if span.parent is not None:
            assert span.parent.span_id in by_id, f"{span.name}'s parent is not in the trace"

    driver = [s for s in spans if s.parent is not None and s.parent.span_id == root_id]
    assert sorted(s.name for s in driver if s.name.startswith("rayload.")) == [
        "rayload.placement",
        *["rayload.spawn"] * expected.tp_size,
    ]
    spawned = sorted(s.attributes["rayload.rank"] for s in driver if s.name == "rayload.spawn")
    assert spawned == list(range(expected.tp_size))

    rank_loads = {s.attributes["rayload.rank"]: s for s in spans if s.name == "rank.load"}
    assert sorted(rank_loads) == list(range(expected.tp_size))
    for rank, rank_load in rank_loads.items():
        assert rank_load.parent is not None and rank_load.parent.span_id == root_id
        attrs = rank_load.attributes
        assert attrs["rayload.tp_size"] == expected.tp_size
        assert attrs["rayload.node_id"] == f"{rank:02d}" + "ab" * 27
        assert attrs["rayload.device"] == "cpu"
        assert attrs["rayload.method.requested"] == "auto"
        assert attrs["rayload.model_role"] == "main"
        assert attrs["rayload.bytes"] == BYTES_PER_RANK
        if rank == expected.fallback_rank:
            assert attrs["rayload.method.selected"] == "fastsafetensors_gdr"
            assert attrs["rayload.method.effective"] == "fastsafetensors"
            assert attrs["rayload.fallback_reason"] == expected.fallback_reason
        else:
            assert (
                attrs["rayload.method.selected"] == attrs["rayload.method.effective"] == "scratch"
            )
            assert "rayload.fallback_reason" not in attrs
        resource = rank_load.resource.attributes
        assert resource["service.name"] == "rayload-rank"
        assert resource["host.name"] == f"node-{rank}"
        assert resource["rayload.rank"] == rank

        assert rank_load.context is not None
        children = [
            s
            for s in spans
            if s.parent is not None and s.parent.span_id == rank_load.context.span_id
        ]
        assert [c.name for c in sorted(children, key=lambda c: c.start_time or 0)] == [
            "rank.resolve",
            "rank.plan",
            "rank.read",
            "rank.to_device",
            "rank.sync",
            "rank.post_load",
        ]
        for child in children:
            assert child.resource.attributes["rayload.rank"] == rank
            assert "rayload.clock_offset_ms" in child.attributes
        read = next(c for c in children if c.name == "rank.read")
        assert read.attributes["rayload.bytes"] == BYTES_PER_RANK

    skewed = rank_loads[expected.skewed_rank].attributes["rayload.clock_offset_ms"]
    assert abs(skewed - expected.skew_ns / 1e6) < 1.0
    assert rank_loads[0].attributes["rayload.clock_offset_ms"] == pytest.approx(0.0, abs=1.0)
    assert roots[0].resource.attributes["service.name"] == "rayload"


@pytest.fixture
def assert_startup_trace() -> Callable[[list[ReadableSpan], SyntheticTrace], None]:
    return check_startup_trace
