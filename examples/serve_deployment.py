"""A Ray Serve deployment whose replica holds a TP model loaded by rayload, and answers with
it. Only the model's own code is here; the replica's placement bundles, its load, the load
report and the typed args come from :mod:`rayload.serve`.

    python examples/serve_deployment.py        # local Ray + Serve, one request, shut down
    rayload make-checkpoint /tmp/rayload-example --dtype f32
    PYTHONPATH=examples serve run examples/serve_config.yaml   # or: serve deploy (a cluster)
    curl -X POST localhost:8000/ -d '{"token_ids": [1, 2, 3]}'     # {"top5": [...]}

(``PYTHONPATH=examples`` lets the Serve controller and the replicas import this file: the
config's ``import_path`` is ``serve_deployment:build_app``.) The args are
:class:`rayload.serve.ServeArgs`: ``load`` (a :class:`rayload.LoadConfig`), ``replicas``,
or ``max_replicas`` to autoscale from 1 on waiting requests. A replica started while
another holds the checkpoint receives its shards from that one instead of reading storage
(docs/ray.md "Peer loading").

``POST /`` with ``{"token_ids": [...]}`` returns ``{"top5": [...]}``, the 5 most likely next
tokens: one forward pass over every rank at once (its collectives need all of them), one
request at a time. A body that is not such an object is a 400 with a one-line reason.
``GET /`` (and the handle method ``load_report``) returns what this replica's load did;
``GET /shard?rank=R&name=N`` the shape and dtype of one rank's shard.
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
from rayload.serve import TPReplica, application, parse_token_ids

if TYPE_CHECKING:
    from rayload.api import RankState


def vocab_size(state: RankState) -> int:
    """The model's vocabulary (every rank's forward returns logits over all of it)."""
    return int(state.model.config["vocab_size"])


def next_token_top5(state: RankState, token_ids: list[int]) -> list[int]:
    """On one rank, run with every other rank: the ids of the 5 highest next-token logits."""
    with torch.inference_mode():
        logits = state.model(torch.tensor([token_ids], device=state.device))
    return logits[0, -1].topk(5).indices.tolist()


class TPModel(TPReplica):
    """One replica = one TP group of rank actors holding the model."""

    async def __init__(self, *args: Any) -> None:
        await super().__init__(*args)
        self._vocab = (await asyncio.to_thread(self.result.apply, vocab_size))[0]
        # One forward at a time: two in flight could reach the ranks in different orders
        # and cross their collectives.
        self._forward = asyncio.Lock()

    async def __call__(self, request: Request) -> Any:
        if request.method == "POST":
            try:
                ids = parse_token_ids(await request.body(), self._vocab)
            except ValueError as exc:
                return PlainTextResponse(f"{exc}\n", status_code=400)
            async with self._forward:
                top5 = await asyncio.to_thread(self.result.apply, next_token_top5, ids)
            return {"top5": top5[0]}
        if request.url.path.rstrip("/").endswith("/shard"):
            rank, name = int(request.query_params["rank"]), request.query_params["name"]
            shard = await asyncio.to_thread(self.result.shard, rank, name)
            return {
                "rank": rank,
                "name": name,
                "shape": list(shard.shape),
                "dtype": str(shard.dtype),
            }
        return await super().__call__(request)


def build_app(args: dict[str, Any]) -> Any:
    """The builder ``serve run``/``serve deploy`` call with ``applications[].args``
    (:class:`rayload.serve.ServeArgs`)."""
    return application(TPModel, args, model=build_model)


def main() -> None:
    import ray

    ray.init()
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    with tempfile.TemporaryDirectory() as tmp:
        # float32, so the answers match transformers' on the same checkpoint.
        path = write_checkpoint(Path(tmp) / "tiny-llama", dtype="f32")
        config = rayload.LoadConfig(path=str(path), tp_size=2, device="cpu", timeout=300)
        serve.run(build_app({"load": config}), name="rayload-example")
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
