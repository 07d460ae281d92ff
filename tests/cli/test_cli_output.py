"""What ``rayload load`` and ``rayload directory`` print, from reports built here: the rank
table's replica and source columns (shown only when they say something), the short peer
source, and the directory's table."""

from __future__ import annotations

import dataclasses

from rayload.cli_output import directory_table, format_rank_table, human_age, short_source
from rayload.loading.methods import LoadMethod, MethodReport
from rayload.loading.report import RankReport

NODE_A, NODE_B = "a" * 56, "b" * 56


def _report(replica: int, rank: int, source: str = "storage") -> RankReport:
    from_peer = source != "storage"
    effective = LoadMethod.PEER if from_peer else LoadMethod.SCRATCH
    return RankReport(
        rank=rank,
        tp_size=2,
        device="cpu",
        method=MethodReport(LoadMethod.AUTO, effective, effective, None),
        bytes_read=0 if from_peer else 1024,
        bytes_from_peers=1024 if from_peer else 0,
        tensors=3,
        start_ns=0,
        end_ns=250_000_000,
        node_id=NODE_A,
        source=source,
        replica=replica,
    )


def _peer(replica: str, rank: int, node: str = NODE_A) -> str:
    return f"peer replica={replica} rank={rank} node={node}"


def test_rank_table_of_replicas_has_replica_and_source_columns_in_replica_order() -> None:
    reports = [_report(1, 1, _peer("r0", 1)), _report(0, 1), _report(1, 0, _peer("r0", 0))]
    lines = format_rank_table([*reports, _report(0, 0)], ["r0", "r1"]).splitlines()
    assert lines[0].split() == [
        "replica", "rank", "node", "device", "requested", "selected", "effective", "fallback",
        "source", "bytes", "peer_bytes", "seconds",
    ]  # fmt: skip
    rows = [line.split() for line in lines[1:]]
    assert [row[:2] for row in rows] == [["0", "0"], ["0", "1"], ["1", "0"], ["1", "1"]]
    at = lines[0].index("source")
    assert [line[at:].split("  ")[0] for line in lines[1:]] == [
        "storage", "storage", "replica 0 rank 0", "replica 0 rank 1",
    ]  # fmt: skip
    assert rows[2][-5:] == ["0", "B", "1.00", "KiB", "0.250"]
    assert all(line.index("cpu") == lines[0].index("device") for line in lines[1:])


def test_rank_table_of_one_replica_from_storage_has_neither_column() -> None:
    header = format_rank_table([_report(0, 0)], ["r0"]).splitlines()[0].split()
    assert "replica" not in header and "source" not in header


def test_short_source_names_another_loads_replica_by_id_rank_and_short_node() -> None:
    assert short_source("storage") == "storage"
    assert short_source(_peer("r1", 0), ["r1"]) == "replica 0 rank 0"
    assert short_source(_peer("3f9a1c2b7d", 1, NODE_B), ["r0"]) == "3f9a1c2b7d rank 1 on bbbbbbbb"
    assert short_source(_peer("3f9a", 1, "unknown")) == "3f9a rank 1 on unknown"
    assert short_source("something else") == "something else"


def test_directory_table_lists_state_tp_distinct_nodes_age_key_and_path() -> None:
    entry = {
        "replica": "3f9a1c2b7d",
        "key": "ckpt-0123456789ab.plan-ba9876543210",
        "path": "/models/llama",
        "tp_size": 4,
        "state": "loaded",
        "job": "01000000",
        "nodes": [NODE_A, NODE_A, NODE_B, NODE_B],
        "age_s": 312.0,
    }
    lines = directory_table([entry, {**entry, "replica": "77", "state": "loading"}]).splitlines()
    assert lines[0].split() == ["replica", "state", "tp", "nodes", "age", "key", "path"]
    assert lines[1].split() == [
        "3f9a1c2b7d", "loaded", "4", "aaaaaaaa,bbbbbbbb", "5.2", "min", entry["key"],
        "/models/llama",
    ]  # fmt: skip
    assert lines[2].split()[:2] == ["77", "loading"]


def test_human_age_uses_seconds_minutes_then_hours() -> None:
    assert [human_age(s) for s in (0.4, 42, 300, 7200)] == ["0 s", "42 s", "5.0 min", "2.0 h"]


def test_rank_table_copes_with_a_report_without_replica_ids() -> None:
    report = dataclasses.replace(_report(0, 0, _peer("elsewhere", 0)))
    row = format_rank_table([report]).splitlines()[1]
    assert "elsewhere rank 0 on aaaaaaaa" in row
