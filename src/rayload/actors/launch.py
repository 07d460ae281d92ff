"""The traced start-up of a rank group: spawn the actors and load every rank, turning each
step into spans of the load's :class:`~rayload.tracing.StartupTrace` (``rayload.spawn`` per
rank, every rank's own spans clock-corrected, a stand-in ERROR span for a rank that sent
none) and failures into the error that names the rank and its node.

:class:`~rayload.actors.rank_group.RankActorGroup` does the Ray side; this module only joins it
to the trace, so :func:`rayload.load` reads as the sequence of steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NoReturn

from rayload.actors.messages import ActorInfo, LoadRequest, RankOutcome
from rayload.actors.process_group import (
    ProcessGroupSpec,
    init_method,
    rendezvous_host,
    resolve_backend,
)
from rayload.actors.rank_group import RankActorGroup, RankFailure, failure_error
from rayload.errors import RayloadError
from rayload.loading.report import RankReport
from rayload.progress import LoadProgress, ProgressCallback
from rayload.tracing import StartupTrace, schema
from rayload.tracing.spawn_spans import SpawnPhase, SpawnTimes, spawn_phases


def spawn_ranks(
    trace: StartupTrace, groups: Sequence[RankActorGroup], *, deadline: float, timeout: float
) -> None:
    """Start every rank actor of every replica's group at once, measure their clock
    offsets, record ``rayload.spawn`` (with its phases) and ``rayload.clock_sync``; a
    failure stops every group."""
    since_ns = time.time_ns()
    started = [group.start() for group in groups]
    failed: tuple[RankActorGroup, RankFailure] | None = None
    for group, waiting in zip(groups, started, strict=True):
        failure = group.wait_started(waiting, deadline=deadline)
        if failure is None:
            failure = group.measure_clocks(deadline=deadline)
        if failure is not None:
            failed = group, failure
            break
    for index, group in enumerate(groups):
        _record_spawns(trace, group, replica=index if len(groups) > 1 else None)
    if failed is not None:
        group, failure = failed
        _fail(trace, group, failure, answered=(), since_ns=since_ns, timeout=timeout, others=groups)


def plan_process_group(
    trace: StartupTrace,
    group: RankActorGroup,
    requested: str | None,
    device: str,
    *,
    deadline: float,
    timeout: float,
) -> ProcessGroupSpec | None:
    """The process group the ranks join at the start of their load (None: none asked):
    one backend for all from the ranks' resolved devices, rank 0's address (loopback when
    every rank is on one node), an init timeout bounded by what is left of ``deadline``."""
    if requested is None:
        return None
    since_ns = time.time_ns()
    setups, failure = group.setup(device, deadline=deadline)
    if failure is not None:
        _fail(trace, group, failure, answered=(), since_ns=since_ns, timeout=timeout)
    backend = resolve_backend(requested, {rank: s.device or "cpu" for rank, s in setups.items()})
    node_ips = {rank: s.node_ip for rank, s in setups.items() if s.node_ip is not None}
    node_ids = {rank: group.node_id(rank) for rank in range(group.tp_size)}
    port = setups[0].port
    assert port is not None, "rank 0 answers with a port"
    return ProcessGroupSpec(
        backend=backend,
        init_method=init_method(rendezvous_host(node_ips, node_ids), port),
        world_size=group.tp_size,
        timeout_s=deadline - time.monotonic(),
    )


def load_ranks(
    trace: StartupTrace,
    groups: Sequence[RankActorGroup],
    requests: Sequence[LoadRequest],
    *,
    deadline: float,
    timeout: float,
    progress: ProgressCallback | None,
) -> list[list[RankReport]]:
    """Load every rank of every replica at once (``requests[i]`` for ``groups[i]``), merge
    their spans into the trace, return each replica's reports by rank. A failed rank
    stops every group: a load is all its replicas or nothing."""
    notify = _rank_notifier(progress, sum(group.tp_size for group in groups))
    started = [
        group.start_load(r.until(deadline, timeout))
        for group, r in zip(groups, requests, strict=True)
    ]
    replicas = []
    for group, dispatched in zip(groups, started, strict=True):
        finished = group.finish_load(dispatched, deadline=deadline, on_rank_done=notify)
        for outcome in finished.outcomes.values():
            trace.add_rank(outcome.spans, *group.clock_offsets.get(outcome.rank, (0, None)))
        if finished.failure is not None:
            _fail(
                trace,
                group,
                finished.failure,
                answered=finished.outcomes.keys(),
                since_ns=finished.dispatch_ns,
                timeout=timeout,
                others=groups,
            )
        reports = [finished.outcomes[rank].report for rank in range(group.tp_size)]
        replicas.append([report for report in reports if report is not None])
    return replicas


def reload_ranks(
    trace: StartupTrace,
    group: RankActorGroup,
    request: LoadRequest,
    *,
    deadline: float,
    timeout: float,
) -> list[RankReport]:
    """Reload every rank into its resident tensors, merge their spans into ``trace``,
    return the reports by rank. The ranks keep running whatever happens (their weights
    are the caller's to keep or drop); a failure raises the error naming the first
    failed rank, with what every rank overwrote (``.overwritten``: rank -> tensors, empty
    where nothing was written)."""
    finished = group.reload(request.until(deadline, timeout), deadline=deadline)
    for outcome in finished.outcomes.values():
        trace.add_rank(outcome.spans, *group.clock_offsets.get(outcome.rank, (0, None)))
    failure = finished.failure
    if failure is not None:
        now = time.time_ns()
        for rank in range(group.tp_size):
            if rank not in finished.outcomes:
                cause = failure.cause if rank == failure.rank else "no answer"
                trace.add_missing_rank(rank, group.node_id(rank), cause, finished.dispatch_ns, now)
        raise _reload_error(failure, finished.outcomes, group.tp_size, timeout)
    reports = [finished.outcomes[rank].report for rank in range(group.tp_size)]
    return [report for report in reports if report is not None]


def _reload_error(
    failure: RankFailure, outcomes: Mapping[int, RankOutcome], tp_size: int, timeout: float
) -> RayloadError:
    """The failed reload's error, saying which tensors each rank overwrote."""
    error = failure_error(failure, timeout_s=timeout)
    overwritten = {rank: o.overwritten for rank, o in sorted(outcomes.items())}
    unknown = [rank for rank in range(tp_size) if rank not in outcomes]
    parts = []
    for rank, names in overwritten.items():
        if names:
            shown = ", ".join(names[:_SHOWN_TENSORS])
            more = f" and {len(names) - _SHOWN_TENSORS} more" if len(names) > _SHOWN_TENSORS else ""
            parts.append(f"rank {rank} overwrote {len(names)} tensor(s): {shown}{more}")
    if unknown:
        parts.append(f"rank(s) {unknown} did not answer: their tensors may be partly overwritten")
    if parts:
        summary = "; ".join(parts) + "; every other tensor keeps the weights it had"
    else:
        summary = "no tensor was overwritten: every rank keeps the weights it had"
    error.args = (f"reload failed: {error}; {summary}",)
    error.overwritten = overwritten  # type: ignore[attr-defined]
    return error


_SHOWN_TENSORS = 5


def _record_spawns(trace: StartupTrace, group: RankActorGroup, *, replica: int | None) -> None:
    """One ``rayload.spawn`` span per rank that came up, with the phases of its start-up
    as children (:func:`~rayload.tracing.spawn_spans.spawn_phases`), then one
    ``rayload.clock_sync`` per rank whose clock was measured (``replica``: which replica
    of a load with several)."""
    extra = {} if replica is None else {"replica": replica}
    for rank, info in sorted(group.infos.items()):
        start, end = group.spawn_interval(rank)
        offset = group.clock_offsets.get(rank, (0, 0))[0]
        attributes: dict[str, Any] = {
            "rank": rank,
            "node_id": info.node_id,
            "pid": info.pid,
            "gpu_ids": ",".join(info.gpu_ids),
            "cuda_context_skipped": info.cuda_skipped,
            **extra,
        }
        if info.process_start_ns is not None:
            attributes["process_age_ms"] = (start - (info.process_start_ns - offset)) / 1e6
        spawn = trace.add_span(schema.SPAWN_SPAN, start, end, attributes)
        _record_phases(trace, spawn, rank, spawn_phases(start, end, _spawn_times(info, offset)))
    for rank, samples in sorted(group.clock_samples.items()):
        if not samples or rank not in group.clock_offsets:
            continue
        offset_ns, rtt_ns = group.clock_offsets[rank]
        trace.add_span(
            schema.CLOCK_SYNC_SPAN,
            min(t_send for t_send, _, _ in samples),
            max(t_recv for _, _, t_recv in samples),
            {
                "rank": rank,
                **extra,
                "rounds": len(samples),
                "clock_offset_ms": offset_ns / 1e6,
                "clock_rtt_ms": rtt_ns / 1e6,
            },
        )


def _spawn_times(info: ActorInfo, offset: int) -> SpawnTimes:
    """The actor's own start-up times moved onto the driver's clock."""
    return SpawnTimes(
        process_start_ns=None if info.process_start_ns is None else info.process_start_ns - offset,
        imports=[(package, a - offset, b - offset) for package, a, b in info.imports],
        import_children=[
            (package, module, a - offset, b - offset)
            for package, module, a, b in info.import_children
        ],
        init_start_ns=info.init_start_ns - offset,
        cuda_context=None
        if info.cuda_context is None
        else (info.cuda_context[0] - offset, info.cuda_context[1] - offset),
    )


def _record_phases(
    trace: StartupTrace, parent: Any, rank: int, phases: Sequence[SpawnPhase]
) -> None:
    for phase in phases:
        span = trace.add_span(
            phase.name,
            phase.start_ns,
            phase.end_ns,
            {"rank": rank, **phase.attributes},
            parent=parent,
        )
        _record_phases(trace, span, rank, phase.children)


def spawn_seconds(group: RankActorGroup) -> dict[int, float]:
    """Each started rank's ``actor_startup_seconds``: its ``rayload.spawn`` duration."""
    return {
        rank: (end - start) / 1e9
        for rank in group.infos
        for start, end in [group.spawn_interval(rank)]
    }


def _fail(
    trace: StartupTrace,
    group: RankActorGroup,
    failure: RankFailure,
    *,
    answered: Collection[int],
    since_ns: int,
    timeout: float,
    others: Sequence[RankActorGroup] = (),
) -> NoReturn:
    """Stop every rank (of ``group`` and ``others``), give each rank of ``group`` that sent
    no spans a stand-in ERROR span, and raise the error naming the failed rank (the caller
    writes the trace)."""
    now = time.time_ns()
    for rank in range(group.tp_size):
        if rank in answered:
            continue
        cause = failure.cause if rank == failure.rank else f"stopped: rank {failure.rank} failed"
        trace.add_missing_rank(rank, group.node_id(rank), cause, since_ns, now)
    for other in (group, *others):
        other.kill()
    raise failure_error(failure, timeout_s=timeout)


def _rank_notifier(
    progress: ProgressCallback | None, tp_size: int
) -> Callable[[RankOutcome], None] | None:
    if progress is None:
        return None
    done = 0

    def notify(outcome: RankOutcome) -> None:
        nonlocal done
        done += 1
        report = outcome.report
        assert report is not None
        progress(
            LoadProgress(
                "rank_loaded",
                tp_size,
                rank=outcome.rank,
                node_id=outcome.node_id,
                bytes_read=report.bytes_read,
                seconds=report.seconds,
                method=report.method.effective.value,
                done=done,
            )
        )

    return notify
