"""examples/serve_deployment.py under Ray Serve on the session cluster: the replica's ranks
run in the replica's own placement group, an HTTP GET returns the startup metrics and trace
id, a POST answers the next-token top 5 of the TP forward over the ranks (held to
transformers on the same float32 checkpoint), a bad body is a 400, and deleting the app
leaves no actor or placement group behind (on the package's one Serve: ``serve_instance``,
whose shutdown must leave nothing either). Autoscaled from 1 to 3 replicas under traffic
(which stops once Serve has chosen 3, so the new replicas start without forwards competing
for the CPU), the new replicas receive every shard from the first through the peer
directory and read no checkpoint bytes; deleting the app leaves no rank actor or placement
group."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import ray
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
    serve_example: ModuleType,
    f32_llama: Path,
    ray_cluster: Any,
    serve_instance: Any,
    no_leaks: object,
) -> None:
    url = serve_instance.url
    try:
        load = {"path": str(f32_llama), "tp_size": 2, "device": "cpu"}
        app = serve_example.build_app({"load": load})
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
        serve.delete("rayload-test")


def _replicas(app: str, *states: str) -> int:
    """How many of the app's replicas are in any of ``states``."""
    deployments = serve.status().applications[app].deployments
    return sum(int(deployments["TPModel"].replica_states.get(s, 0)) for s in states)


_STARTED = ("STARTING", "UPDATING", "RUNNING")
"""Replica states of a replica Serve has decided to run (``RECOVERING`` excluded)."""


def _post_until(url: str, stop: threading.Event, statuses: list[int]) -> None:
    """One client: POST a forward, again and again, until ``stop``."""
    while not stop.is_set():
        statuses.append(_post(url, json.dumps({"token_ids": [1, 2, 3]}).encode())[0])


def _rank_actors_and_groups(state_address: str, before: Any) -> tuple[list[str], list[str]]:
    """The rank actors alive and the placement groups created now that were not
    ``before`` (the ``no_leaks`` state)."""
    alive = list_actors(address=state_address, filters=[("state", "=", "ALIVE")])
    groups = ray.util.placement_group_table()
    return (
        [a.actor_id for a in alive if a.class_name == "RankActor"],
        [g for g, info in groups.items() if info["state"] == "CREATED" and g not in before.groups],
    )


def test_serve_scale_up_from_1_to_3_replicas_loads_the_new_ones_from_the_first(
    serve_example: ModuleType,
    tiny_llama: Path,
    ray_cluster: Any,
    serve_instance: Any,
    no_leaks: Any,
) -> None:
    url, app = serve_instance.url, "rayload-scale"
    state = ray_cluster.state_address
    stop, statuses = threading.Event(), []
    try:
        built = serve_example.build_app(
            {"load": {"path": str(tiny_llama), "tp_size": 2, "device": "cpu"}, "max_replicas": 3}
        )
        handle = serve.run(built, name=app, route_prefix="/")
        first = handle.load_report.remote().result()
        assert [r["method"]["effective"] for r in first["ranks"]] == ["scratch"] * 2
        assert all(r["bytes_from_storage"] > 0 for r in first["ranks"])

        # Requests waiting behind the one forward a replica runs at a time: Serve scales up.
        # The traffic stops once Serve has decided on 3 replicas (it scales down only after
        # minutes), so the new replicas start and load without forwards competing for CPU.
        clients = [
            threading.Thread(target=_post_until, args=(url, stop, statuses)) for _ in range(4)
        ]
        for client in clients:
            client.start()
        start = time.monotonic()
        deadline = start + 90
        while _replicas(app, *_STARTED) < 3:
            assert time.monotonic() < deadline, f"not scaled up: {serve.status()}"
            time.sleep(0.2)
        decided = time.monotonic() - start
        stop.set()
        for client in clients:
            client.join(timeout=60)
        while _replicas(app, "RUNNING") < 3:
            assert time.monotonic() < deadline, f"not scaled up: {serve.status()}"
            time.sleep(0.5)
        print(
            f"measured: Serve chose 3 replicas {decided:.1f} s into the traffic, all 3 "
            f"running {time.monotonic() - start:.1f} s in"
        )
        assert statuses and set(statuses) == {200}

        reports = {first["serve_replica"]: first}
        for _ in range(200):
            report = handle.load_report.remote().result()
            reports[report["serve_replica"]] = report
            if len(reports) == 3:
                break
        assert len(reports) == 3
        new = [r for serve_id, r in reports.items() if serve_id != first["serve_replica"]]
        for report in new:
            assert report["peer_key"] == first["peer_key"]
            assert [r["rank"] for r in report["ranks"]] == [0, 1]
            for rank in report["ranks"]:
                assert rank["bytes_from_storage"] == 0, rank
                assert rank["method"]["effective"] == "peer" and rank["bytes_from_peers"] > 0
                # from a replica of this app: the first, or the other new one once loaded
                # (sources spread over the loaded holders by rank)
                assert rank["source"].startswith(
                    tuple(f"peer replica={r['replica_id']} " for r in reports.values())
                )
        # The new replica that registered first saw only the first loaded: all from it.
        assert any(
            all(
                r["source"].startswith(f"peer replica={first['replica_id']} ")
                for r in report["ranks"]
            )
            for report in new
        )

        serve.delete(app)
        deadline = time.monotonic() + 30
        while left := [x for x in _rank_actors_and_groups(state, no_leaks) if x]:
            assert time.monotonic() < deadline, f"left after deleting the app: {left}"
            time.sleep(0.5)
    finally:
        stop.set()
        serve.delete(app)
