"""Load one TP rank in the current process: no Ray needed.

:func:`load_rank` is the whole rank load in order, one :class:`PhaseTimer` phase per step:
``rank.resolve`` (headers, environment probe, method and device; for fastsafetensors on a
converted checkpoint also the CRC-32 of the rank's files, which that backend does not
check), ``rank.plan`` (this rank's byte ranges), the backend's ``rank.read`` /
``rank.to_device`` / ``rank.sync``, then ``rank.post_load``. The Ray rank actor calls
it with its own timer so the phases of a failed load survive the exception.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rayload.errors import MethodUnavailableError
from rayload.loading.arrivals import Publish
from rayload.loading.backends import BACKENDS, BackendResult
from rayload.loading.checkpoint import Checkpoint, open_checkpoint
from rayload.loading.manifest import verify_file_checksum
from rayload.loading.methods import LoadMethod, MethodReport
from rayload.loading.peer import PeerSource
from rayload.loading.plan import RankPlan, plan_shards
from rayload.loading.probe import EnvProbe, probe_environment
from rayload.loading.reader import ReaderOptions
from rayload.loading.reader.group import failing_together
from rayload.loading.report import DESTINATIONS, PLAN, POST_LOAD, RESOLVE, PhaseTimer, RankReport
from rayload.loading.resolve import LayoutInfo, Resolution, log_fallback, resolve_method
from rayload.loading.rules import RulesArg
from rayload.loading.storage import StorageCounters, storage_for
from rayload.options import check_model_role, check_rank, check_tp_size, parse_method

PostLoad = Callable[[dict[str, torch.Tensor]], object]
"""Post-load work on the loaded tensors (e.g. weight processing); its result is ignored."""
AdjustPlan = Callable[[RankPlan, Checkpoint], RankPlan]
"""An engine's own layout applied to the rank's plan before any byte is read (e.g. vLLM's
padded vocabulary shards); runs inside ``rank.plan``."""
Into = Mapping[str, torch.Tensor] | Callable[[RankPlan], Mapping[str, torch.Tensor]]
"""``load_rank(into=...)``: each shard's memory, or a function of the rank's plan giving it."""

_MAY_USE_FASTSAFETENSORS = frozenset(
    {LoadMethod.AUTO, LoadMethod.PEER, LoadMethod.FASTSAFETENSORS, LoadMethod.FASTSAFETENSORS_GDR}
)
"""Requested methods that may end up running fastsafetensors (only these import it)."""

_UNCHECKED_METHODS = frozenset({LoadMethod.FASTSAFETENSORS, LoadMethod.FASTSAFETENSORS_GDR})
"""Methods that read a converted checkpoint's rank files without checking their CRC-32s."""


