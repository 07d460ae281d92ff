"""``rayload bench --replicas``: the peer benchmark's quick mode runs on a local 2-node
Cluster (in a child interpreter, the ``rayload bench`` command started in the background at
the session's start) and writes its JSON and table with every figure; figures
are checked for presence and consistency, never for speed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rayload.benchmark.peer_cluster import EXACT_SHAPE, exact_shape
from rayload.benchmark.peers import PeerBenchConfig
from rayload.errors import ConfigError
from rayload.loading.reader.reads import GATHER_GAP
from support.background import BackgroundRuns


def test_exact_shape_split_rows_are_a_page_apart_at_tp_2() -> None:
    shape = exact_shape(0.256)
    for in_features in (shape.hidden_size, shape.intermediate_size):  # o_proj, down_proj
        row = in_features * 4  # f32
        assert row - row // 2 >= GATHER_GAP
    assert shape.hidden_size == EXACT_SHAPE.hidden_size
    assert shape.vocab_size % 128 == 0 and shape.num_hidden_layers >= 1


def test_config_needs_a_node_per_replica() -> None:
    with pytest.raises(ConfigError, match="nodes must be at least 4"):
        PeerBenchConfig(replicas=(1, 4), nodes=3)
    with pytest.raises(ConfigError, match=">= 1"):
        PeerBenchConfig(replicas=(0,))
    assert PeerBenchConfig(replicas=(1, 2, 4)).worker_nodes == 4
    assert PeerBenchConfig.quick(replicas=(1,)).worker_nodes == 2


@pytest.fixture(scope="module")
def quick_run(background_runs: BackgroundRuns) -> tuple[dict[str, Any], str]:
    """``rayload bench --replicas 1 2 --quick --out OUT --workdir WORK`` (a background run:
    tests/conftest.py)."""
    done = background_runs.result("quick_run")
    assert done.run.returncode == 0, done.run.stderr[-4000:]
    (json_path,) = (done.workdir / "out").glob("bench-*.json")
    (md_path,) = (done.workdir / "out").glob("bench-*.md")
    assert json_path.stem == md_path.stem
    return json.loads(json_path.read_text()), md_path.read_text()


@pytest.mark.slow
def test_quick_mode_records_every_count_and_the_no_sharing_baseline(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    result, _ = quick_run
    rows = [(t["replicas"], t["method"]) for t in result["together"]]
    assert rows == [(1, "auto"), (2, "auto"), (2, "scratch")]
    ckpt = result["checkpoints"]["exact"]["bytes"]
    for row in result["together"]:
        assert row["rchar_total"] == sum(row["rchar"].values()) > 0
        assert len(row["rchar"]) == 2 * row["replicas"]
        assert 0 < row["population_s"] < row["wall_s"]
        assert row["shard_bytes"] >= ckpt * 0.99
    _, two, scratch = result["together"]
    assert two["bytes_from_peers"] == two["shard_bytes"]  # replica 1 received everything
    assert two["storage_by_replica"][1] == 0
    assert scratch["bytes_from_peers"] == 0
    assert scratch["storage_by_replica"] == [scratch["shard_bytes"]] * 2


@pytest.mark.slow
def test_quick_mode_records_the_pair_and_the_rates(quick_run: tuple[dict[str, Any], str]) -> None:
    result, _ = quick_run
    pair = result["pair"]
    assert set(pair) == {"holder", "peer_same_node", "peer_cross_node", "storage_cold"}
    for key in ("peer_same_node", "peer_cross_node"):
        assert pair[key]["effective"] == ["peer"]
        assert pair[key]["bytes_from_storage"] == 0
    assert pair["storage_cold"]["effective"] != ["peer"]
    assert pair["storage_cold"]["bytes_from_peers"] == 0
    assert pair["peer_same_node"]["replica_nodes"][0][0] == pair["holder"]["replica_nodes"][0][0]
    assert pair["peer_cross_node"]["replica_nodes"][0][0] != pair["holder"]["replica_nodes"][0][0]
    rates = result["rates"]
    assert all(rates[k] > 0 for k in ("same_node_MBps", "cross_node_MBps", "disk_cold_MBps"))


@pytest.mark.slow
def test_quick_mode_table_shows_the_figures_and_targets(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    result, md = quick_run
    assert result["run_id"] in md
    for heading in ("Replicas loaded together", "A new replica", "Rates in this run", "Targets"):
        assert f"## {heading}" in md
    assert "storage bytes, 2 replicas together / checkpoint" in md
    assert "rank.read speed-up vs cold" in md
    assert md.count("| peers-exact-") == 3
    names = [t["name"] for t in result["targets"]]
    assert len(names) == 4 and all(t["measured"] > 0 for t in result["targets"])
