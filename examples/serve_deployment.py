"""A Ray Serve deployment whose replica loads a TP model with rayload and answers with it.

The replica owns a placement group: bundle 0 holds the replica itself and bundles 1..TP the
rank actors, which ``rayload.load`` finds and uses (``placement_group_bundles`` below).
``model=build_model`` gives every rank its part of rayload's reference TP model, filled in
place from the rank's shards; the ranks form one ``torch.distributed`` group (gloo on CPU).
The load runs in a worker thread from the async constructor, so the replica's event loop
never blocks and Serve routes no traffic to the replica before its weights are resident.
Routes read results cached after the load finished, or await Ray calls off the event loop
(``asyncio.to_thread``).

    python examples/serve_deployment.py        # local Ray + Serve, one request, shut down
    serve run --app-dir examples --working-dir examples serve_deployment:build_app \\
        checkpoint=/path/to/model tp=2 max_replicas=4
    curl -X POST localhost:8000/ -d '{"token_ids": [1, 2, 3]}'     # {"top5": [...]}

(``--app-dir`` lets ``serve run`` import this file, ``--working-dir`` lets the replica.)

``replicas=N`` runs N replicas; ``max_replicas=N`` autoscales from 1 to N on the requests
waiting (:data:`AUTOSCALING`). Every replica's ``rayload.load`` goes through the cluster's
peer directory, so a replica started while another holds the checkpoint receives its
shards from that one through Ray's object store instead of reading storage: a scale-up
reads no checkpoint bytes (docs/ray.md "Peer loading").

``POST /`` with ``{"token_ids": [...]}`` returns ``{"top5": [...]}``, the 5 most likely next
tokens: one forward pass over every rank at once (its collectives need all of them), one
request at a time. A body that is not such an object is a 400 with a one-line reason.
``GET /`` (and the handle method ``load_report``) returns what this replica's load did: the
trace id, the Serve replica's id, rayload's replica id and peer key, per-rank reports
(``method.effective``, ``bytes_from_storage``, ``bytes_from_peers``, ``source``) and the
startup metrics; ``GET /shard?rank=R&name=N`` returns the shape and dtype of one rank's
shard.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import PlainTextResponse

import rayload
from rayload.loading import write_checkpoint
from rayload.models import build_model
from rayload.placement import rank_bundles

if TYPE_CHECKING:
    from rayload.api import RankState

CPUS_PER_BUNDLE = 0.01  # the replica and the ranks mostly wait on I/O

AUTOSCALING = {
    # One forward at a time per replica: a second request waiting means another helps.
    "target_ongoing_requests": 1,
    # A replica that loads from a peer is ready in seconds: scale up without waiting long.
    "upscale_delay_s": 1.0,
    "look_back_period_s": 2.0,
    # Deprecated in Ray 2.60 for RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S, still honoured.
    "metrics_interval_s": 0.5,
}
"""Serve's autoscaling options with ``max_replicas`` (min 1; Serve's defaults otherwise)."""


def vocab_size(state: RankState) -> int:
    """The model's vocabulary (every rank's forward returns logits over all of it)."""
    return int(state.model.config["vocab_size"])


def next_token_top5(state: RankState, token_ids: list[int]) -> list[int]:
    """On one rank, run with every other rank: the ids of the 5 highest next-token logits."""
    with torch.inference_mode():
        logits = state.model(torch.tensor([token_ids], device=state.device))
    return logits[0, -1].topk(5).indices.tolist()


def parse_token_ids(body: bytes, vocab: int) -> list[int]:
    """The ``token_ids`` of a request body; ValueError with a one-line reason otherwise."""
    try:
        request = json.loads(body)
    except ValueError:
        raise ValueError('the body is not JSON; send {"token_ids": [1, 2, 3]}') from None
    ids = request.get("token_ids") if isinstance(request, dict) else None
    if not isinstance(ids, list) or not ids:
        raise ValueError('send a JSON object {"token_ids": [...]} with at least one id')
    if not all(type(i) is int and 0 <= i < vocab for i in ids):
        raise ValueError(f"token_ids must be integers in [0, {vocab})")
    return ids


class TPModel:
    """One replica = one TP group of rank actors holding the model."""

    async def __init__(self, checkpoint: str, tp_size: int, device: str = "cpu") -> None:
        self._result = await asyncio.to_thread(
            rayload.load, checkpoint, tp_size, device=device, timeout=300, model=build_model
        )
        self._vocab = (await asyncio.to_thread(self._result.apply, vocab_size))[0]
        # One forward at a time: two in flight could reach the ranks in different orders
        # and cross their collectives.
        self._forward = asyncio.Lock()
        self._summary = {
            "trace_id": self._result.trace_id,
            "serve_replica": serve.get_replica_context().replica_id.unique_id,
            "replica_id": self._result.replica_ids[0],
            "peer_key": self._result.peer_key,
            "tp_size": self._result.tp_size,
            "ranks": [report.to_dict() for report in self._result.ranks],
            "startup_metrics": self._result.startup_metrics,
            "warnings": self._result.warnings,
        }

    async def load_report(self) -> dict[str, Any]:
        """What this replica's load did (as ``GET /``), for handle callers."""
        return self._summary

    async def __call__(self, request: Request) -> Any:
        if request.method == "POST":
            try:
                ids = parse_token_ids(await request.body(), self._vocab)
            except ValueError as exc:
                return PlainTextResponse(f"{exc}\n", status_code=400)
            async with self._forward:
                top5 = await asyncio.to_thread(self._result.apply, next_token_top5, ids)
            return {"top5": top5[0]}
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


