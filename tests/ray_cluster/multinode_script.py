"""Run by test_multinode.py in a subprocess (one ``ray.init`` per process), on ONE local
cluster for every multi-node check: the peer benchmark's ``local_cluster(4)`` (a CPU-less
head, four workers with room for one TP=2 replica each, each its own 1 GiB object store).
In this order, since each step leaves the cluster as the next one needs it:

1. ``peers``: 4 replicas of TP=2 loaded together, cold, on a ~110 MB checkpoint whose
   shards the scratch reader reads exactly (one replica per node: no node has room for
   two), their tensors' digests, then what outlives the load;
2. ``loads``: one TP=2 load per placement strategy, on a tiny Llama;
3. ``lost``: rank 1 hangs in ``rank.read`` and its node is removed (last: the cluster has
   a node fewer afterwards).

Prints one JSON object.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import ray
import torch
from ray._private.state import actors as actor_table

import rayload
from rayload.actors.directory import DIRECTORY_NAME
from rayload.benchmark.peer_cluster import (
    LocalCluster,
    checkpoint_files,
    local_cluster,
    worker_nodes,
    write_exact_checkpoint,
)
from rayload.benchmark.peers import load_figures
from rayload.benchmark.probes import evict
from rayload.errors import RankFailedError
from rayload.loading.synthetic import write_checkpoint


def _digests(state: Any) -> dict[str, str]:
    """SHA-256 of every resident tensor's bytes on one rank."""
    return {
        name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in state.tensors.items()
    }


def _alive_actors(*, settle_s: float) -> list[str]:
    """Class (or name) of every live actor, once no rank actor is left (or ``settle_s``)."""
    deadline = time.monotonic() + settle_s
    while True:
        alive = [
            info.get("Name") or info.get("ActorClassName", "?")
            for info in actor_table().values()
            if info.get("State") == "ALIVE"
        ]
        if alive == [DIRECTORY_NAME] or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _created_groups(cluster: LocalCluster) -> list[str]:
    """States of the placement groups a load made (not those holding the nodes' CPUs)."""
    return [
        table["state"]
        for group_id, table in ray.util.placement_group_table().items()
        if group_id not in cluster.reserved
    ]


def _four_replicas(cluster: LocalCluster, root: Path) -> dict[str, Any]:
    path = write_exact_checkpoint(root / "exact", size_gb=0.11)
    trace_dir = root / "trace"
    evict(checkpoint_files(path))
    start = time.perf_counter()
    with rayload.load(path, 2, device="cpu", replicas=4, trace_dir=trace_dir) as result:
        wall = time.perf_counter() - start
        digests = result.apply(_digests)
        ranks = [r.to_dict() for r in result.ranks]
        shard_bytes = sum(r.nbytes for r in result.plan.ranks)
    return {
        "checkpoint_bytes": sum(Path(f).stat().st_size for f in checkpoint_files(path)),
        "shard_bytes": shard_bytes,
        "tensors": len(result.plan.ranks[0].shards),
        "digests": [digests[i : i + 2] for i in range(0, len(digests), 2)],
        "ranks": ranks,
        "figures": load_figures(trace_dir, ranks),
        "wall_s": wall,
        "alive_after_close": _alive_actors(settle_s=15),
        "groups_after_close": _created_groups(cluster),
    }


def _load_with(path: Path, strategy: str) -> dict[str, Any]:
    with rayload.load(path, 2, device="cpu", placement_strategy=strategy) as result:
        return {
            "rank_nodes": [report.node_id for report in result.ranks],
            "bundle_nodes": [result.placement.node_ids()[rank] for rank in range(2)],
        }


def _group_node(cluster: LocalCluster, bundle: int) -> str:
    """The node of ``bundle`` of the load's created placement group, once it is placed."""
    while True:
        for group_id, table in ray.util.placement_group_table().items():
            nodes = table.get("bundles_to_node_id") or {}
            if group_id not in cluster.reserved and table["state"] == "CREATED" and bundle in nodes:
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


def _lose_node_of_rank_1(cluster: LocalCluster, path: Path) -> dict[str, Any]:
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
    lost = _group_node(cluster, 1)
    _wait_for_process("ray::RankActor.load", timeout_s=60)  # most often rank 1's hang
    (node,) = [n for n in cluster.cluster.worker_nodes if n.node_id == lost]
    cluster.cluster.remove_node(node)
    thread.join(timeout=150)
    return {"lost_node": lost, "failure": failure}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, local_cluster(4) as cluster:
        root = Path(tmp)
        workers = worker_nodes()
        peers = _four_replicas(cluster, root)
        tiny = write_checkpoint(root / "tiny-llama")
        loads = {s: _load_with(tiny, s) for s in ("STRICT_PACK", "PACK", "SPREAD")}
        groups = _created_groups(cluster)
        lost = _lose_node_of_rank_1(cluster, tiny)
        groups_after_lost = _created_groups(cluster)
    out = {
        "workers": workers,
        "peers": peers,
        "loads": loads,
        "groups": groups,
        "lost": lost,
        "groups_after_lost": groups_after_lost,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
