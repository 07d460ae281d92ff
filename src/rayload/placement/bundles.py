"""Pure placement arithmetic: the bundles a TP group asks for, which bundle holds which
rank, and whether a cluster can hold the bundles at all. No Ray calls here, so every rule
is unit-tested without a cluster.

A group rayload creates has one bundle per rank, rank ``r`` in bundle ``r``. A group that
rayload *reuses* (the one a Ray Serve replica runs in) has the replica itself in bundle 0
and the ranks in bundles ``1..tp_size``: rank ``r`` in bundle ``r + 1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rayload.errors import ConfigError
from rayload.options import check_strategy, check_tp_size

Bundle = Mapping[str, float]


DEFAULT_CPUS_PER_RANK = 0.01
"""CPU reserved per rank. A rank mostly waits on storage and the device; reserving whole
cores would make TP 8 unschedulable on a small machine. Ray does not cap real CPU use."""


@dataclass(frozen=True)
class RankResources:
    """What one rank actor asks Ray for inside its bundle."""

    num_cpus: float
    num_gpus: float

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ConfigError(f"negative rank resources: {self}")


def rank_bundles(
    tp_size: int, *, use_gpus: bool, cpus_per_rank: float = DEFAULT_CPUS_PER_RANK
) -> list[dict[str, float]]:
    """One bundle per rank: ``{"CPU": cpus_per_rank, "GPU": 1}`` with GPUs, else CPU only."""
    check_tp_size(tp_size)
    if cpus_per_rank <= 0:
        raise ConfigError(f"cpus_per_rank must be > 0, got {cpus_per_rank}")
    bundle = {"CPU": float(cpus_per_rank)}
    if use_gpus:
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(tp_size)]


def bundle_index(rank: int, *, first_rank_bundle: int = 0) -> int:
    """The bundle holding ``rank``: ``rank`` in a group of our own, ``rank + 1`` in a reused
    group whose bundle 0 holds the caller (a Serve replica)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return first_rank_bundle + rank


def rank_resources(bundle: Bundle, *, want_gpu: bool) -> RankResources:
    """The actor resources that fit ``bundle``: all of its CPU, and one GPU when the bundle
    has one and the load may use it (``device`` is not ``cpu``)."""
    gpus = 1.0 if want_gpu and bundle.get("GPU", 0.0) >= 1.0 else 0.0
    return RankResources(num_cpus=float(bundle.get("CPU", 0.0)), num_gpus=gpus)


def check_reused_bundles(bundles: Sequence[Bundle], tp_size: int, *, need_gpus: bool) -> None:
    """Check that a reused group has bundle 0 for the caller plus ``tp_size`` rank bundles,
    each with a GPU when ``need_gpus``. Raises :class:`ConfigError` saying what to change."""
    have = len(bundles) - 1
    if have < tp_size:
        raise ConfigError(
            f"the current placement group has {len(bundles)} bundles; rayload needs bundle 0 "
            f"for the caller plus {tp_size} rank bundles (1..{tp_size}). Add rank bundles to "
            "the deployment's placement_group_bundles or lower tp_size"
        )
    if need_gpus:
        for index in range(1, tp_size + 1):
            if bundles[index].get("GPU", 0.0) < 1.0:
                raise ConfigError(
                    f"bundle {index} of the current placement group has no GPU "
                    f"({dict(bundles[index])}) but device='cuda' was asked; give every rank "
                    'bundle {"GPU": 1} or load with device="cpu"'
                )


def unmet_resources(
    bundles: Sequence[Bundle], strategy: str, nodes: Sequence[Bundle]
) -> str | None:
    """Why ``bundles`` can never be placed on ``nodes`` (total resources per node), or None
    when they can.

    ``STRICT_PACK`` needs one node holding every bundle; ``STRICT_SPREAD`` one distinct node
    per bundle; ``PACK``/``SPREAD`` need each bundle to fit some node and the sum to fit the
    cluster. Greedy first-fit is used for ``STRICT_SPREAD``, good enough for equal bundles.
    """
    check_strategy(strategy)
    total = _sum(bundles)
    if strategy == "STRICT_PACK":
        if not any(_fits(total, node) for node in nodes):
            need = format_resources(total)
            return f"no single node has {need} (STRICT_PACK puts every rank on one node)"
        return None
    for bundle in bundles:
        if not any(_fits(bundle, node) for node in nodes):
            return f"no node has room for one rank bundle {format_resources(bundle)}"
    if strategy == "STRICT_SPREAD":
        free = [dict(node) for node in nodes]
        for bundle in bundles:
            slot = next((n for n in free if _fits(bundle, n)), None)
            if slot is None:
                return f"{len(bundles)} bundles need {len(bundles)} distinct nodes (STRICT_SPREAD)"
            free.remove(slot)
        return None
    if not _fits(total, _sum(nodes)):
        have, need = format_resources(_sum(nodes)), format_resources(total)
        return f"the cluster has {have} in all, the group needs {need}"
    return None


def _sum(bundles: Sequence[Bundle]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _fits(need: Bundle, have: Bundle) -> bool:
    return all(have.get(key, 0.0) + 1e-9 >= value for key, value in need.items() if value > 0)


_HIDDEN = ("memory", "object_store_memory")


def format_resources(resources: Bundle) -> str:
    """``{CPU: 2, GPU: 4}``: resources as messages show them (memory and per-node keys
    dropped)."""
    shown = {k: v for k, v in resources.items() if k not in _HIDDEN and not k.startswith("node:")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"
