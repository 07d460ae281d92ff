"""examples/serve_deployment.py under Ray Serve on the session cluster: the replica's ranks
run in the replica's own placement group, an HTTP GET returns the startup metrics and trace
id, a POST answers the next-token top 5 of the TP forward over the ranks (held to
transformers on the same float32 checkpoint), a bad body is a 400, and ``serve.shutdown()``
leaves no actor or placement group behind."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from ray import serve
from ray.util.state import list_actors

from rayload.loading import write_checkpoint
from support.transformers_models import reference_logits

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]


@pytest.fixture(scope="module")
def f32_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic tiny Llama in float32: the TP forward and transformers agree on it."""
    return write_checkpoint(tmp_path_factory.mktemp("f32-llama") / "ckpt", dtype="f32")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.load(response)


def _post(url: str, body: bytes) -> tuple[int, str]:
    """(status, body) of a POST, error statuses included."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _transformers_top5(checkpoint: Path, token_ids: list[int]) -> list[int]:
    logits = reference_logits(checkpoint, torch.tensor([token_ids]))
    return logits[0, -1].topk(5).indices.tolist()


def test_serve_replica_loads_into_its_placement_group_and_answers_top5(
    serve_example: ModuleType, f32_llama: Path, ray_cluster: Any, unused_port: int, no_leaks: object
) -> None:
    url = f"http://127.0.0.1:{unused_port}/"
    serve.start(http_options={"host": "127.0.0.1", "port": unused_port})
    try:
        app = serve_example.build_app({"checkpoint": str(f32_llama), "tp": "2"})
        serve.run(app, name="rayload-test", route_prefix="/")
        summary = _get(url)
        assert len(summary["trace_id"]) == 32 and summary["tp_size"] == 2
        assert [r["rank"] for r in summary["ranks"]] == [0, 1]
        assert all(r["node_id"] == ray_cluster.node_id for r in summary["ranks"])
        assert summary["startup_metrics"]["aggregate"]["total_model_loading_seconds"]["max"] > 0

        shard = _get(f"{url}shard?rank=1&name=model.norm.weight")
        assert shard["rank"] == 1 and shard["shape"] and shard["dtype"].startswith("torch.")

        for token_ids in ([1, 2, 3], [7, 300, 42, 511, 0, 5]):
            status, body = _post(url, json.dumps({"token_ids": token_ids}).encode())
            assert status == 200, body
            assert json.loads(body) == {"top5": _transformers_top5(f32_llama, token_ids)}

        for bad in (b"not json", b"[1, 2]", b'{"token_ids": []}', b'{"token_ids": [1, 512]}'):
            status, body = _post(url, bad)
            assert status == 400, (bad, status, body)
            assert len(body.strip().splitlines()) == 1 and "token_ids" in body, body

        alive = list_actors(
            address=ray_cluster.state_address, filters=[("state", "=", "ALIVE")], detail=True
        )
        (replica,) = [a for a in alive if a.class_name.startswith("ServeReplica")]
        ranks = [a for a in alive if a.class_name == "RankActor"]
        assert len(ranks) == 2
        assert replica.placement_group_id is not None
        assert {a.placement_group_id for a in ranks} == {replica.placement_group_id}
    finally:
        serve.shutdown()
