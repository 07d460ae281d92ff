"""A Ray Serve deployment whose replica loads a TP model with rayload.

The replica owns a placement group: bundle 0 holds the replica itself and bundles 1..TP the
rank actors, which ``rayload.load`` finds and uses (``placement_group_bundles`` below).
The load runs in a worker thread from the async constructor, so the replica's event loop
never blocks and Serve routes no traffic to the replica before its weights are resident.
The routes only read results cached after the load finished, or await Ray calls off the
event loop (``asyncio.to_thread``).

    python examples/serve_deployment.py        # local Ray + Serve, one request, shut down
    serve run --app-dir examples serve_deployment:build_app checkpoint=/path/to/model tp=2

``GET /`` returns the trace id, per-rank reports and startup metrics;
``GET /shard?rank=R&name=N`` returns the shape and dtype of one rank's shard.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from ray import serve
from starlette.requests import Request

import rayload
from rayload.loading import write_checkpoint
from rayload.placement import rank_bundles

CPUS_PER_BUNDLE = 0.01  # the replica and the ranks mostly wait on I/O


class TPModel:
    """One replica = one TP group of rank actors holding the weights."""

    async def __init__(self, checkpoint: str, tp_size: int, device: str = "cpu") -> None:
        self._result = await asyncio.to_thread(
            rayload.load, checkpoint, tp_size, device=device, timeout=300
        )
        self._summary = {
            "trace_id": self._result.trace_id,
            "tp_size": self._result.tp_size,
            "ranks": [report.to_dict() for report in self._result.ranks],
            "startup_metrics": self._result.startup_metrics,
            "warnings": self._result.warnings,
        }

    async def __call__(self, request: Request) -> dict[str, Any]:
        if request.url.path.rstrip("/").endswith("/shard"):
            rank, name = int(request.query_params["rank"]), request.query_params["name"]
            shard = await asyncio.to_thread(self._result.shard, rank, name)
            return {
                "rank": rank,
                "name": name,
                "shape": list(shard.shape),
                "dtype": str(shard.dtype),
            }
        return self._summary

    def __del__(self) -> None:
        result = getattr(self, "_result", None)
        if result is not None:
            result.close()  # stops the rank actors; the group belongs to Serve


def deployment(tp_size: int, *, use_gpus: bool = False) -> Any:
    """The :class:`TPModel` deployment with a placement group sized for ``tp_size``."""
    ranks = rank_bundles(tp_size, use_gpus=use_gpus, cpus_per_rank=CPUS_PER_BUNDLE)
    return serve.deployment(
        TPModel,
        name="TPModel",
        ray_actor_options={"num_cpus": CPUS_PER_BUNDLE},
        # Bundle 0 holds the replica, bundles 1..tp_size the rank actors.
        placement_group_bundles=[{"CPU": CPUS_PER_BUNDLE}, *ranks],
        placement_group_strategy="STRICT_PACK",
    )


def build_app(args: dict[str, str]) -> Any:
    """``serve run`` builder: ``checkpoint=...`` (required) ``tp=2`` ``device=cpu``."""
    tp_size = int(args.get("tp", 2))
    device = args.get("device", "cpu")
    return deployment(tp_size, use_gpus=device == "cuda").bind(args["checkpoint"], tp_size, device)


def main() -> None:
    import ray

    ray.init()
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "tiny-llama")
        serve.run(build_app({"checkpoint": str(path), "tp": "2"}), name="rayload-example")
        with urllib.request.urlopen("http://127.0.0.1:8000/", timeout=30) as response:
            summary = json.load(response)
        print(f"trace {summary['trace_id']}, {summary['tp_size']} ranks loaded:")
        for rank in summary["ranks"]:
            print(f"  rank {rank['rank']}: {rank['bytes_read']} bytes in {rank['seconds']} s")
        serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
