"""One TP group without Ray: ``tp`` spawned processes join a gloo group over loopback and
each runs ``load_rank(..., group=WORLD)`` from the same ``s3://`` checkpoint, as the rank
actors of a load do (tests/storage/test_s3_group.py). Spawned, not forked: the test
process has started torch's threads. The processes read the AWS environment they
inherit (tests/conftest.py: the tests' S3 server).

The checkpoint is the test process's, opened once, as a load's driver hands it over.
Each writes ``rank<r>.pt`` to ``out``: its tensors, bytes read and its ``rank.read``
phases' ``group.*`` counts added up, or the error it raised (type and message). With
``batched`` each rank loads in batches of one file each, one ``load_rank`` per batch,
as vLLM's workers do (rayload.integrations.batches). ``group_bytes`` is what such a
group fetches, from the plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from rayload.actors.process_group import free_port
from rayload.loading.checkpoint import Checkpoint
from rayload.loading.plan import RankPlan, RowRanges, ShardPlan


def _rank(
    rank: int,
    tp: int,
    checkpoint: Checkpoint,
    port: int,
    out: str,
    changed_rank: int | None,
    batched: bool,
    failing_rank: int | None = None,
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from rayload.integrations.batches import load_in_batches, merged_report

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=tp,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    if rank == changed_rank:  # this rank believes every object has another version
        versions = {k: (size, '"0123456789abcdef"') for k, (size, _) in checkpoint.versions.items()}
        checkpoint = dataclasses.replace(checkpoint, versions=versions)
    result: dict[str, Any]
    tensors: dict[str, torch.Tensor] = {}
    reports = []
    try:
        batches = load_in_batches(
            checkpoint.root,
            rank,
            tp,
            1 if batched else 0,
            method="fastsafetensors_gdr" if rank == failing_rank else "auto",
            strict=rank == failing_rank,
            checkpoint=checkpoint,
            group=dist.group.WORLD,
        )
        for loaded, report, _ in batches:
            tensors |= loaded
            reports.append(report)
        report = merged_report(reports)
        read: dict[str, int] = {}
        for phase in (p for p in report.phases if p.name == "rank.read"):
            for key, value in phase.attributes.items():
                if key.startswith("group.") and isinstance(value, int):
                    read[key] = read.get(key, 0) + value
        result = {
            "tensors": tensors,
            "bytes_read": report.bytes_read,
            "read": read,
            "batches": len(reports),
        }
    except Exception as exc:
        result = {"error": (type(exc).__name__, str(exc))}
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out) / f"rank{rank}.pt")


GROUP_TIMEOUT_S = 120
"""The group's time-out: what a rank left waiting in a collective waits at most."""


def load_group(
    checkpoint: Checkpoint,
    tp: int,
    out: Path,
    *,
    changed_rank: int | None = None,
    batched: bool = False,
    failing_rank: int | None = None,
) -> list[dict[str, Any]]:
    """Each rank's result (see the module), by rank. ``checkpoint`` (opened by the
    caller, once) is handed to every rank, as a load's driver does: the ranks send only
    their data GETs. ``changed_rank`` is handed versions that no object has (its GETs
    fail, 412). ``batched``: in batches of one file each (see the module).
    ``failing_rank`` asks strictly for a method it cannot have (no GPU): it fails in
    ``rank.resolve``, before the group's agreement."""
    mp.start_processes(
        _rank,
        args=(tp, checkpoint, free_port(), str(out), changed_rank, batched, failing_rank),
        nprocs=tp,
        start_method="spawn",
    )
    return [torch.load(out / f"rank{r}.pt") for r in range(tp)]


def split1_names(plan: RankPlan) -> set[str]:
    """The split-1 tensors of ``plan`` whose shards are rows of the file (shared)."""
    return {
        s.name
        for s in plan.shards
        if s.split == 1 and isinstance(s.ranges, RowRanges) and s.ranges.rows > 1
    }


def group_bytes(plan: ShardPlan) -> int:
    """The tensor bytes one TP group fetches when it shares its split-1 tensors: every
    rank's other shards, and each split-1 tensor whole, once."""
    split1 = split1_names(plan.ranks[0])
    other = sum(s.nbytes for r in plan.ranks for s in r.shards if s.name not in split1)
    return other + sum(s.nbytes * plan.tp_size for s in plan.ranks[0].shards if s.name in split1)
