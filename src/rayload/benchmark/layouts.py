"""How a case's TP group divides a checkpoint's tensors, and what each rank then holds.

Cases of different layouts hand their ranks different tensors, so each case is checked
against the reference of its own layout (:mod:`rayload.benchmark.verify`), never against
a case of another layout. The layouts differ only in the experts of a mixture-of-experts
model; every other tensor is cut as rayload's preset rules cut it, in all three:

* ``tp``: every expert split across the ranks too (each rank reads 1/tp of every expert);
* ``ep``: expert parallel: each rank holds its contiguous block of experts, whole;
* ``whole_experts``: every rank holds every expert whole, as a loader does that neither
  splits the experts nor divides them among the ranks. Built as rules: one replicate rule
  per kind of expert tensor, ahead of the preset's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rayload.errors import ConfigError
from rayload.loading.checkpoint import Checkpoint
from rayload.loading.plan import ShardPlan, plan_shards
from rayload.loading.rules import Rule, RuleSet, resolve_rules

TP, EP, WHOLE_EXPERTS = "tp", "ep", "whole_experts"
LAYOUTS = (TP, EP, WHOLE_EXPERTS)
"""Every layout, in the order reports list them."""


@dataclass(frozen=True)
class LoadOptions:
    """What ``load_rank`` is given for a layout (picklable: it crosses into the ranks)."""

    expert_parallel: bool = False
    rules: RuleSet | None = None
    """None: the preset for config.json's architecture, as a user loads."""


@dataclass(frozen=True)
class LayoutPlan:
    """What one layout gives each rank of ``tp_size``, from rayload's plan.

    ``rank_bytes[r]`` are the bytes rank r holds, ``expert_bytes[r]`` the part of them in
    experts' tensors, ``all_expert_bytes`` the experts' tensors of the whole checkpoint
    and ``experts[r]`` the experts rank r holds whole (``ep`` only).
    """

    layout: str
    tp_size: int
    rank_bytes: tuple[int, ...]
    expert_bytes: tuple[int, ...]
    all_expert_bytes: int
    experts: tuple[tuple[int, ...], ...] = ()


def expert_tensors(checkpoint: Checkpoint) -> frozenset[str]:
    """The names of the checkpoint's expert tensors: those whose preset rule names an
    expert (its ``expert`` group matched), as expert parallel recognises them."""
    ruleset = resolve_rules(None, checkpoint.architecture)
    return frozenset(
        name
        for name in checkpoint.tensors
        if (rule := ruleset.match(name)) is not None and rule.expert_id(name) is not None
    )


def load_options(layout: str, checkpoint: Checkpoint) -> LoadOptions:
    """The ``load_rank`` options that give ``layout`` on ``checkpoint``.

    ConfigError (with the reason, for the report's skipped list) when the layout means
    nothing here: ``ep`` and ``whole_experts`` on a checkpoint without expert tensors.
    """
    if layout == TP:
        return LoadOptions()
    experts = expert_tensors(checkpoint)
    if not experts:
        raise ConfigError(
            f"{checkpoint.root} has no expert tensors (no preset rule with an expert group "
            "matches): there are no experts to divide or to hold whole"
        )
    if layout == EP:
        return LoadOptions(expert_parallel=True)
    if layout == WHOLE_EXPERTS:
        preset = resolve_rules(None, checkpoint.architecture)
        kinds = sorted({_kind_pattern(name) for name in experts})
        replicate = tuple(Rule(pattern, None) for pattern in kinds)
        return LoadOptions(
            rules=RuleSet(replicate + preset.rules, f"experts replicated + {preset.source}")
        )
    raise ValueError(f"unknown layout {layout!r}; layouts are {', '.join(LAYOUTS)}")


def _kind_pattern(name: str) -> str:
    """A pattern for every tensor named like ``name`` but for its numbers (layer, expert):
    ``model\\.layers\\.\\d+\\.block_sparse_moe\\.experts\\.\\d+\\.w1\\.weight``."""
    return re.sub(r"\d+", r"\\d+", re.escape(name))


def plan_layout(checkpoint: Checkpoint, tp_size: int, options: LoadOptions) -> ShardPlan:
    """rayload's plan of ``checkpoint`` for ``tp_size`` ranks under ``options``."""
    return plan_shards(
        checkpoint, tp_size, rules=options.rules, expert_parallel=options.expert_parallel
    )


def summarize_layout(
    layout: str, checkpoint: Checkpoint, tp_size: int, options: LoadOptions
) -> LayoutPlan:
    """The :class:`LayoutPlan` of ``layout``; for ``whole_experts`` it also checks that the
    replicate rules caught exactly the expert tensors (ValueError naming one that is not)."""
    plan = plan_layout(checkpoint, tp_size, options)
    experts = expert_tensors(checkpoint)
    if layout == WHOLE_EXPERTS:
        tp_splits = plan_layout(checkpoint, tp_size, LoadOptions()).splits
        for name, split in plan.splits.items():
            if split != (None if name in experts else tp_splits[name]):
                raise ValueError(f"the whole_experts rules cut {name!r} unlike the layout says")
    return LayoutPlan(
        layout=layout,
        tp_size=tp_size,
        rank_bytes=plan.rank_bytes,
        expert_bytes=tuple(
            sum(s.nbytes for s in rank.shards if s.name in experts) for rank in plan.ranks
        ),
        all_expert_bytes=sum(checkpoint.tensors[n].nbytes for n in experts),
        experts=plan.experts,
    )
