"""The public entry point: :func:`load` a checkpoint onto Ray, one actor per TP rank (one TP
group per replica), and get a :class:`~rayload.result.LoadResult` holding the resident
weights, the per-rank reports, the startup metrics and the trace id.

One load, in order (each step a span of the startup trace)::

    validate input (driver)  ->  placement group per replica  ->  spawn every rank actor
      (parallel)  ->  clock offsets  ->  [ranks' devices + rank 0's address, per replica,
      for a process group]  ->  claim the replicas in the peer directory: where each rank
      gets its bytes (storage, or a replica that holds them)  ->  load every rank
      (parallel, one deadline): join the process group, read (or receive) the shards,
      build and fill the model= module  ->  trace + metrics

After the load, ``LoadResult.apply`` runs engine code on every rank; the engine phases it
records (``state.phase(name)``) join the same trace, and ``LoadResult.write_trace`` writes
it again with them.

Bad input fails in the driver before any actor starts (:class:`InputError`). A rank that
raises, dies or hangs ends the load with :class:`RankFailedError` /
:class:`RankTimeoutError`; the other ranks (of every replica) are stopped, the placement
groups removed, the replicas dropped from the peer directory, and the trace is still
written with the failing rank marked ERROR.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

from rayload import cluster
from rayload.actors.directory import ReplicaEntry
from rayload.actors.hooks import hooks_from_env
from rayload.actors.launch import load_ranks, plan_process_group, spawn_ranks, spawn_seconds
from rayload.actors.messages import LoadRequest, RankState
from rayload.actors.process_group import check_process_group
from rayload.actors.rank_group import RankActorGroup
from rayload.actors.sharing import (
    RECEIVING_METHODS,
    PeerSharing,
    choose_sources,
    new_replica_id,
)
from rayload.driver import TraceOutputs, notify, place, release, validate
from rayload.errors import ConfigError
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.identity import peer_key
from rayload.loading.methods import LoadMethod
from rayload.loading.model import ModelContext, ModelFactory
from rayload.loading.plan import plan_shards
from rayload.loading.report import mixed_method_warnings
from rayload.loading.rules import resolve_rules
from rayload.options import check_flag, check_replicas
from rayload.placement import RankPlacement
from rayload.progress import LoadProgress, ProgressCallback
from rayload.result import LoadResult, ReloadResult
from rayload.tracing import StartupTrace, publish_ray_metrics, schema, startup_metrics
from rayload.tracing.connect_spans import add_connect_spans

log = logging.getLogger(__name__)

"""Requested methods for which ranks are given peer sources (others read storage)."""


def load(
    path: str | os.PathLike[str],
    tp_size: int,
    method: str | LoadMethod = "auto",
    device: str = "auto",
    *,
    strict: bool = False,
    address: str | None = None,
    placement_strategy: str = "STRICT_PACK",
    trace_dir: str | os.PathLike[str] | None = None,
    otlp_endpoint: str | None = None,
    timeout: float = 600.0,
    rules: Any = None,
    model_role: str = "main",
    progress: ProgressCallback | None = None,
    process_group: str | None = "auto",
    model: ModelFactory | None = None,
    expert_parallel: bool = False,
    replicas: int = 1,
    peers: bool = True,
    shared_copy: bool = False,
) -> LoadResult:
    """Load the checkpoint at ``path`` onto Ray with ``tp_size`` ranks, one actor each.

    Joins the Ray at ``address`` (or the one already initialized, or ``RAY_ADDRESS``), else
    starts a local Ray that :meth:`LoadResult.close` shuts down. Inside an actor that is
    in a placement group (a Ray Serve replica), the ranks take bundles ``1..tp_size`` of
    that group; otherwise rayload creates a group with ``placement_strategy``.
    ``timeout`` (seconds) bounds the whole load, placement included. ``trace_dir`` gets the
    trace files and ``otlp_endpoint`` the spans, whether the load succeeds or fails.

    ``process_group`` (``auto``, ``gloo``, ``nccl`` or None) makes the ranks one
    ``torch.distributed`` group before they load (span ``rank.process_group``): ``auto``
    is ``nccl`` when every rank's device is CUDA, else ``gloo``; None makes none.
    ``model``, a ``factory(context: ModelContext) -> torch.nn.Module``, builds each rank's
    module (best on the meta device) once its shards are loaded; rayload fills it in place
    from the shards (:func:`rayload.loading.model.fill_model`, span ``rank.model``) and
    hands it to :meth:`LoadResult.apply` functions as ``state.model``.
    ``expert_parallel`` divides a mixture-of-experts model's experts among the ranks,
    whole, instead of splitting each (:mod:`rayload.loading.experts`).

    ``replicas`` loads that many data-parallel copies of the TP group (a placement group
    each, one trace with a lane per replica and rank). ``peers`` offers the loaded
    replicas to other loads of the same checkpoint and plan through the cluster's peer
    directory, and lets ``auto`` (or ``peer``) ranks receive their bytes from a replica
    that holds them instead of reading storage (:mod:`rayload.actors.sharing`): with
    several replicas started together, each byte is read from storage once. With
    ``peers=False`` no directory is used; the replicas of this load still share.
    ``shared_copy`` makes each loaded rank also keep a copy of its shards in its node's
    Ray object store (host shared memory, the shards' size per rank), so that a new
    replica on the same node copies them from there once instead of receiving them over
    TCP; receivers on other nodes are unaffected.

    Raises :class:`~rayload.errors.InputError` (bad input, before any actor starts),
    :class:`~rayload.errors.RankFailedError` or :class:`~rayload.errors.RankTimeoutError`.
    """
    start_ns = time.time_ns()
    source = validate(path, tp_size, method, device, placement_strategy, timeout, model_role)
    check_replicas(replicas)
    check_flag("shared_copy", shared_copy)
    check_process_group(process_group, device)
    if model is not None and not callable(model):
        raise ConfigError(
            f"model must be a factory(context: ModelContext) -> torch.nn.Module, got "
            f"{type(model).__name__}"
        )
    checkpoint = open_checkpoint(source)
    if isinstance(rules, str | os.PathLike):
        # Read a rules file once, here: the ranks' nodes may not see the driver's files.
        rules = resolve_rules(rules, checkpoint.architecture)
    plan = plan_shards(checkpoint, tp_size, rules=rules, expert_parallel=expert_parallel)
    key = peer_key(checkpoint, plan)
    outputs = TraceOutputs(trace_dir, otlp_endpoint)
    outputs.prepare()
    hooks = hooks_from_env()
    deadline = time.monotonic() + timeout
    connection = cluster.connect_recorded(address, deadline=deadline)
    started_ray = connection.started_ray
    # The root span starts where the load started, so driver-side config parsing and Ray
    # start-up are inside the trace's total, as their own spans.
    trace = StartupTrace(tp_size=tp_size, model_role=model_role, start_ns=start_ns)
    trace.add_span(schema.PREPARE_SPAN, start_ns, connection.start_ns, {"tp_size": tp_size})
    add_connect_spans(trace, connection)
    placements: list[RankPlacement] = []
    groups: list[RankActorGroup] = []
    # A Ray this load started ends with it: nobody else could load from its replicas.
    sharing = PeerSharing(key, source, enabled=peers and not started_ray)
    # Backstop for Ray calls that block while the head is gone (see rayload.cluster).
    watch = cluster.HeadWatch(lambda error: outputs.write(trace.finish(error=str(error))))
    watch.start()
    try:
        sharing.start()
        watch.phase = "creating the placement group"
        placement_seconds = 0.0
        for _ in range(replicas):
            placement, seconds = place(
                trace, tp_size, device, placement_strategy, deadline, reuse=replicas == 1
            )
            placements.append(placement)
            placement_seconds += seconds
        notify(progress, LoadProgress("placed", tp_size))
        groups = [RankActorGroup(p, want_gpu=device != "cpu", hooks=hooks) for p in placements]
        watch.phase = "starting the ranks"
        spawn_ranks(trace, groups, deadline=deadline, timeout=timeout)
        notify(progress, LoadProgress("spawned", tp_size))
        group_specs = [
            plan_process_group(trace, g, process_group, device, deadline=deadline, timeout=timeout)
            for g in groups
        ]
        base = LoadRequest(
            path=source,
            tp_size=tp_size,
            method=str(LoadMethod(method)),
            device=device,
            traceparent=trace.traceparent(),
            strict=strict,
            rules=rules,
            model_role=model_role,
            model=model,
            model_config=dict(checkpoint.config or {}) if model is not None else None,
            expert_parallel=expert_parallel,
            shared_copy=shared_copy,
        )
        watch.phase = "finding peers"
        requests = _claim_replicas(
            trace, sharing, groups, base, group_specs, deadline=deadline, method=method
        )
        watch.phase = "loading the ranks"
        by_replica = load_ranks(
            trace, groups, requests, deadline=deadline, timeout=timeout, progress=progress
        )
        ranks = [report for reports in by_replica for report in reports]
        sharing.loaded([r.replica for r in requests])
        warnings = [*sharing.warnings, *mixed_method_warnings(ranks)]
        for warning in warnings:
            log.warning("%s", warning)
        metrics = startup_metrics(
            ranks,
            placement_seconds=placement_seconds,
            actor_startup_seconds=_spawn_seconds(groups),
            model_role=model_role,
        )
        watch.phase = "finishing the load"
        publish_ray_metrics(metrics)
        files = outputs.write(trace.finish())
        watch.stop()
    except BaseException as exc:
        watched_to_the_end = watch.stop()
        if not cluster.head_lost():
            sharing.drop()
        release(groups, placements, started_ray)
        if watched_to_the_end:  # else the watch already wrote the failed trace
            outputs.write(trace.finish(error=str(exc) or type(exc).__name__))
        raise
    return LoadResult(
        trace_id=trace.trace_id,
        plan=plan,
        ranks=ranks,
        startup_metrics=metrics,
        actors=[actor for group in groups for actor in group.actors],
        warnings=warnings,
        trace_files=files,
        placement=placements[0],
        placements=placements,
        trace=trace,
        process_group=None if group_specs[0] is None else group_specs[0].backend,
        replica_ids=[r.replica for r in requests],
        peer_key=key,
        _groups=groups,
        _sharing=sharing,
        _started_ray=started_ray,
        _outputs=outputs,
        _requests=requests,
    )


def _claim_replicas(
    trace: StartupTrace,
    sharing: PeerSharing,
    groups: list[RankActorGroup],
    base: LoadRequest,
    group_specs: list[Any],
    *,
    deadline: float,
    method: str | LoadMethod,
) -> list[LoadRequest]:
    """Register each replica in the peer directory, in order, and give its ranks their
    sources (span ``rayload.peers``): each replica's request."""
    start = time.time_ns()
    several = len(groups) > 1
    earlier: list[ReplicaEntry] = []
    requests = []
    sourced = 0
    for index, (group, spec) in enumerate(zip(groups, group_specs, strict=True)):
        holders, entry = sharing.claim(new_replica_id(), group, earlier)
        earlier.append(entry)
        sources = choose_sources(holders, entry) if LoadMethod(method) in RECEIVING_METHODS else ()
        sourced += sum(s is not None for s in sources)
        requests.append(
            replace(
                base,
                replica=entry.replica,
                replica_index=index if several else None,
                process_group=spec,
                peers=sources,
                peer_wait_s=max(deadline - time.monotonic(), 0.0),
            )
        )
    trace.add_span(
        schema.PEERS_SPAN,
        start,
        time.time_ns(),
        {
            "peer.key": sharing.key,
            "replicas": len(groups),
            "ranks_with_peer_source": sourced,
            "peer.directory": sharing.available,
        },
    )
    return requests


def _spawn_seconds(groups: list[RankActorGroup]) -> dict[int, float]:
    """``actor_startup_seconds`` by ``replica * tp_size + rank``."""
    return {
        index * group.tp_size + rank: value
        for index, group in enumerate(groups)
        for rank, value in spawn_seconds(group).items()
    }


__all__ = [
    "LoadProgress",
    "LoadResult",
    "ModelContext",
    "ProgressCallback",
    "RankState",
    "ReloadResult",
    "load",
]
