"""The timeline view shared by the Chrome trace and the HTML page: spans grouped into
processes (the driver, each rank) and placed on lanes where concurrent spans nest.

A lane is a stack: a span goes on the first lane whose open spans all either ended
before it starts or fully contain it, so spans on one lane never partially overlap
(what Chrome's trace format requires of one thread) and ``depth`` is its nesting level.
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

    def attribute(self, key: str) -> object:
        """``key`` from this process's ``rank.load`` (or root) span, None if absent."""
        for placed in self.spans:
            if placed.span.name in (schema.RANK_SPAN, schema.ROOT_SPAN):
                return (placed.span.attributes or {}).get(key)
        return None

    @property
    def main_span(self) -> ReadableSpan | None:
        """The ``rank.load`` of a rank, the ``rayload.load`` root of the driver."""
        name = schema.ROOT_SPAN if self.rank is None else schema.RANK_SPAN
        return next((p.span for p in self.spans if p.span.name == name), None)


def group_processes(spans: Sequence[ReadableSpan]) -> list[Process]:
    """The driver first, then ranks in order; each with its spans placed on lanes."""
    groups: dict[Hashable, list[ReadableSpan]] = {}
    for span in spans:
        groups.setdefault(_process_key(span), []).append(span)
    processes = [_process(members) for members in groups.values()]
    return sorted(processes, key=lambda p: (p.rank is not None, p.rank or 0, p.key))


def place_on_lanes(spans: Sequence[ReadableSpan]) -> list[Placed]:
    """Every span placed on the first lane where it nests; in start order."""
    ordered = sorted(spans, key=lambda s: (s.start_time or 0, -(s.end_time or 0)))
    lanes: list[list[int]] = []  # per lane, end times of the open (enclosing) spans
    placed: list[Placed] = []
    for span in ordered:
        start = span.start_time or 0
        end = span.end_time or start
        for index, open_ends in enumerate(lanes):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            if not open_ends or end <= open_ends[-1]:
                placed.append(Placed(span, index, len(open_ends)))
                open_ends.append(end)
                break
        else:
            lanes.append([end])
            placed.append(Placed(span, len(lanes) - 1, 0))
    return placed


def _process_key(span: ReadableSpan) -> Hashable:
    rank = span.resource.attributes.get(schema.RANK)
    if rank is not None:
        return ("rank", rank)
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
    return Process(
        key=f"rank-{rank}",
        label=f"rank {rank} ({where})",
        rank=rank,
        host=host,
        node_id=node_id,
        spans=tuple(place_on_lanes(members)),
    )
