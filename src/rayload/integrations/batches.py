"""An engine's rank load in batches of whole files, so that its memory stays bounded.

An engine that copies rayload's shards into parameters of its own (vLLM's weight loaders)
holds both at once for the tensors in flight. Loading the whole shard first would hold the
model twice over on the load device, a GPU's memory included, where vLLM's own loaders
hold one file's tensors at a time. So the rank loads its shard in batches of whole
checkpoint files (:func:`file_batches`): each batch is one
:func:`~rayload.loading.rank.load_rank` of those files' tensors, handed over and freed
before the next. Whole files, because a fastsafetensors read takes its files whole; the
same batches on every rank, because the ranks of a TP group reading object storage agree
on each load's tensors collectively (:mod:`~rayload.loading.reader.group`).
:func:`load_in_batches` runs them; :func:`merged_report` is the rank's one report of
its batches.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rayload.loading.checkpoint import Checkpoint
from rayload.loading.plan import RankPlan
from rayload.loading.rank import AdjustPlan, load_rank
from rayload.loading.report import PhaseTimer, RankReport


def file_batches(checkpoint: Checkpoint, tp_size: int, batch_bytes: int) -> list[frozenset[str]]:
    """The checkpoint's files in order, cut into runs of whole files of which a rank's
    share (a file's tensor bytes over ``tp_size``) is at most ``batch_bytes`` where the
    files allow (a larger file is a batch of its own). The same on every rank. One batch
    of every file when ``batch_bytes`` is 0, and for a converted checkpoint, whose files
    are each rank's own."""
    if batch_bytes <= 0 or checkpoint.layout == "converted":
        return [frozenset(checkpoint.files)]
    share: dict[str, float] = dict.fromkeys(checkpoint.files, 0.0)
    for info in checkpoint.tensors.values():
        share[info.file] += info.nbytes / tp_size
    batches: list[list[str]] = []
    total = 0.0
    for file, nbytes in share.items():
        if not batches or total + nbytes > batch_bytes:
            batches.append([])
            total = 0.0
        batches[-1].append(file)
        total += nbytes
    return [frozenset(b) for b in batches]


def load_in_batches(
    path: str | os.PathLike[str],
    rank: int,
    tp_size: int,
    batch_bytes: int,
    *,
    adjust_plan: AdjustPlan | None = None,
    checkpoint: Checkpoint | None = None,
    plan: RankPlan | None = None,
    timer: PhaseTimer | None = None,
    **options: Any,
) -> Iterator[tuple[dict[str, torch.Tensor], RankReport, RankPlan]]:
    """Rank ``rank``'s shard in batches (:func:`file_batches`), one
    :func:`~rayload.loading.rank.load_rank` each (``options`` are its keyword arguments),
    yielding each batch's tensors, report and plan before the next is read. The first
    batch opens the checkpoint (unless ``checkpoint`` is given) and plans the rank
    (``adjust_plan`` applied once), unless ``plan`` gives the rank's plan (or the part of
    it to load) of ``checkpoint``; the later ones read that checkpoint and cut that plan.
    The batches share one timer (``timer``, or a new one), so the last report holds every
    phase. Every batch is loaded, an empty one too: every rank of a TP group loads the
    same batches."""
    timer = timer if timer is not None else PhaseTimer()
    batches: list[frozenset[str]] = []
    whole: RankPlan | None = plan  # the rank's plan, as given or as the first batch made it
    cut: RankPlan | None = None  # this batch's
    if plan is not None:
        if checkpoint is None:
            raise ValueError("load_in_batches: a plan= needs the checkpoint= it plans")
        batches.extend(file_batches(checkpoint, tp_size, batch_bytes))

    def plan_batch(planned: RankPlan, opened: Checkpoint) -> RankPlan:
        nonlocal checkpoint, whole, cut
        if whole is None:
            checkpoint = opened
            whole = planned if adjust_plan is None else adjust_plan(planned, opened)
            batches.extend(file_batches(opened, tp_size, batch_bytes))
        cut = only_files(whole, batches[index])
        return cut

    index = 0
    while index == 0 or index < len(batches):
        tensors, report = load_rank(
            path,
            rank,
            tp_size,
            adjust_plan=plan_batch,
            checkpoint=checkpoint,
            plan=whole,
            timer=timer,
            **options,
        )
        assert cut is not None
        yield tensors, report, cut
        index += 1


def only_files(plan: RankPlan, files: frozenset[str]) -> RankPlan:
    """``plan`` cut to the shards whose bytes lie in ``files`` (possibly none)."""
    shards = tuple(s for s in plan.shards if set(s.files) <= files)
    return RankPlan(plan.rank, plan.tp_size, shards)


def merged_report(reports: Sequence[RankReport]) -> RankReport:
    """One report of a rank's batches, in order: their bytes, tensors, files and requests
    added up, from the first one's start to the last one's end, with every phase (the
    batches share one timer, so the last report holds them all). The method is the first
    batch's that fell back, with every batch's reason, else the first batch's."""
    first, last = reports[0], reports[-1]
    method = next((r.method for r in reports if r.method.fallback_reason), first.method)
    reasons = dict.fromkeys(r.method.fallback_reason for r in reports if r.method.fallback_reason)
    return dataclasses.replace(
        last,
        method=dataclasses.replace(method, fallback_reason="; ".join(reasons) or None),
        bytes_read=sum(r.bytes_read for r in reports),
        bytes_from_peers=sum(r.bytes_from_peers for r in reports),
        tensors=sum(r.tensors for r in reports),
        start_ns=first.start_ns,
        files=tuple(dict.fromkeys(f for r in reports for f in r.files)),
        requests=sum(r.requests for r in reports),
        retries=sum(r.retries for r in reports),
    )
