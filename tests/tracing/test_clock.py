"""Clock-offset estimation (Cristian's algorithm) and span correction."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import Event, ReadableSpan

from rayload.tracing import best_clock_offset, corrected, sample_clock_offset


def test_best_clock_offset_uses_smallest_round_trip() -> None:
    samples = [
        (1_000, 6_000 + 50_000, 9_000),  # rtt 8000
        (20_000, 20_500 + 40_000, 21_000),  # rtt 1000: the best
        (30_000, 33_000 + 45_000, 36_000),  # rtt 6000
    ]
    assert best_clock_offset(samples) == (40_000, 1_000)


def test_best_clock_offset_negative_when_rank_clock_behind() -> None:
    assert best_clock_offset([(100, 50, 200)]) == (-100, 100)


@pytest.mark.parametrize(
    ("samples", "message"),
    [([], "at least one"), ([(10, 5, 9)], "received before it was sent")],
)
def test_best_clock_offset_rejects_bad_samples(
    samples: list[tuple[int, int, int]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        best_clock_offset(samples)


def test_sample_clock_offset_within_round_trip_bound_of_real_skew() -> None:
    skew_ns = -3_217_000_000
    offset, rtt = sample_clock_offset(lambda: time.time_ns() + skew_ns, samples=7)
    assert rtt >= 0
    assert abs(offset - skew_ns) <= rtt // 2 + 1


def test_sample_clock_offset_rejects_zero_samples() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        sample_clock_offset(time.time_ns, samples=0)


def test_corrected_moves_span_and_events_and_records_offset() -> None:
    span = ReadableSpan(
        name="rank.read",
        attributes={"rayload.rank": 1},
        events=[Event("exception", {"exception.message": "x"}, 5_000)],
        start_time=1_000,
        end_time=9_000,
    )
    moved = corrected(span, 2_000_000, rtt_ns=400_000)
    assert (moved.start_time, moved.end_time) == (1_000 - 2_000_000, 9_000 - 2_000_000)
    assert moved.events[0].timestamp == 5_000 - 2_000_000
    assert moved.attributes["rayload.clock_offset_ms"] == 2.0
    assert moved.attributes["rayload.clock_rtt_ms"] == 0.4
    assert moved.attributes["rayload.rank"] == 1
    assert span.start_time == 1_000  # the original is untouched
