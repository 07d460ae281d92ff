"""Clock-offset estimation between the driver and a rank's node, and span correction.

Ranks stamp their spans with their own node's wall clock, which may be off from the
driver's by milliseconds or more. The driver asks each rank for its time a few times
(Cristian's algorithm) and keeps the sample with the smallest round trip::

    driver   t_send ------------------------> t_recv
    rank                  t_remote

    offset = t_remote - (t_send + t_recv) / 2      (rank clock minus driver clock)

If the rank read its clock anywhere between ``t_send`` and ``t_recv`` (in driver time),
the estimate is within ``rtt / 2`` of the true offset, ``rtt = t_recv - t_send``.
A rank's span time ``t`` is ``t - offset`` on the driver's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.trace import Event, ReadableSpan

from rayload.tracing import schema

ClockSample = tuple[int, int, int]
"""``(t_send, t_remote, t_recv)`` in nanoseconds: driver send, rank clock, driver receive."""


def best_clock_offset(samples: Sequence[ClockSample]) -> tuple[int, int]:
    """``(offset_ns, rtt_ns)`` from the sample with the smallest round trip.

    Raises ValueError on no samples or a sample received before it was sent.
    """
    if not samples:
        raise ValueError("best_clock_offset needs at least one (t_send, t_remote, t_recv) sample")
    for t_send, _, t_recv in samples:
        if t_recv < t_send:
            raise ValueError(
                f"clock sample received before it was sent (t_send={t_send}, t_recv={t_recv}); "
                "take both times from the same driver clock"
            )
    t_send, t_remote, t_recv = min(samples, key=lambda s: s[2] - s[0])
    return t_remote - (t_send + t_recv) // 2, t_recv - t_send


def sample_clock_offset(
    remote_now: Callable[[], int],
    *,
    samples: int = 5,
    clock: Callable[[], int] = time.time_ns,
) -> tuple[int, int]:
    """Measure ``(offset_ns, rtt_ns)`` by calling ``remote_now`` ``samples`` times.

    ``remote_now`` returns the rank's wall clock in nanoseconds, e.g.
    ``lambda: ray.get(actor.now_ns.remote())``; ``clock`` is the driver's.
    """
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    taken: list[ClockSample] = []
    for _ in range(samples):
        t_send = clock()
        t_remote = remote_now()
        taken.append((t_send, t_remote, clock()))
    return best_clock_offset(taken)


def corrected(span: ReadableSpan, offset_ns: int, rtt_ns: int | None = None) -> ReadableSpan:
    """A copy of ``span`` on the driver's clock: every time moved by ``-offset_ns`` and the
    offset (and round trip, when known) recorded as ``rayload.clock_offset_ms`` /
    ``rayload.clock_rtt_ms``."""
    attributes: dict[str, Any] = dict(span.attributes or {})
    attributes[schema.CLOCK_OFFSET_MS] = offset_ns / 1e6
    if rtt_ns is not None:
        attributes[schema.CLOCK_RTT_MS] = rtt_ns / 1e6
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=attributes,
        events=[
            Event(event.name, event.attributes, event.timestamp - offset_ns)
            for event in span.events
        ],
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=None if span.start_time is None else span.start_time - offset_ns,
        end_time=None if span.end_time is None else span.end_time - offset_ns,
        instrumentation_scope=span.instrumentation_scope,
    )
