"""Checkpoint headers, shard planning, method resolution and backends. No Ray here: a rank
can be loaded in a plain process."""

from __future__ import annotations

from rayload.loading.methods import LoadMethod, MethodReport
from rayload.loading.report import PhaseRecord, RankReport

__all__ = ["LoadMethod", "MethodReport", "PhaseRecord", "RankReport"]
