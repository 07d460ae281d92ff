"""Checkpoint headers, shard planning, method resolution and backends. No Ray here: a rank
can be loaded in a plain process.

::

    from rayload.loading import load_rank, plan_shards
    tensors, report = load_rank("path/to/model", rank=1, tp_size=4, method="scratch")
    plan = plan_shards("path/to/model", tp_size=4)
"""

from __future__ import annotations

from rayload.loading.checkpoint import Checkpoint, open_checkpoint
from rayload.loading.convert import convert_checkpoint
from rayload.loading.methods import LoadMethod, MethodReport
from rayload.loading.plan import RankPlan, ShardPlan, plan_shards
from rayload.loading.probe import EnvProbe, probe_environment
from rayload.loading.rank import load_rank
from rayload.loading.report import PhaseRecord, PhaseTimer, RankReport
from rayload.loading.synthetic import write_checkpoint

__all__ = [
    "Checkpoint",
    "EnvProbe",
    "LoadMethod",
    "MethodReport",
    "PhaseRecord",
    "PhaseTimer",
    "RankPlan",
    "RankReport",
    "ShardPlan",
    "convert_checkpoint",
    "load_rank",
    "open_checkpoint",
    "plan_shards",
    "probe_environment",
    "write_checkpoint",
]
