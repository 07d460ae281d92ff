"""``rayload load``, ``rayload directory`` and ``rayload demo`` on a real Ray: the summary,
the ``--json`` object (every replica's ranks with ``--replicas``), progress on stderr, exit
codes 1 and 2 for failed loads, the peer directory's listing and ``--stop``, and a demo
from a fresh process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

import rayload
from rayload.actors.directory import DIRECTORY_NAME, NAMESPACE
from rayload.cli import main
from rayload.loading import plan_shards
from support.cli import FreshDemo

pytestmark = pytest.mark.usefixtures("ray_cluster")

RANK_KEYS = {
    "rank", "replica", "node_id", "device", "method", "bytes_read", "bytes_from_storage",
    "bytes_from_peers", "source", "tensors", "seconds", "storage", "storage_endpoint",
    "storage_bucket", "requests", "retries", "peer_switch",
}  # fmt: skip


def test_load_json_prints_one_object_with_contract_fields(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], no_leaks: object
) -> None:
    assert main(["load", str(tiny_llama), "--tp", "2", "--device", "cpu", "--json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)  # stdout is exactly one JSON object
    assert {"trace_id", "tp_size", "startup_metrics", "ranks", "replicas", "peer_key"} <= set(doc)
    assert doc["tp_size"] == 2 and len(doc["trace_id"]) == 32
    assert doc["replicas"] == 1 and len(doc["replica_ids"]) == 1
    assert doc["peer_key"].startswith("ckpt-")
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    node = ray.get_runtime_context().get_node_id()
    for rank in doc["ranks"]:
        assert set(rank) == RANK_KEYS
        assert rank["node_id"] == node and rank["device"] == "cpu"
        assert rank["method"] == {
            "requested": "auto",
            "selected": "scratch",
            "effective": "scratch",
            "fallback_reason": None,
        }
        assert rank["bytes_read"] > 0 and rank["tensors"] > 0
        assert rank["bytes_from_storage"] == rank["bytes_read"] and rank["bytes_from_peers"] == 0
        assert rank["source"] == "storage" and rank["replica"] == 0
        assert rank["storage"] == "file" and rank["storage_endpoint"] is None
        assert rank["storage_bucket"] is None and rank["retries"] == 0
    assert doc["startup_metrics"]["aggregate"]["placement_seconds"]["max"] >= 0


def test_load_with_rules_file_shards_by_it(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_leaks: object
) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text('{"rules": [{"pattern": ".*", "split": "replicate"}]}')
    argv = ["load", str(tiny_llama), "--tp", "2", "--device", "cpu", "--json"]
    assert main([*argv, "--rules", str(rules)]) == 0
    replicated = json.loads(capsys.readouterr().out)["ranks"]
    whole = plan_shards(tiny_llama, 1).ranks[0].nbytes  # every tensor, unsplit
    assert [r["bytes_read"] for r in replicated] == [whole, whole]
    # Without the file each rank would read its shard only (what every other load test
    # reads): the rules, not the checkpoint, made both read everything.
    assert all(rank.nbytes < whole for rank in plan_shards(tiny_llama, 2).ranks)


def test_load_prints_rank_table_metrics_and_progress_lines(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_leaks: object
) -> None:
    argv = ["load", str(tiny_llama), "--tp", "2", "--method", "dummy", "--device", "cpu"]
    assert main([*argv, "--trace-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    header = captured.out.splitlines()[0].split()
    assert header == [
        "rank", "node", "device", "requested", "selected", "effective", "fallback",
        "bytes", "peer_bytes", "seconds",
    ]  # fmt: skip
    assert "slowest rank" in captured.out and str(tmp_path / "trace.html") in captured.out
    loaded = [line for line in captured.err.splitlines() if " loaded " in line]
    assert len(loaded) == 2 and all(line.startswith("rayload: rank ") for line in loaded)
    assert "\r" not in captured.err


def test_load_rank_failure_exits_1_with_one_line_naming_rank_and_node(
    tiny_llama: Path,
    set_test_hooks: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
    no_leaks: object,
) -> None:
    set_test_hooks(fault={"rank": 1, "phase": "rank.read", "action": "exit"})
    assert main(["load", str(tiny_llama), "--tp", "2", "--device", "cpu", "--json"]) == 1
    captured = capsys.readouterr()
    assert "trace_id" not in captured.out, "no JSON object for a failed load"
    node = ray.get_runtime_context().get_node_id()
    errors = [line for line in captured.err.splitlines() if line.startswith("rayload: error")]
    assert len(errors) == 1 and f"rank 1 on node {node}" in errors[0]
    assert "actor died" in errors[0] and "Traceback" not in captured.err


def test_load_strict_method_fallback_exits_2(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], no_leaks: object
) -> None:
    argv = ["load", str(tiny_llama), "--tp", "1", "--method", "fastsafetensors_gdr"]
    assert main([*argv, "--strict-method", "--device", "cpu"]) == 2
    assert "rank 0 on node" in capsys.readouterr().err


def test_load_replicas_json_lists_every_replicas_ranks_and_replica_1_reads_no_storage(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], no_leaks: object
) -> None:
    argv = ["load", str(tiny_llama), "--tp", "2", "--replicas", "2", "--device", "cpu"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["replicas"] == 2 and len(set(doc["replica_ids"])) == 2
    assert [(r["replica"], r["rank"]) for r in doc["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first, second = doc["ranks"][:2], doc["ranks"][2:]
    plan = plan_shards(tiny_llama, 2)
    for rank in first:
        assert rank["source"] == "storage" and rank["bytes_from_storage"] > 0
        assert rank["bytes_from_peers"] == 0
    for rank in second:
        assert rank["method"]["effective"] == "peer" and rank["method"]["fallback_reason"] is None
        assert rank["bytes_from_storage"] == 0
        assert rank["bytes_from_peers"] == plan.ranks[rank["rank"]].nbytes
        assert rank["source"].startswith(f"peer replica={doc['replica_ids'][0]} ")
    agg = doc["startup_metrics"]["aggregate"]
    assert agg["bytes_from_peers"]["total"] == sum(r.nbytes for r in plan.ranks)


def test_directory_lists_a_loaded_replica_no_peers_load_is_not_listed_and_stop_ends_it(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], no_leaks: object
) -> None:
    node = ray.get_runtime_context().get_node_id()
    with rayload.load(tiny_llama, 2, device="cpu") as held:
        (replica_id,) = held.replica_ids
        # A --no-peers load reads storage although `held` has its bytes, and is not listed.
        argv = ["load", str(tiny_llama), "--tp", "2", "--device", "cpu", "--no-peers", "--json"]
        assert main(argv) == 0
        ranks = json.loads(capsys.readouterr().out)["ranks"]
        assert [r["source"] for r in ranks] == ["storage", "storage"]
        assert all(r["bytes_from_storage"] > 0 for r in ranks)

        assert main(["directory", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["running"] and doc["directory"] == DIRECTORY_NAME
        (entry,) = [e for e in doc["replicas"] if e["key"] == held.peer_key]
        assert entry["replica"] == replica_id and entry["state"] == "loaded"
        assert entry["tp_size"] == 2 and entry["nodes"] == [node, node]
        assert entry["path"] == str(tiny_llama) and entry["age_s"] >= 0

        assert main(["directory"]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split() == ["replica", "state", "tp", "nodes", "age", "key", "path"]
        (row,) = [line.split() for line in table[1:] if line.startswith(replica_id)]
        assert row[1:4] == ["loaded", "2", node[:8]]
        assert row[-2:] == [held.peer_key, str(tiny_llama)]

        assert main(["directory", "--stop"]) == 0
        out = capsys.readouterr().out
        assert replica_id in out and "stopped the peer directory" in out
        with pytest.raises(ValueError):
            ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)

    assert main(["directory"]) == 0
    assert capsys.readouterr().out.startswith("no peer directory on this cluster")
    assert main(["directory", "--stop", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "directory": DIRECTORY_NAME,
        "namespace": NAMESPACE,
        "running": False,
        "replicas": [],
        "stopped": False,
    }


def test_demo_in_process_writes_traces_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_leaks: object
) -> None:
    trace_dir = tmp_path / "demo-traces"
    assert main(["demo", "--trace-dir", str(trace_dir)]) == 0
    out = capsys.readouterr().out
    assert f"traces in {trace_dir}" in out
    assert {p.name for p in trace_dir.iterdir()} >= {
        "trace.otlp.json",
        "trace.jaeger.json",
        "trace.chrome.json",
        "trace.html",
    }


@pytest.mark.slow
def test_demo_from_fresh_process_starts_and_stops_its_own_ray(fresh_demo: FreshDemo) -> None:
    run = fresh_demo.run  # tests/conftest.py: a fresh process with no RAY_* in its env
    assert run.returncode == 0, run.stderr[-2000:]
    assert (fresh_demo.trace_dir / "trace.html").is_file()
    assert "rank 1 loaded" in run.stderr