def deployment(
    tp_size: int, *, use_gpus: bool = False, replicas: int = 1, max_replicas: int | None = None
) -> Any:
    """The :class:`TPModel` deployment with a placement group sized for ``tp_size``:
    ``replicas`` of it, or, with ``max_replicas``, autoscaled from 1 to that many."""
    ranks = rank_bundles(tp_size, use_gpus=use_gpus, cpus_per_rank=CPUS_PER_BUNDLE)
    scaling: dict[str, Any] = {"num_replicas": replicas}
    if max_replicas is not None:
        scaling = {
            "autoscaling_config": {"min_replicas": 1, "max_replicas": max_replicas, **AUTOSCALING}
        }
    return serve.deployment(
        TPModel,
        name="TPModel",
        ray_actor_options={"num_cpus": CPUS_PER_BUNDLE},
        # Bundle 0 holds the replica, bundles 1..tp_size the rank actors.
        placement_group_bundles=[{"CPU": CPUS_PER_BUNDLE}, *ranks],
        placement_group_strategy="STRICT_PACK",
        **scaling,
    )


def build_app(args: dict[str, str]) -> Any:
    """``serve run`` builder: ``checkpoint=...`` (required) ``tp=2`` ``device=cpu``
    ``replicas=1``, or ``max_replicas=N`` to autoscale from 1 to N replicas."""
    tp_size = int(args.get("tp", 2))
    device = args.get("device", "cpu")
    most = args.get("max_replicas")
    return deployment(
        tp_size,
        use_gpus=device == "cuda",
        replicas=int(args.get("replicas", 1)),
        max_replicas=None if most is None else int(most),
    ).bind(args["checkpoint"], tp_size, device)


def main() -> None:
    import ray

    ray.init()
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    with tempfile.TemporaryDirectory() as tmp:
        # float32, so the answers match transformers' on the same checkpoint.
        path = write_checkpoint(Path(tmp) / "tiny-llama", dtype="f32")
        serve.run(build_app({"checkpoint": str(path), "tp": "2"}), name="rayload-example")
        with urllib.request.urlopen("http://127.0.0.1:8000/", timeout=30) as response:
            summary = json.load(response)
        print(f"trace {summary['trace_id']}, {summary['tp_size']} ranks loaded:")
        for rank in summary["ranks"]:
            print(
                f"  rank {rank['rank']}: {rank['bytes_from_storage']} bytes from storage, "
                f"{rank['bytes_from_peers']} from peers, in {rank['seconds']} s"
            )
        token_ids = [1, 2, 3, 4, 5]
        post = urllib.request.Request(
            "http://127.0.0.1:8000/", data=json.dumps({"token_ids": token_ids}).encode()
        )
        with urllib.request.urlopen(post, timeout=30) as response:
            print(f"POST {token_ids} -> top5 next tokens {json.load(response)['top5']}")
        serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
