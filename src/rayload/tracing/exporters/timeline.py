"""The timeline view shared by the Chrome trace and the HTML page: spans grouped into
processes (the driver, each rank) and placed on lanes where concurrent spans nest.

A lane is a stack of open spans: a span goes on the first lane where, once the spans
that ended before it starts are closed, nothing is open or the innermost open span is
one of its ancestors and contains it. So spans on one lane never partially overlap (what
Chrome's trace format requires of one thread), a span is drawn under its parent only,
never under an unrelated span that happens to contain it (concurrent ``rayload.spawn``
spans get a lane each), and ``depth`` is its nesting level on the lane.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from opentelemetry.sdk.trace import ReadableSpan

from rayload.tracing import schema


@dataclass(frozen=True)
class Placed:
    """A span on the timeline: ``lane`` (a Chrome thread), ``depth`` (nesting on that lane)."""

    span: ReadableSpan
    lane: int
    depth: int

    @property
    def start_ns(self) -> int:
        return self.span.start_time or 0

    @property
    def end_ns(self) -> int:
        return self.span.end_time or self.start_ns


@dataclass(frozen=True)
class Process:
    """The spans one process recorded: the driver (``rank`` None) or one rank."""

    key: str
    label: str
    rank: int | None
    host: str
    node_id: str | None
    spans: tuple[Placed, ...]
    replica: int | None = None

    def attribute(self, key: str) -> object:
        """``key`` from this process's ``rank.load`` (or root) span, None if absent."""
        for placed in self.spans:
            if placed.span.name in (schema.RANK_SPAN, *schema.ROOT_SPANS):
                return (placed.span.attributes or {}).get(key)
        return None

    @property
    def main_span(self) -> ReadableSpan | None:
        """The ``rank.load`` of a rank, the root (``rayload.load``, ``rayload.reload``) of
        the driver."""
        names = schema.ROOT_SPANS if self.rank is None else (schema.RANK_SPAN,)
        return next((p.span for p in self.spans if p.span.name in names), None)


def group_processes(spans: Sequence[ReadableSpan]) -> list[Process]:
    """The driver first, then ranks in order (by replica, then rank, in a load of several
    replicas); each with its spans placed on lanes."""
    groups: dict[Hashable, list[ReadableSpan]] = {}
    for span in spans:
        groups.setdefault(_process_key(span), []).append(span)
    processes = [_process(members) for members in groups.values()]
    return sorted(processes, key=lambda p: (p.rank is not None, p.replica or 0, p.rank or 0, p.key))


def place_on_lanes(spans: Sequence[ReadableSpan]) -> list[Placed]:
    """Every span placed on the first lane where it nests under an ancestor; in start order."""
    parents = {
        s.context.span_id: s.parent.span_id for s in spans if s.context and s.parent is not None
    }
    ancestors = {
        s.context.span_id: _ancestors(s.context.span_id, parents) for s in spans if s.context
    }

    def order(span: ReadableSpan) -> tuple[int, int, int, int]:
        # Parents before their children; siblings starting together by rank, then longest.
        depth = len(ancestors.get(span.context.span_id, ())) if span.context else 0
        rank = (span.attributes or {}).get(schema.RANK, -1)
        return span.start_time or 0, depth, int(rank), -(span.end_time or 0)  # type: ignore[arg-type]

    ordered = sorted(spans, key=order)
    lanes: list[list[tuple[int, int]]] = []  # per lane, (end, span id) of the open spans
    placed: list[Placed] = []
    for span in ordered:
        start = span.start_time or 0
        end = span.end_time or start
        span_id = span.context.span_id if span.context else 0
        for index, open_spans in enumerate(lanes):
            while open_spans and open_spans[-1][0] <= start:
                open_spans.pop()
            if not open_spans or (
                end <= open_spans[-1][0] and open_spans[-1][1] in ancestors.get(span_id, ())
            ):
                placed.append(Placed(span, index, len(open_spans)))
                open_spans.append((end, span_id))
                break
        else:
            lanes.append([(end, span_id)])
            placed.append(Placed(span, len(lanes) - 1, 0))
    return placed


def _ancestors(span_id: int, parents: dict[int, int]) -> set[int]:
    found: set[int] = set()
    while span_id in parents and parents[span_id] not in found:
        span_id = parents[span_id]
        found.add(span_id)
    return found


def _process_key(span: ReadableSpan) -> Hashable:
    rank = span.resource.attributes.get(schema.RANK)
    if rank is not None:
        return ("rank", span.resource.attributes.get(schema.REPLICA, 0), rank)
    return ("service", span.resource.attributes.get("service.name"), span.resource)


def _process(members: list[ReadableSpan]) -> Process:
    resource = members[0].resource.attributes
    host = str(resource.get("host.name", "unknown"))
    rank_value = resource.get(schema.RANK)
    if rank_value is None:
        return Process(
            key="driver",
            label=f"driver ({host})",
            rank=None,
            host=host,
            node_id=None,
            spans=tuple(place_on_lanes(members)),
        )
    rank = int(rank_value)  # type: ignore[arg-type]
    node_id = next(
        (
            str(s.attributes[schema.NODE_ID])
            for s in members
            if s.attributes and schema.NODE_ID in s.attributes
        ),
        None,
    )
    where = f"node {node_id[:12]}" if node_id else f"host {host}"
    replica = resource.get(schema.REPLICA)
    who = f"rank {rank}" if replica is None else f"replica {replica} rank {rank}"
    return Process(
        key=f"rank-{rank}" if replica is None else f"replica-{replica}-rank-{rank}",
        label=f"{who} ({where})",
        rank=rank,
        host=host,
        node_id=node_id,
        spans=tuple(place_on_lanes(members)),
        replica=None if replica is None else int(replica),  # type: ignore[arg-type]
    )
