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

Past 400 lines on purpose: each step of a load above is one function below, in the order
:func:`load` calls them, so the module reads the way a load runs; the work of each step
lives in ``actors/``, ``loading/`` and ``tracing/``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

from rayload import cluster
from rayload.actors.directory import ReplicaEntry
from rayload.actors.hooks import hooks_from_env
from rayload.actors.launch import load_ranks, plan_process_group, spawn_ranks, spawn_seconds
from rayload.actors.messages import LoadRequest, RankState
from rayload.actors.process_group import ProcessGroupSpec
from rayload.actors.rank_group import RankActorGroup
from rayload.actors.sharing import (
    RECEIVING_METHODS,
    PeerSharing,
    choose_sources,
    new_replica_id,
)
from rayload.config import LoadConfig
from rayload.driver import TraceOutputs, notify, place, release, ship_checkpoint, validate
from rayload.errors import ConfigError
from rayload.loading.checkpoint import Checkpoint, open_checkpoint
from rayload.loading.identity import peer_key
from rayload.loading.methods import LoadMethod
from rayload.loading.model import ModelContext, ModelFactory
from rayload.loading.plan import plan_shards
from rayload.loading.report import RankReport, mixed_method_warnings
from rayload.loading.rules import RulesArg, resolve_rules
from rayload.loading.storage import storage_deadline
from rayload.placement import RankPlacement
from rayload.progress import LoadProgress, ProgressCallback
from rayload.result import LoadResult, ReloadResult
from rayload.tracing import StartupTrace, publish_ray_metrics, schema, startup_metrics
from rayload.tracing.connect_spans import add_connect_spans

log = logging.getLogger(__name__)


def load(
    config: LoadConfig | str | os.PathLike[str],
    tp_size: int | None = None,
    method: str | LoadMethod | None = None,
    device: str | None = None,
    *,
    model: ModelFactory | None = None,
    progress: ProgressCallback | None = None,
    rules: RulesArg = None,
    **options: Any,
) -> LoadResult:
    """Load a checkpoint onto Ray, one actor per TP rank: ``load(LoadConfig(...))``, or
    ``load(path, tp_size, method, device, **options)`` with the fields of
    :class:`~rayload.config.LoadConfig` as keyword options (each documented there).

    Joins the Ray at ``address`` (or the one already initialized, or ``RAY_ADDRESS``), else
    starts a local Ray that :meth:`LoadResult.close` shuts down. Inside an actor that is
    in a placement group (a Ray Serve replica), the ranks take bundles ``1..tp_size`` of
    that group; otherwise rayload creates a group with ``placement_strategy``.
    ``timeout`` (seconds) bounds the whole load, placement included. ``trace_dir`` gets the
    trace files and ``otlp_endpoint`` the spans, whether the load succeeds or fails.
    ``process_group`` makes the ranks one ``torch.distributed`` group before they load
    (span ``rank.process_group``). ``replicas`` loads that many data-parallel copies of the
    TP group; with ``peers`` they (and later loads of the same checkpoint and plan) get
    their bytes from a replica that holds them (:mod:`rayload.actors.sharing`).

    Code, not configuration, goes beside the config: ``model``, a
    ``factory(context: ModelContext) -> torch.nn.Module`` that builds each rank's module
    (best on the meta device), filled in place from its shards and handed to
    :meth:`LoadResult.apply` functions as ``state.model``; ``progress``, a callback of
    :class:`~rayload.progress.LoadProgress` events; and ``rules`` when it is a parsed rule
    set (a rules file's path is the config's ``rules``).

    Raises :class:`~rayload.errors.InputError` (bad input, before any actor starts),
    :class:`~rayload.errors.RankFailedError` or :class:`~rayload.errors.RankTimeoutError`.
    """
    start_ns = time.time_ns()
    config, rules = _config(config, tp_size, method, device, rules, options)
    _check_model_factory(model)
    source = validate(config.path)
    with storage_deadline(config.timeout):  # the driver's metadata reads (object storage)
        checkpoint = open_checkpoint(source)
        rule_set = _read_rules(config.rules if rules is None else rules, checkpoint.architecture)
        plan = plan_shards(
            checkpoint, config.tp_size, rules=rule_set, expert_parallel=config.expert_parallel
        )
        key = peer_key(checkpoint, plan)
    outputs = TraceOutputs(config.trace_dir, config.otlp_endpoint)
    outputs.prepare()
    deadline = time.monotonic() + config.timeout
    connection = cluster.connect_recorded(config.address, deadline=deadline)
    trace = _start_trace(config, start_ns, connection)
    base = _request(config, source, trace, checkpoint, rule_set, model)
    # A Ray this load started ends with it: nobody else could load from its replicas.
    sharing = PeerSharing(key, source, enabled=config.peers and not connection.started_ray)
    run = _Run(config, trace, outputs, sharing, connection.started_ray, deadline, progress)
    ranks, metrics, warnings, files = run.load(base)
    return LoadResult(
        trace_id=trace.trace_id,
        plan=plan,
        ranks=ranks,
        startup_metrics=metrics,
        actors=[actor for group in run.groups for actor in group.actors],
        warnings=warnings,
        trace_files=files,
        placement=run.placements[0],
        placements=run.placements,
        trace=trace,
        process_group=run.process_group,
        replica_ids=[r.replica for r in run.requests],
        peer_key=sharing.key,
        config=config,
        _groups=run.groups,
        _sharing=sharing,
        _started_ray=connection.started_ray,
        _outputs=outputs,
        _requests=run.requests,
    )


