"""trace.chrome.json: complete events that nest per thread, named processes per rank."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rayload.tracing import to_chrome_trace

_NS_PER_US_TOLERANCE = 1e-3  # float rounding of ns -> us


def test_chrome_events_on_one_thread_never_partially_overlap(tp4_trace: Any) -> None:
    events = to_chrome_trace(tp4_trace.spans)["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(tp4_trace.spans)
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in complete:
        by_thread[(event["pid"], event["tid"])].append(event)
    for thread_events in by_thread.values():
        for a in thread_events:
            for b in thread_events:
                if a is b:
                    continue
                a_end, b_end = a["ts"] + a["dur"], b["ts"] + b["dur"]
                disjoint = (
                    a_end <= b["ts"] + _NS_PER_US_TOLERANCE
                    or b_end <= a["ts"] + _NS_PER_US_TOLERANCE
                )
                a_in_b = b["ts"] <= a["ts"] and a_end <= b_end + _NS_PER_US_TOLERANCE
                b_in_a = a["ts"] <= b["ts"] and b_end <= a_end + _NS_PER_US_TOLERANCE
                assert disjoint or a_in_b or b_in_a, (a["name"], b["name"])


def test_chrome_concurrent_spawns_get_separate_threads(tp4_trace: Any) -> None:
    events = to_chrome_trace(tp4_trace.spans)["traceEvents"]
    spawns = [e for e in events if e["ph"] == "X" and e["name"] == "rayload.spawn"]
    assert len(spawns) == tp4_trace.tp_size
    assert len({(e["pid"], e["tid"]) for e in spawns}) == tp4_trace.tp_size
    assert len({e["pid"] for e in spawns}) == 1


def test_chrome_processes_named_driver_and_rank_with_node(tp4_trace: Any) -> None:
    document = to_chrome_trace(tp4_trace.spans)
    names = {
        e["pid"]: e["args"]["name"]
        for e in document["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names[1].startswith("driver (")
    for rank in range(tp4_trace.tp_size):
        assert names[rank + 2] == f"rank {rank} (node {rank:02d}{'ab' * 5})"
    rank_loads = {
        e["args"]["rayload.rank"]: e["pid"]
        for e in document["traceEvents"]
        if e["ph"] == "X" and e["name"] == "rank.load"
    }
    assert rank_loads == {rank: rank + 2 for rank in range(tp4_trace.tp_size)}
    assert document["otherData"]["trace_id"] == tp4_trace.trace_id
    assert document["otherData"]["start_unix_ns"] == tp4_trace.root_start_ns
    assert min(e["ts"] for e in document["traceEvents"] if e["ph"] == "X") == 0


def test_chrome_exception_events_are_instants_on_span_thread(make_tp4_trace: Any) -> None:
    events = to_chrome_trace(make_tp4_trace(failed_rank=2).spans)["traceEvents"]
    failed = [e for e in events if e["ph"] == "X" and e["args"]["status"] == "ERROR"]
    assert sorted(e["name"] for e in failed) == ["rank.load", "rank.read"]
    instants = [e for e in events if e["ph"] == "i"]
    assert len(instants) == len(failed)
    for span in failed:
        assert any(
            (i["pid"], i["tid"]) == (span["pid"], span["tid"])
            and abs(i["ts"] - (span["ts"] + span["dur"])) < _NS_PER_US_TOLERANCE
            and i["args"]["exception.type"] == "OSError"
            for i in instants
        ), span["name"]
