"""``rayload.connect`` has children that say what ``ray.init`` did: on a real local Ray
start (a spawned interpreter: forking after torch's threads can hang) they cover at least
90% of it, and on recorded events the builder merges what it did not see."""

from __future__ import annotations

import itertools
import multiprocessing
import time
from collections.abc import Sequence
from typing import Any

import pytest

from rayload.tracing import connect_spans, schema
from rayload.tracing.connect_spans import ConnectRecord, connect_phases
from rayload.tracing.spawn_spans import SpawnPhase
from rayload.tracing.trace import StartupTrace

COVERAGE = 0.9
MS = 1_000_000


def _flat(phases: Sequence[SpawnPhase], depth: int = 0) -> list[tuple[int, str, int, int]]:
    rows = []
    for p in phases:
        rows.append((depth, p.name, p.start_ns, p.end_ns))
        rows += _flat(p.children, depth + 1)
    return rows


def _start_local_ray(queue: Any) -> None:
    import ray

    from rayload import cluster

    try:
        record = cluster.connect_recorded("local", deadline=time.monotonic() + 120)
        queue.put((record, _flat(connect_phases(record))))
    finally:
        ray.shutdown()


def _covered(rows: Sequence[tuple[int, str, int, int]], depth: int) -> int:
    return sum(end - start for d, _, start, end in rows if d == depth)


@pytest.mark.ray
def test_connect_children_cover_a_local_ray_start() -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_start_local_ray, args=(queue,))
    child.start()
    record, rows = queue.get(timeout=180)
    child.join(timeout=60)
    assert record.started_ray and record.init_start_ns is not None
    assert set(record.events) >= {
        connect_spans.GCS_CREATED,
        connect_spans.RAYLET_CREATED,
        connect_spans.RAYLET_REGISTERED,
    }, record.events
    total = record.end_ns - record.start_ns
    top = [r for r in rows if r[0] == 0]
    names = [name for _, name, _, _ in top]
    assert names[0] in (schema.CONNECT_ADDRESS_SPAN, schema.CONNECT_GCS_SPAN), names
    assert {schema.CONNECT_GCS_SPAN, schema.CONNECT_RAYLET_SPAN, schema.CONNECT_DRIVER_SPAN} <= set(
        names
    )
    for (_, _, _, end), (_, _, start, _) in itertools.pairwise(top):
        assert end == start  # consecutive, no overlap
    assert _covered(rows, 0) >= COVERAGE * total, (rows, total)
    for depth, name, start, end in top:
        inner = [
            r
            for r in rows
            if r[0] == depth + 1 and r[1].startswith(name + ".") and start <= r[2] < end
        ]
        if inner:
            assert sum(e - s for _, _, s, e in inner) >= COVERAGE * (end - start), name


def test_connect_phases_merge_unobserved_events_into_the_next_span() -> None:
    t = 1_000_000 * MS
    record = ConnectRecord(
        t,
        t + 5000 * MS,
        started_ray=True,
        init_start_ns=t + 1 * MS,
        init_end_ns=t + 5000 * MS,
        events={
            connect_spans.GCS_CREATED: t + 10 * MS,
            # no monitor seen: the dashboard span starts where the gcs one would have
            connect_spans.LOG_MONITOR_CREATED: t + 1000 * MS,
            connect_spans.AGENTS_CREATED: t + 1100 * MS,
            connect_spans.AGENTS_READY: t + 3000 * MS,
            connect_spans.RAYLET_REGISTERED: t + 3100 * MS,
            connect_spans.CORE_WORKER_STARTED: t + 9000 * MS,  # after ray.init: not trusted
        },
    )
    rows = _flat(connect_phases(record))
    assert [(d, n) for d, n, _, _ in rows] == [
        (0, schema.CONNECT_ADDRESS_SPAN),
        (0, schema.CONNECT_DASHBOARD_SPAN),
        (0, schema.CONNECT_RAYLET_SPAN),
        (1, schema.CONNECT_RAYLET_START_SPAN),
        (1, schema.CONNECT_RAYLET_AGENTS_SPAN),
        (1, schema.CONNECT_RAYLET_REGISTER_SPAN),
        (0, schema.CONNECT_DRIVER_SPAN),
    ]
    assert rows[1][2:] == (t + 1 * MS, t + 1000 * MS)
    assert rows[-1][2:] == (t + 3100 * MS, t + 5000 * MS)


def test_connect_phases_leave_a_span_whole_when_its_events_are_out_of_order() -> None:
    t = 1_000_000 * MS
    record = ConnectRecord(
        t,
        t + 3000 * MS,
        started_ray=True,
        init_start_ns=t,
        init_end_ns=t + 3000 * MS,
        events={
            connect_spans.MONITOR_CREATED: t + 100 * MS,
            connect_spans.DASHBOARD_CREATED: t + 300 * MS,
            connect_spans.DASHBOARD_LOGGED: t + 1500 * MS,  # after Ray went on: not inside
            connect_spans.LOG_MONITOR_CREATED: t + 1000 * MS,
            connect_spans.RAYLET_REGISTERED: t + 2000 * MS,
        },
    )
    rows = _flat(connect_phases(record))
    assert [(d, n) for d, n, _, _ in rows] == [
        (0, schema.CONNECT_GCS_SPAN),
        (0, schema.CONNECT_DASHBOARD_SPAN),
        (0, schema.CONNECT_RAYLET_SPAN),
        (0, schema.CONNECT_DRIVER_SPAN),
    ]


def test_connect_phases_of_a_joined_cluster_are_address_then_driver() -> None:
    t = 1_000_000 * MS
    record = ConnectRecord(
        t, t + 900 * MS, True, init_start_ns=t + 20 * MS, init_end_ns=t + 900 * MS
    )
    rows = _flat(connect_phases(record))
    assert [n for _, n, _, _ in rows] == [schema.CONNECT_ADDRESS_SPAN, schema.CONNECT_DRIVER_SPAN]
    assert connect_phases(ConnectRecord(t, t + MS, started_ray=False)) == ()


def test_add_connect_spans_records_the_tree_under_the_root() -> None:
    t = time.time_ns()
    record = ConnectRecord(
        t, t + 900 * MS, True, init_start_ns=t + 20 * MS, init_end_ns=t + 900 * MS
    )
    trace = StartupTrace(tp_size=1, start_ns=t - MS)
    connect_spans.add_connect_spans(trace, record)
    spans = {s.name: s for s in trace.finish()}
    connect = spans[schema.CONNECT_SPAN]
    assert connect.attributes is not None and connect.attributes["rayload.ray.started"] is True
    for name in (schema.CONNECT_ADDRESS_SPAN, schema.CONNECT_DRIVER_SPAN):
        parent = spans[name].parent
        assert parent is not None and parent.span_id == connect.context.span_id
