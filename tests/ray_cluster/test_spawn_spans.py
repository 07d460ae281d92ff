"""Every second of a rank actor's start-up is named: ``rayload.spawn`` has children that
cover it, on the driver's clock, and the clock-offset round trips are spans of their own
(on the trace of ``skewed_load``, the load test_trace.py reads too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from rayload.tracing import schema

pytestmark = pytest.mark.usefixtures("ray_cluster")

COVERAGE = 0.9


def _covered_ns(children: Sequence[Any]) -> int:
    """Nanoseconds of the union of the children's intervals."""
    covered, reach = 0, None
    for child in sorted(children, key=lambda s: s.start_ns):
        start = child.start_ns if reach is None else max(child.start_ns, reach)
        if child.end_ns > start:
            covered += child.end_ns - start
        reach = child.end_ns if reach is None else max(reach, child.end_ns)
    return covered


def test_spawn_spans_have_children_covering_them_on_the_driver_clock(skewed_load: Any) -> None:
    spans = skewed_load.spans  # rank 1's clock runs 5 s ahead
    spawns = {s.rank: s for s in spans if s.name == schema.SPAWN_SPAN}
    assert set(spawns) == {0, 1}
    for rank, spawn in spawns.items():
        children = [
            s
            for s in spans
            if s.rank == rank
            and s.name.startswith("rayload.spawn.")
            and "import." not in s.name
            and s.name != schema.SPAWN_CUDA_CONTEXT_SPAN
        ]
        names = {s.name for s in children}
        assert schema.SPAWN_WORKER_WAIT_SPAN in names and schema.SPAWN_ACTOR_INIT_SPAN in names
        assert schema.SPAWN_IMPORTS_SPAN in names, names
        for child in children:  # rank 1's clock runs 5 s ahead: its times are corrected
            assert spawn.start_ns <= child.start_ns <= child.end_ns <= spawn.end_ns, child.name
        assert _covered_ns(children) >= COVERAGE * (spawn.end_ns - spawn.start_ns), rank
        # CPU ranks (torch sees no CUDA here) say why they made no CUDA context.
        assert spawn.attributes["rayload.cuda_context_skipped"]
        imports = [
            s for s in spans if s.rank == rank and s.name.startswith("rayload.spawn.import.")
        ]
        assert {s.name.removeprefix("rayload.spawn.import.") for s in imports} >= {
            "torch",
            "rayload",
        }
    syncs = {s.rank: s for s in spans if s.name == schema.CLOCK_SYNC_SPAN}
    assert set(syncs) == {0, 1}
    assert abs(syncs[1].attributes["rayload.clock_offset_ms"] - skewed_load.skew_ns / 1e6) < 1000
    assert syncs[0].attributes["rayload.rounds"] >= 1