def load_rank(
    path: str | os.PathLike[str],
    rank: int,
    tp_size: int,
    method: LoadMethod | str = "scratch",
    device: str | torch.device = "cpu",
    *,
    strict: bool = False,
    rules: RulesArg = None,
    model_role: str = "main",
    probe: EnvProbe | None = None,
    timer: PhaseTimer | None = None,
    post_load: PostLoad | None = None,
    reader_options: ReaderOptions | None = None,
    expert_parallel: bool = False,
    peer: PeerSource | None = None,
    adjust_plan: AdjustPlan | None = None,
    checkpoint: Checkpoint | None = None,
    group: Any = None,
    plan: RankPlan | None = None,
    into: Into | None = None,
    publish: Publish | None = None,
) -> tuple[dict[str, torch.Tensor], RankReport]:
    """Load rank ``rank`` of ``tp_size`` of the checkpoint at ``path`` onto ``device``.

    ``method``: a :class:`LoadMethod` or its string; ``device``: ``auto`` (the local GPU,
    else cpu), ``cpu``, ``cuda`` or ``cuda:N``. ``strict`` turns any fallback into
    :class:`MethodUnavailableError`. ``probe`` replaces the environment probe (tests);
    ``timer`` collects the phases; ``post_load(tensors)`` runs inside ``rank.post_load``.
    ``expert_parallel`` gives the rank only its experts, whole
    (:mod:`~rayload.loading.experts`). ``peer`` is a rank of another replica holding this
    rank's shards (same :func:`~rayload.loading.identity.peer_key`): ``auto`` and ``peer``
    then copy the shards from it, reading storage instead if it fails
    (:mod:`~rayload.loading.backends.peer`); other methods ignore it. ``adjust_plan(plan,
    checkpoint)`` returns the rank's plan as the engine lays it out (:data:`AdjustPlan`).
    ``checkpoint`` is ``path`` as another process opened it (the driver's, for object
    storage): no header is read again, and every byte comes from the versions it records
    (``Checkpoint.versions``) or the load fails naming the object that changed.
    ``group``: the TP group's ``torch.distributed`` group, every rank loading the same
    ``s3://`` checkpoint alike: they fetch each split-1 tensor once between them
    (:mod:`~rayload.loading.reader.group`). ``plan``: the rank's plan of ``checkpoint``
    from :func:`plan_shards` for these arguments (``rank.plan`` only applies
    ``adjust_plan``).
    ``into`` gives every shard of the plan its memory (name -> a tensor of the shard's
    shape on ``device``: a region of an engine's parameter, say): the shards are loaded
    into it, and the returned tensors are those. ``scratch`` and ``converted`` read
    straight into it when it is contiguous and of the shard's dtype (``auto`` picks one
    of them for it); other methods load fresh tensors and copy them in. ``into`` may be
    a function of the rank's plan that returns that mapping (``rank.destinations``,
    after ``rank.plan``): an engine's module built before the read
    (:func:`rayload.loading.model.model_destinations`). ``publish``: see
    :data:`~rayload.loading.arrivals.Publish` (what a holder forwards while it loads).

    Returns the tensors (this rank's shards by name) and the :class:`RankReport`, whose
    ``start_ns`` is taken before any config or header is parsed.
    """
    timer = timer if timer is not None else PhaseTimer()
    start_ns = timer.clock()
    plan, resolution, result, used = _run(
        path,
        rank,
        tp_size,
        method,
        device,
        timer,
        strict=strict,
        rules=rules,
        model_role=model_role,
        probe=probe,
        reader_options=reader_options,
        expert_parallel=expert_parallel,
        peer=peer,
        adjust_plan=adjust_plan,
        checkpoint=checkpoint,
        group=group,
        plan=plan,
        into=into,
        publish=publish,
    )
    tensors = result.tensors

    with timer.phase(POST_LOAD, device=resolution.device):
        if post_load is not None:
            post_load(tensors)
            if torch.device(resolution.device).type == "cuda":
                torch.cuda.synchronize(resolution.device)
    return tensors, _report(plan, resolution, result, start_ns, timer, model_role, used)


def reload_rank(
    path: str | os.PathLike[str],
    rank: int,
    tp_size: int,
    tensors: Mapping[str, torch.Tensor],
    method: LoadMethod | str = "scratch",
    device: str | torch.device = "cpu",
    *,
    strict: bool = False,
    rules: RulesArg = None,
    model_role: str = "main",
    probe: EnvProbe | None = None,
    timer: PhaseTimer | None = None,
    reader_options: ReaderOptions | None = None,
    expert_parallel: bool = False,
    written: set[str] | None = None,
    peer: PeerSource | None = None,
    checkpoint: Checkpoint | None = None,
    group: Any = None,
) -> RankReport:
    """Load rank ``rank`` of the checkpoint at ``path`` into ``tensors``, the rank's
    resident tensors from an earlier :func:`load_rank` (or views a ``model=`` module shares
    them through), in place: no tensor is allocated or replaced, so whatever shares their
    storage sees the new values.

    The checkpoint must give the rank the same tensors with the same shapes: checked after
    ``rank.plan`` and before any byte is written (a :class:`CheckpointError` naming the
    first tensor that differs; ``tensors`` are then untouched). ``scratch`` and
    ``converted`` read straight into the tensors; the other methods load fresh tensors and
    copy them in (the report's ``rank.to_device`` with ``copied_into_resident=True``).
    ``written`` collects the names of the tensors the backend began to write: after a
    failure, exactly those may hold new bytes. Other arguments as for :func:`load_rank`;
    the phases are the same (``rank.post_load`` is empty). ``peer`` is as for
    :func:`load_rank`: the shards of the new checkpoint from a rank that already reloaded
    it, received fresh and copied in; without one, ``method="peer"`` falls back to the
    storage method (and is a MethodUnavailableError under ``strict``). ``group`` is as
    for :func:`load_rank`.
    """
    timer = timer if timer is not None else PhaseTimer()
    start_ns = timer.clock()
    plan, resolution, result, used = _run(
        path,
        rank,
        tp_size,
        method,
        device,
        timer,
        strict=strict,
        rules=rules,
        model_role=model_role,
        probe=probe,
        reader_options=reader_options,
        expert_parallel=expert_parallel,
        into=tensors,
        written=written if written is not None else set(),
        peer=peer,
        checkpoint=checkpoint,
        group=group,
    )
    with timer.phase(POST_LOAD, device=resolution.device):
        pass
    return _report(plan, resolution, result, start_ns, timer, model_role, used)


