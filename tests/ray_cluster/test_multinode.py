"""Several nodes, on one local cluster of four workers (``ray.cluster_utils.Cluster``, run
in a child process because a process gets one ``ray.init``, started in the background at
the session's start; ``multinode_script.py`` says what runs in which order):

* peers: 4 replicas of TP=2 started together read the checkpoint from storage once in all,
  measured from the ranks' ``rchar``, and every replica holds bit-identical tensors (no
  timing is asserted: that is ``rayload bench --replicas``);
* placement strategies put ranks where they say, and every rank reports its node;
* losing a rank's node fails the load naming that rank and node.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from support.background import BackgroundRuns

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def multinode(background_runs: BackgroundRuns) -> dict[str, Any]:
    # A background run (tests/conftest.py): not the Ray of this test session, but its
    # RAY_TMPDIR.
    run = background_runs.result("multinode").run
    assert run.returncode == 0, run.stderr[-4000:]
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def four_replicas(multinode: dict[str, Any]) -> dict[str, Any]:
    return dict(multinode["peers"])


def test_four_replicas_read_the_checkpoint_from_storage_once_in_all(
    four_replicas: dict[str, Any],
) -> None:
    figures = four_replicas["figures"]
    assert len(figures["rchar"]) == 8
    # Exact-read shape: one replica's shards are the checkpoint's bytes (+ replicated norms).
    assert four_replicas["shard_bytes"] >= four_replicas["checkpoint_bytes"] * 0.99
    assert figures["rchar_total"] <= 1.05 * four_replicas["shard_bytes"]
    assert figures["rchar_total"] >= four_replicas["shard_bytes"]  # somebody read it all


def test_replicas_after_the_first_read_nothing_from_storage(
    four_replicas: dict[str, Any],
) -> None:
    by_replica = four_replicas["figures"]["storage_by_replica"]
    assert by_replica[0] == four_replicas["shard_bytes"]
    assert by_replica[1:] == [0, 0, 0]
    received = [r for r in four_replicas["ranks"] if r["replica"] > 0]
    assert all(r["method"]["effective"] == "peer" for r in received)
    assert sum(r["bytes_from_peers"] for r in received) == 3 * four_replicas["shard_bytes"]


def test_every_replica_holds_tensors_bit_identical_to_replica_0(
    four_replicas: dict[str, Any],
) -> None:
    first, *others = four_replicas["digests"]
    assert sum(len(rank) for rank in first) == 2 * four_replicas["tensors"]
    assert all(replica == first for replica in others)


def test_one_replica_per_node_over_the_four_workers(multinode: dict[str, Any]) -> None:
    nodes = multinode["peers"]["figures"]["replica_nodes"]
    assert all(len(set(ranks)) == 1 for ranks in nodes)
    assert sorted(ranks[0] for ranks in nodes) == sorted(multinode["workers"])


def test_only_the_directory_outlives_the_load(four_replicas: dict[str, Any]) -> None:
    assert four_replicas["alive_after_close"] == ["rayload-peer-directory"]
    assert "CREATED" not in four_replicas["groups_after_close"]


def test_pack_strategies_put_both_ranks_on_one_worker(multinode: dict[str, Any]) -> None:
    for strategy in ("STRICT_PACK", "PACK"):
        nodes = multinode["loads"][strategy]["rank_nodes"]
        assert len(set(nodes)) == 1 and nodes[0] in multinode["workers"], strategy


def test_spread_puts_ranks_on_different_workers(multinode: dict[str, Any]) -> None:
    nodes = multinode["loads"]["SPREAD"]["rank_nodes"]
    assert len(set(nodes)) == 2 and set(nodes) <= set(multinode["workers"])


def test_each_rank_reports_the_node_of_its_bundle(multinode: dict[str, Any]) -> None:
    for strategy, seen in multinode["loads"].items():
        assert seen["rank_nodes"] == seen["bundle_nodes"], strategy


def test_losing_a_rank_node_fails_load_naming_rank_and_node(multinode: dict[str, Any]) -> None:
    lost = multinode["lost"]
    assert lost["failure"]["rank"] == 1
    assert lost["failure"]["node_id"] == lost["lost_node"]
    assert f"rank 1 on node {lost['lost_node']}" in lost["failure"]["message"]


def test_no_placement_group_outlives_its_load(multinode: dict[str, Any]) -> None:
    assert "CREATED" not in multinode["groups"]  # after the strategies' loads
    assert "CREATED" not in multinode["groups_after_lost"]  # after the failed one too
