"""Several nodes (ray.cluster_utils.Cluster, run in a subprocess because a process gets one
``ray.init``): placement strategies put ranks where they say, every rank reports the node
it runs on, and losing a rank's node fails the load naming that rank and node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("multinode_script.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def multinode() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY")}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--lose-node"],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def test_pack_strategies_put_both_ranks_on_one_worker(multinode: dict[str, Any]) -> None:
    for strategy in ("STRICT_PACK", "PACK"):
        nodes = multinode["loads"][strategy]["rank_nodes"]
        assert len(set(nodes)) == 1 and nodes[0] in multinode["workers"], strategy


def test_spread_puts_ranks_on_different_workers(multinode: dict[str, Any]) -> None:
    nodes = multinode["loads"]["SPREAD"]["rank_nodes"]
    assert sorted(nodes) == multinode["workers"]


def test_each_rank_reports_the_node_of_its_bundle(multinode: dict[str, Any]) -> None:
    for strategy, seen in multinode["loads"].items():
        assert seen["rank_nodes"] == seen["bundle_nodes"], strategy


def test_losing_a_rank_node_fails_load_naming_rank_and_node(multinode: dict[str, Any]) -> None:
    lost = multinode["lost"]
    assert lost["failure"]["rank"] == 1
    assert lost["failure"]["node_id"] == lost["lost_node"]
    assert f"rank 1 on node {lost['lost_node']}" in lost["failure"]["message"]


def test_no_placement_group_outlives_its_load(multinode: dict[str, Any]) -> None:
    assert "CREATED" not in multinode["groups"]
