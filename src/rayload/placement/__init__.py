"""Placement groups, the rank -> bundle mapping, and reuse of the caller's group inside a
Ray Serve replica."""

from __future__ import annotations

from rayload.options import STRATEGIES
from rayload.placement.bundles import (
    DEFAULT_CPUS_PER_RANK,
    RankResources,
    bundle_index,
    rank_bundles,
)
from rayload.placement.placement_group import (
    RankPlacement,
    create_placement_group,
    current_placement,
)

__all__ = [
    "DEFAULT_CPUS_PER_RANK",
    "STRATEGIES",
    "RankPlacement",
    "RankResources",
    "bundle_index",
    "create_placement_group",
    "current_placement",
    "rank_bundles",
]