def plan_rank(
    path: str | os.PathLike[str],
    rank: int,
    tp_size: int,
    *,
    rules: RulesArg = None,
    expert_parallel: bool = False,
    adjust_plan: AdjustPlan | None = None,
    timer: PhaseTimer | None = None,
) -> tuple[Checkpoint, RankPlan]:
    """Open the checkpoint at ``path`` (``rank.resolve``: its headers) and plan rank
    ``rank`` of ``tp_size`` (``rank.plan``, ``adjust_plan`` applied), reading no tensor:
    what an engine that decides where each shard goes before any byte is read needs
    first. Load with ``load_rank(..., checkpoint=checkpoint, plan=plan)`` (or a cut of
    the plan) afterwards."""
    check_tp_size(tp_size)
    check_rank(rank, tp_size)
    timer = timer if timer is not None else PhaseTimer()
    with timer.phase(RESOLVE, tp_size=tp_size, headers_read=True):
        checkpoint = open_checkpoint(path)
    plan = _plan(checkpoint, rank, tp_size, timer, rules, expert_parallel, adjust_plan, None)
    return checkpoint, plan


def _plan(
    checkpoint: Checkpoint,
    rank: int,
    tp_size: int,
    timer: PhaseTimer,
    rules: RulesArg,
    expert_parallel: bool,
    adjust_plan: AdjustPlan | None,
    plan: RankPlan | None,
) -> RankPlan:
    """``rank.plan``: the rank's plan (``plan`` when given: an earlier one) with
    ``adjust_plan`` applied."""
    with timer.phase(PLAN) as attrs:
        if plan is None:
            plan = plan_shards(
                checkpoint, tp_size, rules=rules, expert_parallel=expert_parallel
            ).ranks[rank]
        if adjust_plan is not None:
            plan = adjust_plan(plan, checkpoint)
        attrs.update({"bytes": plan.nbytes, "tensors": len(plan.shards)})
    return plan


