"""The traced start-up of a rank group: spawn the actors and load every rank, turning each
step into spans of the load's :class:`~rayload.tracing.StartupTrace` (``rayload.spawn`` per
rank, every rank's own spans clock-corrected, a stand-in ERROR span for a rank that sent
none) and failures into the error that names the rank and its node.

:class:`~rayload.actors.rank_group.RankActorGroup` does the Ray side; this module only joins it
to the trace, so :func:`rayload.load` reads as the sequence of steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any, NoReturn

from rayload.actors.messages import LoadRequest, RankOutcome
from rayload.actors.process_group import (
    ProcessGroupSpec,
    init_method,
    rendezvous_host,
    resolve_backend,
)
from rayload.actors.rank_group import RankActorGroup, RankFailure, failure_error
from rayload.loading.report import RankReport
from rayload.progress import LoadProgress, ProgressCallback
from rayload.tracing import StartupTrace, schema


def spawn_ranks(
    trace: StartupTrace, group: RankActorGroup, *, deadline: float, timeout: float
) -> None:
    """Start every rank's actor, measure the clock offsets, record ``rayload.spawn``."""
    since_ns = time.time_ns()
    failure = group.spawn(deadline=deadline)
    if failure is None:
        failure = group.measure_clocks(deadline=deadline)
    _record_spawns(trace, group)
    if failure is not None:
        _fail(trace, group, failure, answered=(), since_ns=since_ns, timeout=timeout)


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
    group: RankActorGroup,
    request: LoadRequest,
    *,
    deadline: float,
    timeout: float,
    progress: ProgressCallback | None,
) -> list[RankReport]:
    """Load every rank, merge their spans into the trace, return the reports by rank."""
    notify = _rank_notifier(progress, group.tp_size)
    finished = group.load(request, deadline=deadline, on_rank_done=notify)
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
        )
    reports = [finished.outcomes[rank].report for rank in range(group.tp_size)]
    return [report for report in reports if report is not None]


def _record_spawns(trace: StartupTrace, group: RankActorGroup) -> None:
    """One ``rayload.spawn`` span per rank that came up."""
    for rank, info in sorted(group.infos.items()):
        start, end = group.spawn_interval(rank)
        attributes: dict[str, Any] = {
            "rank": rank,
            "node_id": info.node_id,
            "pid": info.pid,
            "gpu_ids": ",".join(info.gpu_ids),
        }
        if info.process_start_ns is not None:
            offset = group.clock_offsets.get(rank, (0, 0))[0]
            attributes["process_age_ms"] = (start - (info.process_start_ns - offset)) / 1e6
        trace.add_span(schema.SPAWN_SPAN, start, end, attributes)


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
) -> NoReturn:
    """Stop every rank, give each rank that sent no spans a stand-in ERROR span, and raise
    the error naming the failed rank (the caller writes the trace)."""
    now = time.time_ns()
    for rank in range(group.tp_size):
        if rank in answered:
            continue
        cause = failure.cause if rank == failure.rank else f"stopped: rank {failure.rank} failed"
        trace.add_missing_rank(rank, group.node_id(rank), cause, since_ns, now)
    group.kill()
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
