"""What the command line shows a person: progress lines while loading, the per-rank
summary and the ``--json`` object of ``rayload load``, and the peer directory's table
(``rayload directory``).

Progress is line-based (one line per event, no carriage returns) so it stays readable when
Ray prefixes or interleaves output, and it goes to stderr so ``--json`` stdout stays clean.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from rayload.loading.describe import human_bytes
from rayload.loading.report import STORAGE_SOURCE, RankReport
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


def format_rank_table(reports: Sequence[RankReport], replica_ids: Sequence[str] = ()) -> str:
    """The per-rank summary, one row per rank (replica by replica): rank, node, device,
    method requested/selected/effective, fallback, bytes (read from storage), peer_bytes
    (copied from another replica, ``-`` when none), seconds.

    Columns that would say nothing are left out: ``replica`` (leading) only when a rank
    belongs to a replica other than 0, ``source`` (after fallback) only when a rank got its
    bytes from a peer: ``replica I rank R`` for replica ``I`` of this load
    (``replica_ids[I]``), ``<id> rank R on <node>`` for another load's replica.
    """
    ordered = sorted(reports, key=lambda r: (r.replica, r.rank))
    with_replica = any(r.replica != 0 for r in ordered)
    with_source = any(r.source != STORAGE_SOURCE for r in ordered)
    header = ["rank", "node", "device", "requested", "selected", "effective", "fallback"]
    header += ["source"] if with_source else []
    header += ["bytes", "peer_bytes", "seconds"]
    rows = [["replica", *header] if with_replica else header]
    for r in ordered:
        row = [
            str(r.rank),
            short_node(r.node_id),
            r.device,
            r.method.requested.value,
            r.method.selected.value,
            r.method.effective.value,
            r.method.fallback_reason or "-",
        ]
        row += [short_source(r.source, replica_ids)] if with_source else []
        row += [
            human_bytes(r.bytes_read),
            human_bytes(r.bytes_from_peers) if r.bytes_from_peers else "-",
            f"{r.seconds:.3f}",
        ]
        rows.append([str(r.replica), *row] if with_replica else row)
    return _aligned(rows)


_PEER_SOURCE = re.compile(r"peer replica=(?P<replica>\S+) rank=(?P<rank>\d+) node=(?P<node>\S+)")
"""A ``rayload.source`` naming a peer (:func:`rayload.loading.peer.source_label`)."""


def short_source(source: str, replica_ids: Sequence[str] = ()) -> str:
    """A rank's ``source`` as a table cell: ``storage``; ``replica 0 rank 1`` when the
    bytes came from replica 0 of this load (``replica_ids``); ``3f9a1c2b7d rank 1 on
    ab12cd34`` (directory id, rank, short node) from another load's replica."""
    match = _PEER_SOURCE.fullmatch(source)
    if match is None:
        return source
    replica, rank = match["replica"], match["rank"]
    if replica in replica_ids:
        return f"replica {list(replica_ids).index(replica)} rank {rank}"
    node = match["node"]
    return f"{replica} rank {rank} on {node if node == 'unknown' else short_node(node)}"


def load_json(result: LoadResult) -> dict[str, Any]:
    """The one object ``rayload load --json`` prints (docs/design.md "Command line"), plus
    ``warnings`` (what the ranks disagreed on; empty when nothing) and the replicas:
    ``replicas`` (how many), ``replica_ids`` (their ids in the peer directory, by replica
    index) and ``peer_key``. ``ranks`` lists every replica's ranks, each with its
    ``replica`` index."""
    return {
        "trace_id": result.trace_id,
        "tp_size": result.tp_size,
        "replicas": result.replicas,
        "replica_ids": list(result.replica_ids),
        "peer_key": result.peer_key,
        "startup_metrics": result.startup_metrics,
        "ranks": [report.to_dict() for report in result.ranks],
        "warnings": list(result.warnings),
    }


def replicas_line(result: LoadResult) -> str:
    """One line on the replicas: their ids in the peer directory (by replica index), the
    peer key, and the bytes they read from storage and received from peers, in all."""
    ids = list(result.replica_ids)
    if len(ids) == 1:
        who = f"replica {ids[0]}"
    elif ids:
        who = f"{len(ids)} replicas " + " ".join(f"{i}={r}" for i, r in enumerate(ids))
    else:
        who = f"{result.replicas} replica(s)"
    key = f" (peer key {result.peer_key})" if result.peer_key else ""
    storage = sum(r.bytes_from_storage for r in result.ranks)
    peers = sum(r.bytes_from_peers for r in result.ranks)
    return (
        f"{who}{key}: {human_bytes(storage)} read from storage, "
        f"{human_bytes(peers)} received from peers"
    )


def load_summary(result: LoadResult) -> str:
    """What ``rayload load`` prints: the per-rank table, the replicas line, warnings, the
    metrics table, the trace id and where the trace files are."""
    from rayload.tracing import format_metrics_table

    lines = [format_rank_table(result.ranks, result.replica_ids), replicas_line(result), ""]
    lines += [f"WARNING: {warning}" for warning in result.warnings]
    lines += [format_metrics_table(result.startup_metrics), f"trace id {result.trace_id}"]
    if result.trace_files:
        lines.append("trace files:")
        lines += [f"  {fmt:7} {path}" for fmt, path in sorted(result.trace_files.items())]
    return "\n".join(lines)


def directory_table(replicas: Sequence[Mapping[str, Any]]) -> str:
    """``rayload directory``'s table, one row per replica the peer directory knows (from
    :meth:`rayload.actors.directory.ReplicaEntry.summary`): replica, state, tp, nodes (its
    ranks' distinct nodes, short), age, key, path."""
    rows = [["replica", "state", "tp", "nodes", "age", "key", "path"]]
    for entry in replicas:
        nodes = dict.fromkeys(short_node(node) for node in entry["nodes"])
        rows.append(
            [
                str(entry["replica"]),
                str(entry["state"]),
                str(entry["tp_size"]),
                ",".join(nodes) or "-",
                human_age(float(entry["age_s"])),
                str(entry["key"]),
                str(entry["path"]),
            ]
        )
    return _aligned(rows)


def human_age(seconds: float) -> str:
    """``42.0`` -> ``"42 s"``, ``300`` -> ``"5.0 min"``, ``7200`` -> ``"2.0 h"``."""
    if seconds < 120:
        return f"{max(seconds, 0.0):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _aligned(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the header first) as left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def short_node(node_id: str | None) -> str:
    """The first 8 hex digits of a Ray node id: enough to tell nodes apart in a table."""
    return node_id[:8] if node_id else "?"
