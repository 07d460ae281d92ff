"""Run by test_multinode.py in a subprocess (one ``ray.init`` per process): a 3-node
``ray.cluster_utils.Cluster`` (a CPU-less head, two 1-CPU workers); loads with each
placement strategy, then loses the node of a hanging rank. Prints one JSON object."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.cluster_utils import Cluster

import rayload
from rayload.errors import RankFailedError
from rayload.loading.synthetic import write_checkpoint


def _load_with(path: Path, strategy: str) -> dict[str, Any]:
    with rayload.load(path, 2, device="cpu", placement_strategy=strategy) as result:
        return {
            "rank_nodes": [report.node_id for report in result.ranks],
            "bundle_nodes": [result.placement.node_ids()[rank] for rank in range(2)],
        }


def _group_node(bundle: int) -> str:
    """The node of ``bundle`` of the one created placement group, once it is placed."""
    while True:
        for table in ray.util.placement_group_table().values():
            nodes = table.get("bundles_to_node_id") or {}
            if table["state"] == "CREATED" and bundle in nodes:
                return str(nodes[bundle])
        time.sleep(0.1)


def _wait_for_process(title: str, *, timeout_s: float) -> None:
    """Wait until a process runs whose title (Ray sets it to the running task) has
    ``title``; give up quietly after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in psutil.process_iter(["cmdline"]):
            if any(title in part for part in proc.info["cmdline"] or ()):
                return
        time.sleep(0.2)


def _lose_node_of_rank_1(cluster: Cluster, path: Path) -> dict[str, Any]:
    """Rank 1 hangs in rank.read and its node is removed: whether rank 1 is still starting
    or already hanging then, the load must fail naming rank 1 and that node."""
    hang = {"fault": {"rank": 1, "phase": "rank.read", "action": "hang", "seconds": 600}}
    os.environ["RAYLOAD_TEST_HOOKS"] = json.dumps(hang)
    failure: dict[str, Any] = {}

    def load() -> None:
        try:
            rayload.load(path, 2, device="cpu", placement_strategy="SPREAD", timeout=120)
        except RankFailedError as exc:
            failure.update(rank=exc.rank, node_id=exc.node_id, message=str(exc))

    thread = threading.Thread(target=load)
    thread.start()
    lost = _group_node(1)
    _wait_for_process("ray::RankActor.load", timeout_s=60)  # most often rank 1's hang
    (node,) = [n for n in cluster.worker_nodes if n.node_id == lost]
    cluster.remove_node(node)
    thread.join(timeout=150)
    return {"lost_node": lost, "failure": failure}


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_checkpoint(Path(tmp) / "tiny-llama")
            workers = sorted(n.node_id for n in cluster.worker_nodes)
            loads = {s: _load_with(path, s) for s in ("STRICT_PACK", "PACK", "SPREAD")}
            lost = _lose_node_of_rank_1(cluster, path) if "--lose-node" in sys.argv else None
        groups = [t["state"] for t in ray.util.placement_group_table().values()]
        print(json.dumps({"workers": workers, "loads": loads, "lost": lost, "groups": groups}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