def _config(
    config: LoadConfig | str | os.PathLike[str],
    tp_size: int | None,
    method: str | LoadMethod | None,
    device: str | None,
    rules: RulesArg,
    options: dict[str, Any],
) -> tuple[LoadConfig, RulesArg]:
    """The load's :class:`LoadConfig` from ``load``'s arguments, and the parsed rule set
    when ``rules`` is one (a rules file's path is configuration: the config's ``rules``)."""
    if isinstance(rules, str | os.PathLike):
        options["rules"], rules = rules, None
    given = {"tp_size": tp_size, "method": method, "device": device}
    options.update((k, v) for k, v in given.items() if v is not None)
    return LoadConfig.of(config, **options), rules


@dataclass
class _Run:
    """One load's Ray side, from the placement groups to the loaded ranks; what it made
    (placements, rank groups, requests) stays here for the :class:`LoadResult`."""

    config: LoadConfig
    trace: StartupTrace
    outputs: TraceOutputs
    sharing: PeerSharing
    started_ray: bool
    deadline: float
    progress: ProgressCallback | None
    placements: list[RankPlacement] = field(default_factory=list)
    groups: list[RankActorGroup] = field(default_factory=list)
    requests: list[LoadRequest] = field(default_factory=list)
    process_group: str | None = None

    def load(
        self, base: LoadRequest
    ) -> tuple[list[RankReport], dict[str, Any], list[str], dict[str, str]]:
        """Place, spawn, claim peers and load every replica: the rank reports, the startup
        metrics, the warnings and the trace files. On any failure (a head lost included)
        release everything made so far, write the failed trace and re-raise."""
        config, trace, deadline, progress = self.config, self.trace, self.deadline, self.progress
        # Backstop for Ray calls that block while the head is gone (see rayload.cluster).
        watch = cluster.HeadWatch(lambda error: self.outputs.write(trace.finish(error=str(error))))
        watch.start()
        try:
            self.sharing.start()
            watch.phase = "creating the placement group"
            placement_seconds = _place_replicas(trace, config, deadline, into=self.placements)
            notify(progress, LoadProgress("placed", config.tp_size))
            watch.phase = "starting the ranks"
            self.groups += _spawn_replicas(trace, config, self.placements, deadline)
            notify(progress, LoadProgress("spawned", config.tp_size))
            specs = [_process_group(trace, config, group, deadline) for group in self.groups]
            self.process_group = None if specs[0] is None else specs[0].backend
            watch.phase = "finding peers"
            self.requests = _claim_replicas(
                trace,
                self.sharing,
                self.groups,
                base,
                specs,
                deadline=deadline,
                fanout=self.config.peer_fanout,
            )
            watch.phase = "loading the ranks"
            by_replica = load_ranks(
                trace, self.groups, self.requests, deadline=deadline, timeout=config.timeout,
                progress=progress,
            )  # fmt: skip
            ranks = [report for reports in by_replica for report in reports]
            self.sharing.loaded([r.replica for r in self.requests])
            watch.phase = "finishing the load"
            warnings = _warn([*self.sharing.warnings, *mixed_method_warnings(ranks)])
            metrics = _metrics(config, ranks, self.groups, placement_seconds)
            files = self.outputs.write(trace.finish())
            watch.stop()
        except BaseException as exc:
            watched_to_the_end = watch.stop()
            if not cluster.head_lost():
                self.sharing.drop()
            release(self.groups, self.placements, self.started_ray)
            if watched_to_the_end:  # else the watch already wrote the failed trace
                self.outputs.write(trace.finish(error=str(exc) or type(exc).__name__))
            raise
        return ranks, metrics, warnings, files


def _read_rules(rules: RulesArg, architecture: str | None) -> RulesArg:
    """A rules file read once, here: the ranks' nodes may not see the driver's files."""
    return resolve_rules(rules, architecture) if isinstance(rules, str) else rules


