"""examples/serve_deployment.py under Ray Serve on the session cluster: the replica's ranks
run in the replica's own placement group, an HTTP GET returns the startup metrics and trace
id, and ``serve.shutdown()`` leaves no actor or placement group behind."""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from ray import cloudpickle, serve
from ray.util.state import list_actors

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_deployment.py"

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """examples/serve_deployment.py, imported from its path for this test only."""
    spec = importlib.util.spec_from_file_location("rayload_serve_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    # Workers cannot import a module loaded from a path: ship its code by value.
    cloudpickle.register_pickle_by_value(module)
    return module


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.load(response)


def test_serve_replica_loads_into_its_placement_group_and_serves_metrics(
    example: ModuleType, tiny_llama: Path, ray_cluster: Any, unused_port: int, no_leaks: object
) -> None:
    serve.start(http_options={"host": "127.0.0.1", "port": unused_port})
    try:
        app = example.build_app({"checkpoint": str(tiny_llama), "tp": "2"})
        serve.run(app, name="rayload-test", route_prefix="/")
        summary = _get(f"http://127.0.0.1:{unused_port}/")
        assert len(summary["trace_id"]) == 32 and summary["tp_size"] == 2
        assert [r["rank"] for r in summary["ranks"]] == [0, 1]
        assert all(r["node_id"] == ray_cluster.node_id for r in summary["ranks"])
        assert summary["startup_metrics"]["aggregate"]["total_model_loading_seconds"]["max"] > 0

        shard = _get(f"http://127.0.0.1:{unused_port}/shard?rank=1&name=model.norm.weight")
        assert shard["rank"] == 1 and shard["shape"] and shard["dtype"].startswith("torch.")

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
