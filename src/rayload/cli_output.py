"""What the command line shows a person: progress lines while loading, the per-rank
summary, and the ``--json`` object.

Progress is line-based (one line per event, no carriage returns) so it stays readable when
Ray prefixes or interleaves output, and it goes to stderr so ``--json`` stdout stays clean.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from rayload.loading.describe import human_bytes
from rayload.loading.report import RankReport
from rayload.progress import LoadProgress

if TYPE_CHECKING:
    from rayload.api import LoadResult


class LineProgress:
    """A ``progress`` callback that prints one line per event to ``stream``."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr

    def __call__(self, event: LoadProgress) -> None:
        if event.stage == "placed":
            line = f"placement group ready for {event.tp_size} rank(s)"
        elif event.stage == "spawned":
            line = f"{event.tp_size} rank actor(s) started, loading"
        else:
            line = (
                f"rank {event.rank} loaded {human_bytes(event.bytes_read)} in "
                f"{event.seconds:.2f} s with {event.method} on node {short_node(event.node_id)}"
                f" [{event.done}/{event.tp_size}]"
            )
        print(f"rayload: {line}", file=self.stream, flush=True)


def format_rank_table(reports: Sequence[RankReport]) -> str:
    """The per-rank summary: rank, node, device, method requested/selected/effective,
    fallback, bytes (read from storage), peer_bytes (copied from another replica, ``-``
    when none), seconds; one row per rank."""
    header = [
        "rank",
        "node",
        "device",
        "requested",
        "selected",
        "effective",
        "fallback",
        "bytes",
        "peer_bytes",
        "seconds",
    ]
    rows = [header]
    for r in sorted(reports, key=lambda r: r.rank):
        rows.append(
            [
                str(r.rank),
                short_node(r.node_id),
                r.device,
                r.method.requested.value,
                r.method.selected.value,
                r.method.effective.value,
                r.method.fallback_reason or "-",
                human_bytes(r.bytes_read),
                human_bytes(r.bytes_from_peers) if r.bytes_from_peers else "-",
                f"{r.seconds:.3f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def load_json(result: LoadResult) -> dict[str, Any]:
    """The one object ``rayload load --json`` prints (docs/design.md "Command line"), plus
    ``warnings`` (what the ranks disagreed on; empty when nothing)."""
    return {
        "trace_id": result.trace_id,
        "tp_size": result.tp_size,
        "startup_metrics": result.startup_metrics,
        "ranks": [report.to_dict() for report in result.ranks],
        "warnings": list(result.warnings),
    }


def load_summary(result: LoadResult) -> str:
    """What ``rayload load`` prints: the per-rank table, warnings, the metrics table, the
    trace id and where the trace files are."""
    from rayload.tracing import format_metrics_table

    lines = [format_rank_table(result.ranks), ""]
    lines += [f"WARNING: {warning}" for warning in result.warnings]
    lines += [format_metrics_table(result.startup_metrics), f"trace id {result.trace_id}"]
    if result.trace_files:
        lines.append("trace files:")
        lines += [f"  {fmt:7} {path}" for fmt, path in sorted(result.trace_files.items())]
    return "\n".join(lines)


def short_node(node_id: str | None) -> str:
    """The first 8 hex digits of a Ray node id: enough to tell nodes apart in a table."""
    return node_id[:8] if node_id else "?"