def _check_model_factory(model: object) -> None:
    if model is not None and not callable(model):
        raise ConfigError(
            f"model must be a factory(context: ModelContext) -> torch.nn.Module, got "
            f"{type(model).__name__}"
        )


def _start_trace(
    config: LoadConfig, start_ns: int, connection: cluster.ConnectRecord
) -> StartupTrace:
    """The load's trace, its root starting where the load started, so driver-side config
    parsing and Ray start-up are inside the trace's total, as their own spans."""
    trace = StartupTrace(tp_size=config.tp_size, model_role=config.model_role, start_ns=start_ns)
    trace.add_span(schema.PREPARE_SPAN, start_ns, connection.start_ns, {"tp_size": config.tp_size})
    add_connect_spans(trace, connection)
    return trace


def _request(
    config: LoadConfig,
    source: str,
    trace: StartupTrace,
    checkpoint: Checkpoint,
    rules: RulesArg,
    model: ModelFactory | None,
) -> LoadRequest:
    """What every rank is asked to do, before its replica, process group and peers (the
    ranks of an ``s3://`` checkpoint get the driver's, so they read no header again)."""
    return LoadRequest(
        path=source,
        tp_size=config.tp_size,
        method=str(config.method),
        device=config.device,
        traceparent=trace.traceparent(),
        strict=config.strict,
        rules=rules,
        model_role=config.model_role,
        model=model,
        model_config=dict(checkpoint.config or {}) if model is not None else None,
        expert_parallel=config.expert_parallel,
        shared_copy=config.shared_copy,
        checkpoint=ship_checkpoint(checkpoint),
    )


def _place_replicas(
    trace: StartupTrace, config: LoadConfig, deadline: float, *, into: list[RankPlacement]
) -> float:
    """A placement per replica, appended to ``into`` as each is made (so a failure
    releases the ones made before); the seconds they took together."""
    seconds = 0.0
    for _ in range(config.replicas):
        placement, took = place(
            trace,
            config.tp_size,
            config.device,
            config.placement_strategy,
            deadline,
            reuse=config.replicas == 1,
        )
        into.append(placement)
        seconds += took
    return seconds


def _spawn_replicas(
    trace: StartupTrace, config: LoadConfig, placements: list[RankPlacement], deadline: float
) -> list[RankActorGroup]:
    """Every replica's rank actors, started together (span ``rayload.spawn``)."""
    hooks = hooks_from_env()
    want_gpu = config.device != "cpu"
    groups = [RankActorGroup(p, want_gpu=want_gpu, hooks=hooks) for p in placements]
    spawn_ranks(trace, groups, deadline=deadline, timeout=config.timeout)
    return groups


def _process_group(
    trace: StartupTrace, config: LoadConfig, group: RankActorGroup, deadline: float
) -> ProcessGroupSpec | None:
    return plan_process_group(
        trace,
        group,
        config.process_group,
        config.device,
        deadline=deadline,
        timeout=config.timeout,
    )


def _metrics(
    config: LoadConfig,
    ranks: list[RankReport],
    groups: list[RankActorGroup],
    placement_seconds: float,
) -> dict[str, Any]:
    """The load's startup metrics, published to Ray's metrics too."""
    metrics = startup_metrics(
        ranks,
        placement_seconds=placement_seconds,
        actor_startup_seconds=_spawn_seconds(groups),
        model_role=config.model_role,
    )
    publish_ray_metrics(metrics)
    return metrics


def _warn(warnings: list[str]) -> list[str]:
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


def _claim_replicas(
    trace: StartupTrace,
    sharing: PeerSharing,
    groups: list[RankActorGroup],
    base: LoadRequest,
    group_specs: list[ProcessGroupSpec | None],
    *,
    deadline: float,
    fanout: int,
) -> list[LoadRequest]:
    """Register each replica in the peer directory, in order, and give its ranks their
    sources (span ``rayload.peers``; ``fanout``: :func:`choose_sources`): each replica's
    request."""
    start = time.time_ns()
    several = len(groups) > 1
    earlier: list[ReplicaEntry] = []
    requests = []
    sourced = 0
    for index, (group, spec) in enumerate(zip(groups, group_specs, strict=True)):
        holders, entry = sharing.claim(new_replica_id(), group, earlier)
        earlier.append(entry)
        receives = LoadMethod(base.method) in RECEIVING_METHODS
        sources = choose_sources(holders, entry, fanout=fanout) if receives else ()
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
            "peer.fanout": fanout,
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
    "LoadConfig",
    "LoadProgress",
    "LoadResult",
    "ModelContext",
    "ProgressCallback",
    "RankState",
    "ReloadResult",
    "load",
]
