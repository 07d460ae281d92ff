"""Placement groups for the rank actors: create one (one bundle per rank), or reuse the one
the caller already runs in (a Ray Serve replica: bundle 0 is the replica, ranks take
bundles ``1..tp_size``).

Every function here talks to a connected Ray; the arithmetic lives in
:mod:`rayload.placement.bundles`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayload.errors import ConfigError, LoadFailedError
from rayload.placement.bundles import (
    DEFAULT_CPUS_PER_RANK,
    Bundle,
    RankResources,
    bundle_index,
    check_reused_bundles,
    format_resources,
    rank_bundles,
    rank_resources,
    unmet_resources,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RankPlacement:
    """Where the ranks of one load run; a handle with one state change, :meth:`remove`.

    ``owned`` is True when rayload created the group (and so removes it); a reused group
    belongs to its creator and is never removed here.
    """

    group: PlacementGroup
    tp_size: int
    strategy: str
    bundles: tuple[Bundle, ...]
    first_rank_bundle: int = 0
    owned: bool = True
    _removed: bool = field(default=False, init=False, repr=False)

    def bundle_of(self, rank: int) -> int:
        return bundle_index(rank, first_rank_bundle=self.first_rank_bundle)

    def resources(self, rank: int, *, want_gpu: bool) -> RankResources:
        """What rank ``rank``'s actor asks for: what its bundle holds."""
        return rank_resources(self.bundles[self.bundle_of(rank)], want_gpu=want_gpu)

    def scheduling_strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Pin rank ``rank``'s actor to its bundle. Tasks the actor starts are not captured
        into the group: they would compete with the ranks for the bundles."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.bundle_of(rank),
            placement_group_capture_child_tasks=False,
        )

    def node_ids(self) -> dict[int, str | None]:
        """Node id of every rank's bundle, from the GCS (None where not placed yet)."""
        table = placement_group_table(self.group)
        by_bundle = table.get("bundles_to_node_id", {}) or {}
        return {rank: by_bundle.get(self.bundle_of(rank)) for rank in range(self.tp_size)}

    def remove(self) -> None:
        """Remove the group if rayload created it. Idempotent."""
        if not self.owned or self._removed:
            return
        self._removed = True
        remove_placement_group(self.group)


def create_placement_group(
    tp_size: int,
    *,
    strategy: str = "STRICT_PACK",
    use_gpus: bool,
    cpus_per_rank: float = DEFAULT_CPUS_PER_RANK,
    timeout_s: float = 60.0,
) -> RankPlacement:
    """Create a group of ``tp_size`` rank bundles and wait until it is placed.

    Raises :class:`ConfigError` at once when the live nodes can never hold the bundles, and
    :class:`LoadFailedError` when they could but are busy for ``timeout_s``; both name what
    was asked and what is available, and leave no group behind.
    """
    bundles = rank_bundles(tp_size, use_gpus=use_gpus, cpus_per_rank=cpus_per_rank)
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    asked = f"{tp_size} rank bundle(s) of {format_resources(bundles[0])} with {strategy}"
    reason = unmet_resources(bundles, strategy, nodes)
    if reason is not None:
        raise ConfigError(
            f"cannot place {asked}: {reason}; cluster total "
            f"{format_resources(ray.cluster_resources())} on {len(nodes)} node(s). "
            "Lower --tp, use --device cpu, another --placement-strategy, or add nodes"
        )
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=max(timeout_s, 0.0))
    if not ready:
        available = format_resources(ray.available_resources())
        remove_placement_group(group)
        raise LoadFailedError(
            f"placement of {asked} not ready after {timeout_s:.0f} s; available now "
            f"{available}. Other work holds the resources: free them or raise --timeout"
        )
    log.debug("placement group %s ready: %s", group.id.hex(), asked)
    return RankPlacement(group=group, tp_size=tp_size, strategy=strategy, bundles=tuple(bundles))


def current_placement(tp_size: int, *, need_gpus: bool) -> RankPlacement | None:
    """The placement group the caller runs in (e.g. a Serve replica's), with the ranks in
    bundles ``1..tp_size``; None when the caller is in no group (a driver)."""
    group = get_current_placement_group()
    if group is None:
        return None
    bundles: tuple[Mapping[str, float], ...] = tuple(group.bundle_specs)
    check_reused_bundles(bundles, tp_size, need_gpus=need_gpus)
    strategy = str(placement_group_table(group).get("strategy", "unknown"))
    log.debug("reusing placement group %s (%s) for %d ranks", group.id.hex(), strategy, tp_size)
    return RankPlacement(
        group=group,
        tp_size=tp_size,
        strategy=strategy,
        bundles=bundles,
        first_rank_bundle=1,
        owned=False,
    )
