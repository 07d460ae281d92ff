"""Run by test_peers_multinode.py in a subprocess (one ``ray.init`` per process): a 4-node
``ray.cluster_utils.Cluster`` (a CPU-less head, four workers with room for one replica
each, each its own 1 GiB object store); 4 replicas of TP=2 loaded together, cold, on a
~110 MB checkpoint whose shards the scratch reader reads exactly. Prints one JSON object."""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray._private.state import actors as actor_table

import rayload
from rayload.actors.directory import DIRECTORY_NAME
from rayload.benchmark.peer_cluster import (
    checkpoint_files,
    local_cluster,
    worker_nodes,
    write_exact_checkpoint,
)
from rayload.benchmark.peers import load_figures
from rayload.benchmark.probes import evict


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


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, local_cluster(4) as cluster:
        path = write_exact_checkpoint(Path(tmp) / "ckpt", size_gb=0.11)
        trace_dir = Path(tmp) / "trace"
        evict(checkpoint_files(path))
        start = time.perf_counter()
        with rayload.load(path, 2, device="cpu", replicas=4, trace_dir=trace_dir) as result:
            wall = time.perf_counter() - start
            digests = result.apply(_digests)
            ranks = [r.to_dict() for r in result.ranks]
            shard_bytes = sum(r.nbytes for r in result.plan.ranks)
        figures = load_figures(trace_dir, ranks)
        out = {
            "workers": worker_nodes(),
            "checkpoint_bytes": sum(Path(f).stat().st_size for f in checkpoint_files(path)),
            "shard_bytes": shard_bytes,
            "tensors": len(result.plan.ranks[0].shards),
            "digests": [digests[i : i + 2] for i in range(0, len(digests), 2)],
            "ranks": ranks,
            "figures": figures,
            "wall_s": wall,
            "alive_after_close": _alive_actors(settle_s=15),
            "groups_after_close": [
                table["state"]
                for group_id, table in ray.util.placement_group_table().items()
                if group_id not in cluster.reserved  # what holds the nodes' other CPUs
            ],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