def _run(
    path: str | os.PathLike[str],
    rank: int,
    tp_size: int,
    method: LoadMethod | str,
    device: str | torch.device,
    timer: PhaseTimer,
    *,
    strict: bool,
    rules: RulesArg,
    model_role: str,
    probe: EnvProbe | None,
    reader_options: ReaderOptions | None,
    expert_parallel: bool,
    into: Into | None = None,
    written: set[str] | None = None,
    peer: PeerSource | None = None,
    adjust_plan: AdjustPlan | None = None,
    checkpoint: Checkpoint | None = None,
    group: Any = None,
    plan: RankPlan | None = None,
    publish: Publish | None = None,
) -> tuple[RankPlan, Resolution, BackendResult, StorageUse]:
    """``rank.resolve``, ``rank.plan`` and the backend's phases (into ``into`` when
    given), with the fallback checks; what load_rank and reload_rank share. The
    storage's requests are counted from before the headers are read to the end of the
    backend's phases."""
    check_tp_size(tp_size)
    check_rank(rank, tp_size)
    check_model_role(model_role)
    storage = storage_for(os.fspath(path))
    before = storage.counters()
    with failing_together(group, lambda: checkpoint):
        with timer.phase(RESOLVE, tp_size=tp_size, model_role=model_role) as attrs:
            attrs["headers_read"] = checkpoint is None
            if checkpoint is None:
                checkpoint = open_checkpoint(path)
            else:
                storage.adopt(checkpoint.root, checkpoint.versions)
            requested = parse_method(method)
            may_use_fst = requested in _MAY_USE_FASTSAFETENSORS
            env = probe if probe is not None else probe_environment(fastsafetensors=may_use_fst)
            resolution = resolve_method(
                requested,
                env,
                LayoutInfo.of(checkpoint),
                tp_size=tp_size,
                device=device,
                strict=strict,
                peer_available=peer is not None,
                into=into is not None,
            )
            attrs.update(
                {
                    "method.requested": resolution.requested.value,
                    "method.selected": resolution.selected.value,
                    "device": resolution.device,
                    "resolve_reason": resolution.reason,
                }
            )
            if resolution.fallback_reason is not None:
                attrs["fallback_reason"] = resolution.fallback_reason
            if resolution.selected in _UNCHECKED_METHODS and checkpoint.layout == "converted":
                attrs["checksums_verified"] = _verify_rank_files(checkpoint, rank)
        log_fallback(rank, resolution.requested, resolution.selected, resolution.fallback_reason)

        plan = _plan(checkpoint, rank, tp_size, timer, rules, expert_parallel, adjust_plan, plan)
        if callable(into):
            with timer.phase(DESTINATIONS, tensors=len(plan.shards)):
                into = into(plan)

    backend = BACKENDS[resolution.selected](
        env,
        checkpoint=checkpoint,
        options=reader_options,
        peer=peer,
        storage=resolution.storage,
        group=group,
        publish=publish,
    )
    with timer.tagged(**storage.attributes()):
        result = backend.load(plan, resolution.device, timer, into=into, written=written)
    if result.fallback_reason is not None:
        log_fallback(rank, resolution.selected, result.effective, result.fallback_reason)
        if strict:
            raise MethodUnavailableError(
                f"rank {rank}: {resolution.selected.value} ran as {result.effective.value}: "
                f"{result.fallback_reason} (strict mode forbids falling back)"
            )
    return plan, resolution, result, StorageUse(storage.attributes(), storage.counters() - before)


def _report(
    plan: RankPlan,
    resolution: Resolution,
    result: BackendResult,
    start_ns: int,
    timer: PhaseTimer,
    model_role: str,
    used: StorageUse,
) -> RankReport:
    reasons = [r for r in (resolution.fallback_reason, result.fallback_reason) if r]
    return RankReport(
        rank=plan.rank,
        tp_size=plan.tp_size,
        device=resolution.device,
        method=MethodReport(
            requested=resolution.requested,
            selected=resolution.selected,
            effective=result.effective,
            fallback_reason="; ".join(reasons) or None,
        ),
        bytes_read=result.bytes_read,
        bytes_from_peers=result.bytes_from_peers,
        source=result.source,
        tensors=len(result.tensors),
        start_ns=start_ns,
        end_ns=timer.clock(),
        files=plan.files,
        phases=tuple(timer.records),
        model_role=model_role,
        storage=used.attributes["rayload.storage"],
        storage_endpoint=used.attributes.get("rayload.storage.endpoint"),
        storage_bucket=used.attributes.get("rayload.storage.bucket"),
        requests=used.counters.requests,
        retries=used.counters.retries,
        peer_switch=result.peer_switch,
    )


@dataclass(frozen=True)
class StorageUse:
    """The storage a rank read from (its span attributes) and what it did there."""

    attributes: dict[str, Any]
    counters: StorageCounters


def _verify_rank_files(checkpoint: Checkpoint, rank: int) -> int:
    """Check the CRC-32 of each of ``rank``'s files of a converted checkpoint against its
    manifest (CheckpointError naming the file when one differs); returns how many files
    were checked. Reads every file once more, before the backend reads it."""
    assert checkpoint.manifest is not None and checkpoint.rank_files is not None
    files = checkpoint.rank_files[rank]
    for path in files:
        verify_file_checksum(path, checkpoint.manifest.files[os.path.basename(path)])
    return len(files)
