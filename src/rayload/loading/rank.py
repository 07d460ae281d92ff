"""Load one TP rank in the current process: no Ray needed.

:func:`load_rank` is the whole rank load in order, one :class:`PhaseTimer` phase per step:
``rank.resolve`` (headers, environment probe, method and device; for fastsafetensors on a
converted checkpoint also the CRC-32 of the rank's files, which that backend does not
check), ``rank.plan`` (this
rank's byte ranges), the backend's ``rank.read`` / ``rank.to_device`` / ``rank.sync``,
then ``rank.post_load``. The Ray rank actor calls it with its own timer so the phases of a
failed load survive the exception.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from rayload.errors import MethodUnavailableError
from rayload.loading.backends import BACKENDS
from rayload.loading.checkpoint import Checkpoint, open_checkpoint
from rayload.loading.manifest import verify_file_checksum
from rayload.loading.methods import LoadMethod, MethodReport
from rayload.loading.plan import plan_shards
from rayload.loading.probe import EnvProbe, probe_environment
from rayload.loading.reader import ReaderOptions
from rayload.loading.report import PLAN, POST_LOAD, RESOLVE, PhaseTimer, RankReport
from rayload.loading.resolve import LayoutInfo, log_fallback, resolve_method
from rayload.loading.rules import RulesArg
from rayload.options import check_model_role, check_rank, check_tp_size, parse_method

PostLoad = Callable[[dict[str, torch.Tensor]], object]
"""Post-load work on the loaded tensors (e.g. weight processing); its result is ignored."""

_MAY_USE_FASTSAFETENSORS = frozenset(
    {LoadMethod.AUTO, LoadMethod.FASTSAFETENSORS, LoadMethod.FASTSAFETENSORS_GDR}
)
"""Requested methods that may end up running fastsafetensors: only these import it."""

_UNCHECKED_METHODS = frozenset({LoadMethod.FASTSAFETENSORS, LoadMethod.FASTSAFETENSORS_GDR})
"""Methods that can read a converted checkpoint's rank files but do not check their
CRC-32s themselves (the converted backend does, while it reads)."""


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
) -> tuple[dict[str, torch.Tensor], RankReport]:
    """Load rank ``rank`` of ``tp_size`` of the checkpoint at ``path`` onto ``device``.

    ``method`` is a :class:`LoadMethod` or its string; ``device`` is ``auto`` (the local
    GPU, ``cuda:0`` of the visible set, else cpu), ``cpu``, ``cuda`` or ``cuda:N``.
    ``strict`` turns any fallback (chosen up front or detected after the read) into
    :class:`MethodUnavailableError`. ``probe`` replaces the environment probe (tests);
    ``timer`` collects the phases (pass your own to keep them when this raises);
    ``post_load(tensors)`` runs inside ``rank.post_load``, followed by a device sync.
    ``expert_parallel`` gives the rank only its experts, whole
    (:mod:`~rayload.loading.experts`).

    Returns the tensors (this rank's shards by name) and the :class:`RankReport`, whose
    ``start_ns`` is taken before any config or header is parsed.
    """
    timer = timer if timer is not None else PhaseTimer()
    start_ns = timer.clock()
    check_tp_size(tp_size)
    check_rank(rank, tp_size)
    check_model_role(model_role)
    with timer.phase(RESOLVE, tp_size=tp_size, model_role=model_role) as attrs:
        checkpoint = open_checkpoint(path)
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

    with timer.phase(PLAN) as attrs:
        plan = plan_shards(checkpoint, tp_size, rules=rules, expert_parallel=expert_parallel).ranks[
            rank
        ]
        attrs.update({"bytes": plan.nbytes, "tensors": len(plan.shards)})

    backend = BACKENDS[resolution.selected](env, checkpoint=checkpoint, options=reader_options)
    result = backend.load(plan, resolution.device, timer)
    if result.fallback_reason is not None:
        log_fallback(rank, resolution.selected, result.effective, result.fallback_reason)
        if strict:
            raise MethodUnavailableError(
                f"rank {rank}: {resolution.selected.value} ran as {result.effective.value}: "
                f"{result.fallback_reason} (strict mode forbids falling back)"
            )
    tensors = result.tensors

    with timer.phase(POST_LOAD, device=resolution.device):
        if post_load is not None:
            post_load(tensors)
            if torch.device(resolution.device).type == "cuda":
                torch.cuda.synchronize(resolution.device)

    reasons = [r for r in (resolution.fallback_reason, result.fallback_reason) if r]
    report = RankReport(
        rank=rank,
        tp_size=tp_size,
        device=resolution.device,
        method=MethodReport(
            requested=resolution.requested,
            selected=resolution.selected,
            effective=result.effective,
            fallback_reason="; ".join(reasons) or None,
        ),
        bytes_read=result.bytes_read,
        tensors=len(tensors),
        start_ns=start_ns,
        end_ns=timer.clock(),
        files=plan.files,
        phases=tuple(timer.records),
        model_role=model_role,
    )
    return tensors, report


def _verify_rank_files(checkpoint: Checkpoint, rank: int) -> int:
    """Check the CRC-32 of each of ``rank``'s files of a converted checkpoint against its
    manifest (CheckpointError naming the file when one differs); returns how many files
    were checked. Reads every file once more, before the backend reads it."""
    assert checkpoint.manifest is not None and checkpoint.rank_files is not None
    files = checkpoint.rank_files[rank]
    for path in files:
        verify_file_checksum(path, checkpoint.manifest.files[os.path.basename(path)])
    return len(files)
