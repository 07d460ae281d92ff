"""A Serve replica that dies leaves nothing behind: examples/serve_deployment.py deployed on
the session cluster, its replica actor killed the way Serve's docs simulate a replica crash
(``ray.kill(replica, no_restart=True)``: no ``__del__``, so no ``LoadResult.close()``).
Within 30 s the old replica's rank actors are dead (fate sharing: the replica owns them) and
its placement group is removed (Serve's controller, on seeing the replica gone). Serve may
start a new replica that loads again; only the old actors and group must be gone. After
``serve.delete`` nothing of the test is left (on the package's one Serve:
``serve_instance``)."""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import ray
from ray import serve
from ray.util.state import list_actors

from rayload.loading import write_checkpoint

CLEANUP_LIMIT_S = 30

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("serve-faults") / "ckpt", dtype="f32")


def _alive(state_address: str) -> list[Any]:
    return list_actors(
        address=state_address,
        filters=[("state", "=", "ALIVE")],
        detail=True,
        raise_on_missing_output=False,
    )


def _group_state(group_id: str) -> str:
    """The group's state in the GCS; a group the GCS no longer lists counts as removed."""
    info = ray.util.placement_group_table().get(group_id)
    return "REMOVED" if info is None else str(info["state"])


def _secs(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s"


def test_killed_serve_replica_leaves_no_rank_actor_and_no_placement_group(
    serve_example: ModuleType,
    checkpoint: Path,
    ray_cluster: Any,
    serve_instance: Any,
    no_leaks: object,
) -> None:
    try:
        load = {"path": str(checkpoint), "tp_size": 2, "device": "cpu"}
        serve.run(
            serve_example.build_app({"load": load}),
            name="rayload-faults",
            route_prefix="/",
        )
        alive = _alive(ray_cluster.state_address)
        (replica,) = [a for a in alive if a.class_name.startswith("ServeReplica")]
        group_id = replica.placement_group_id
        assert group_id is not None and _group_state(group_id) == "CREATED"
        ranks = {
            a.actor_id
            for a in alive
            if "RankActor" in a.class_name and a.placement_group_id == group_id
        }
        assert len(ranks) == 2, [(a.class_name, a.placement_group_id) for a in alive]

        # What Serve's docs do to simulate a replica crash; the controller sees it dead.
        ray.kill(ray.get_actor(replica.name, namespace="serve"), no_restart=True)
        killed = time.monotonic()
        ranks_gone = group_gone = None
        while ranks_gone is None or group_gone is None:
            now = time.monotonic() - killed
            if ranks_gone is None:
                still = ranks & {a.actor_id for a in _alive(ray_cluster.state_address)}
                ranks_gone = now if not still else None
            if group_gone is None:
                group_gone = now if _group_state(group_id) == "REMOVED" else None
            if now > CLEANUP_LIMIT_S:
                break
            time.sleep(0.2)
        print(
            f"measured: killed Serve replica: old rank actors gone {_secs(ranks_gone)}, "
            f"its placement group removed {_secs(group_gone)} after the kill"
        )
        assert ranks_gone is not None, f"old rank actors alive {CLEANUP_LIMIT_S} s later: {still}"
        assert group_gone is not None, (
            f"old replica's placement group {group_id} is {_group_state(group_id)} "
            f"{CLEANUP_LIMIT_S} s after the kill"
        )
        # The old replica itself is dead too (Serve may have started a new one).
        replicas = {
            a.actor_id
            for a in _alive(ray_cluster.state_address)
            if a.class_name.startswith("ServeReplica")
        }
        assert replica.actor_id not in replicas
        starting = [
            a.state
            for a in list_actors(address=ray_cluster.state_address, raise_on_missing_output=False)
            if a.class_name.startswith("ServeReplica") and a.state != "DEAD"
        ]
        print(f"measured: replacement replica(s) after the cleanup: {starting}")
    finally:
        serve.delete("rayload-faults")
