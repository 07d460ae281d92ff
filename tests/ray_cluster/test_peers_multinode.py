"""Peer loading across nodes (ray.cluster_utils.Cluster of 4 workers, run in a subprocess
because a process gets one ``ray.init``): 4 replicas of TP=2 started together read the
checkpoint from storage once in all, measured from the ranks' ``rchar``, and every replica
holds bit-identical tensors. No timing is asserted (that is ``rayload bench --replicas``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("peers_multinode_script.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def four_replicas() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY")}
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=400
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


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


def test_one_replica_per_node_over_the_four_workers(four_replicas: dict[str, Any]) -> None:
    nodes = four_replicas["figures"]["replica_nodes"]
    assert all(len(set(ranks)) == 1 for ranks in nodes)
    assert sorted(ranks[0] for ranks in nodes) == sorted(four_replicas["workers"])


def test_only_the_directory_outlives_the_load(four_replicas: dict[str, Any]) -> None:
    assert four_replicas["alive_after_close"] == ["rayload-peer-directory"]
    assert "CREATED" not in four_replicas["groups_after_close"]
