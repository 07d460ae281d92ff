"""Placement groups on a real Ray: creation and removal, GPU bundles, and reuse of the
caller's group (as inside a Ray Serve replica) with the ranks in bundles 1..tp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray.util.state import list_actors

import rayload
from rayload.errors import ConfigError
from rayload.placement import create_placement_group

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_create_placement_group_places_gpu_bundles_and_removes_once(no_leaks: object) -> None:
    placement = create_placement_group(3, use_gpus=True, cpus_per_rank=0.01)
    node = ray.get_runtime_context().get_node_id()
    assert placement.owned and placement.strategy == "STRICT_PACK"
    assert placement.node_ids() == {0: node, 1: node, 2: node}
    table = ray.util.placement_group_table(placement.group)
    assert table["state"] == "CREATED"
    assert all(b == {"CPU": 0.01, "GPU": 1.0} for b in table["bundles"].values())
    placement.remove()
    placement.remove()
    assert ray.util.placement_group_table(placement.group)["state"] == "REMOVED"


def test_create_placement_group_infeasible_fails_fast_without_group(no_leaks: object) -> None:
    with pytest.raises(ConfigError, match=r"cannot place 5 rank bundle.*GPU: 5.*cluster total"):
        create_placement_group(5, use_gpus=True, timeout_s=300)


@ray.remote(num_cpus=0.01)
class _Replica:
    """Stands in for a Ray Serve replica: an actor in bundle 0 of its own group."""

    def load(self, path: str, tp: int, state_address: str) -> dict[str, Any]:
        with rayload.load(path, tp, method="dummy", device="cpu") as result:
            return {
                "bundles": [result.placement.bundle_of(r) for r in range(tp)],
                "owned": result.placement.owned,
                "group": result.placement.group.id.hex(),
                "ranks": [r.rank for r in result.ranks],
                "rank_actor_groups": sorted(
                    a.placement_group_id or ""
                    for a in list_actors(
                        address=state_address,
                        filters=[("class_name", "=", "RankActor"), ("state", "=", "ALIVE")],
                        detail=True,
                    )
                ),
            }


def _replica_in_group(bundles: list[dict[str, float]]) -> tuple[Any, Any]:
    group = placement_group(bundles, strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    return group, _Replica.options(scheduling_strategy=strategy).remote()


def test_load_inside_placement_group_reuses_it_with_ranks_in_bundles_1_to_tp(
    tiny_llama: Path, ray_cluster: Any, no_leaks: object
) -> None:
    group, replica = _replica_in_group([{"CPU": 0.01}] * 3)
    try:
        load = replica.load.remote(str(tiny_llama), 2, ray_cluster.state_address)
        seen = ray.get(load, timeout=120)
        assert seen["group"] == group.id.hex() and seen["owned"] is False
        assert seen["bundles"] == [1, 2] and seen["ranks"] == [0, 1]
        assert seen["rank_actor_groups"] == [group.id.hex()] * 2
        assert ray.util.placement_group_table(group)["state"] == "CREATED", "not ours to remove"
    finally:
        ray.kill(replica)
        remove_placement_group(group)


def test_load_inside_too_small_placement_group_says_what_to_add(
    tiny_llama: Path, ray_cluster: Any, no_leaks: object
) -> None:
    group, replica = _replica_in_group([{"CPU": 0.01}] * 2)
    try:
        with pytest.raises(ConfigError, match=r"bundle 0 for the caller plus 2 rank bundles"):
            ray.get(replica.load.remote(str(tiny_llama), 2, ray_cluster.state_address))
    finally:
        ray.kill(replica)
        remove_placement_group(group)
