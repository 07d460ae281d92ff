"""One real local Ray cluster for every test under tests/ray_cluster, plus leak checks.

The cluster has 2 CPUs and 4 *fake* GPUs (``num_gpus=4``): Ray schedules GPU bundles and
sets ``CUDA_VISIBLE_DEVICES`` per actor as on a GPU node, while torch (CPU build) sees no
CUDA, so ``device="auto"`` resolves to ``cpu``. The dashboard is on (on a free port)
because the state API (``ray.util.state``) that the leak checks use goes through it.
Tests that need their own cluster (several nodes, ``ray start``) run it in a subprocess.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import ray
from ray.util.state import list_actors

FAKE_GPUS = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=FAKE_GPUS,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=free_port(),
        log_to_driver=False,
        logging_level=logging.ERROR,
        namespace="rayload-tests",
    )
    yield
    ray.shutdown()


@dataclass(frozen=True)
class ClusterState:
    """What a test could leak: alive actors and created placement groups."""

    actors: frozenset[str]
    groups: frozenset[str]

    @classmethod
    def now(cls) -> ClusterState:
        alive = list_actors(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
        groups = ray.util.placement_group_table()
        return cls(
            actors=frozenset(a.actor_id for a in alive),
            groups=frozenset(g for g, info in groups.items() if info["state"] == "CREATED"),
        )


@pytest.fixture
def no_leaks(ray_cluster: None) -> Iterator[ClusterState]:
    """Assert the test left no alive actor and no created placement group behind.

    ``ray.kill`` and ``remove_placement_group`` are asynchronous in the GCS, so the check
    polls for a short while before it fails."""
    before = ClusterState.now()
    yield before
    after = ClusterState.now()
    for _ in range(50):
        if after.actors <= before.actors and after.groups <= before.groups:
            break
        time.sleep(0.2)
        after = ClusterState.now()
    assert after.actors <= before.actors, f"leaked actors: {after.actors - before.actors}"
    assert after.groups <= before.groups, f"leaked placement groups: {after.groups - before.groups}"
