"""Driver side of the rank actors: spawn them into their bundles, measure their clocks, load
every rank in parallel and stop them all.

Nothing here raises for a rank's failure: :meth:`RankActorGroup.wait_started` and
:meth:`RankActorGroup.finish_load` return a :class:`RankFailure` (or None) so the caller can still
record the trace before it raises :func:`failure_error`. Waits use ``ray.wait`` against one
deadline, so a dead or hung rank ends the load promptly; they go through
:func:`rayload.cluster.wait`, which probes the head every second, so a lost cluster raises
:class:`~rayload.errors.ClusterLostError` within seconds instead of Ray's minute.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.exceptions import RayActorError, RayError

from rayload import cluster
from rayload.actors.hooks import TestHooks
from rayload.actors.messages import ActorInfo, LoadRequest, RankOutcome, RankSetup
from rayload.actors.peers import PEER_CONCURRENCY, PEER_GROUP, PING_CONCURRENCY, PING_GROUP
from rayload.actors.rank_actor import RankActor
from rayload.errors import (
    ClusterLostError,
    InputError,
    RankFailedError,
    RankTimeoutError,
    RayloadError,
)
from rayload.placement import RankPlacement
from rayload.tracing.clock import ClockSample, best_clock_offset

log = logging.getLogger(__name__)

_RemoteRankActor: Any = ray.remote(  # type: ignore[call-overload]
    concurrency_groups={PEER_GROUP: PEER_CONCURRENCY, PING_GROUP: PING_CONCURRENCY}
)(RankActor)

CLOCK_ROUNDS = 5
"""Clock-offset round trips per rank; the one with the smallest round trip is kept."""

_ACTOR_DIED_HEADLINE = "The actor died unexpectedly before finishing this task."

FailureKind = Literal["raised", "died", "timeout"]


@dataclass(frozen=True)
class RankFailure:
    """The first rank that failed, and how. ``input_error`` is set when the rank found the
    user's input wrong (re-raised as that :class:`InputError`, exit 2)."""

    rank: int
    node_id: str | None
    kind: FailureKind
    cause: str
    input_error: InputError | None = None


@dataclass(frozen=True)
class GroupLoad:
    """What :meth:`RankActorGroup.finish_load` got back: every rank that answered (loaded or
    failed), the first failure, and when the load was dispatched (driver clock)."""

    outcomes: Mapping[int, RankOutcome]
    failure: RankFailure | None
    dispatch_ns: int


@dataclass
class RankActorGroup:
    """The rank actors of one load, one per bundle of ``placement``.

    ``hooks`` are TEST HOOKS handed to the actors (see :mod:`rayload.actors.hooks`).
    """

    placement: RankPlacement
    want_gpu: bool
    hooks: TestHooks = field(default_factory=TestHooks)
    actors: list[Any] = field(default_factory=list)
    infos: dict[int, ActorInfo] = field(default_factory=dict)
    spawn_start_ns: dict[int, int] = field(default_factory=dict)
    ready_ns: dict[int, int] = field(default_factory=dict)
    clock_offsets: dict[int, tuple[int, int]] = field(default_factory=dict)
    clock_samples: dict[int, list[ClockSample]] = field(default_factory=dict)
    placed_nodes: dict[int, str | None] = field(default_factory=dict)

    @property
    def tp_size(self) -> int:
        return self.placement.tp_size

    def node_id(self, rank: int) -> str | None:
        """The node rank ``rank`` runs on: what its actor said, else the node its bundle was
        placed on when the actors were spawned (a bundle whose node died is moved by Ray,
        so asking the group now could name the wrong node)."""
        if rank in self.infos:
            return self.infos[rank].node_id
        return self.placed_nodes.get(rank)

    def start(self) -> dict[Any, int]:
        """Start every rank's actor without waiting; the refs of their ``ready`` calls,
        for :meth:`wait_started` (several groups then start at once)."""
        self.placed_nodes = self.placement.node_ids()
        waiting: dict[Any, int] = {}
        for rank in range(self.tp_size):
            resources = self.placement.resources(rank, want_gpu=self.want_gpu)
            self.spawn_start_ns[rank] = time.time_ns()
            actor = _RemoteRankActor.options(
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                scheduling_strategy=self.placement.scheduling_strategy(rank),
                max_restarts=0,
                max_task_retries=0,
            ).remote(
                rank,
                clock_skew_ns=self.hooks.clock_skew_ns.get(rank, 0),
                fault=self.hooks.fault_for(rank),
                probe_overrides=self.hooks.probe_overrides.get(rank),
                peer_pause_s=self.hooks.peer_pause_s.get(rank, 0.0),
                peer_bucket_bytes=self.hooks.peer_bucket_bytes,
                peer_link_mbps=self.hooks.peer_link_mbps,
                prefault=self.hooks.prefault,
                peer_stall_s=self.hooks.peer_stall_s,
                peer_pack=self.hooks.peer_pack,
            )
            self.actors.append(actor)
            waiting[actor.ready.remote()] = rank
        return waiting

    def wait_started(self, waiting: dict[Any, int], *, deadline: float) -> RankFailure | None:
        """Wait until every actor :meth:`start` started is ready (or one fails, or
        ``deadline``, a ``time.monotonic()`` value, passes)."""

        def on_ready(rank: int, info: ActorInfo) -> None:
            self.infos[rank] = info
            self.ready_ns[rank] = time.time_ns()

        return self._gather(waiting, deadline, "start", on_ready)

    def measure_clocks(self, *, deadline: float, rounds: int = CLOCK_ROUNDS) -> RankFailure | None:
        """Measure every rank's clock offset: ``rounds`` parallel round trips per rank (a
        rank's receive time is taken as soon as its answer is ready)."""
        samples: dict[int, list[ClockSample]] = {rank: [] for rank in range(self.tp_size)}
        self.clock_samples = samples
        for _ in range(rounds):
            t_send = time.time_ns()
            waiting = {actor.clock.remote(): rank for rank, actor in enumerate(self.actors)}

            def on_answer(rank: int, t_remote: int, t_send: int = t_send) -> None:
                samples[rank].append((t_send, t_remote, time.time_ns()))

            failure = self._gather(waiting, deadline, "answer a clock probe", on_answer)
            if failure is not None:
                return failure
        self.clock_offsets = {rank: best_clock_offset(s) for rank, s in samples.items()}
        return None

    def setup(
        self, device: str, *, deadline: float
    ) -> tuple[dict[int, RankSetup], RankFailure | None]:
        """Ask every rank for its resolved device (and rank 0 for a rendezvous address),
        in parallel: what a process group needs before the load."""
        setups: dict[int, RankSetup] = {}
        waiting = {actor.setup.remote(device): rank for rank, actor in enumerate(self.actors)}

        def on_setup(rank: int, setup: RankSetup) -> RankFailure | None:
            if setup.error is not None:
                return RankFailure(
                    rank=rank,
                    node_id=self.node_id(rank),
                    kind="raised",
                    cause=setup.error.describe(),
                    input_error=setup.error.input_error,
                )
            setups[rank] = setup
            return None

        failure = self._gather(waiting, deadline, "resolve its device", on_setup)
        return setups, failure

    def spawn_interval(self, rank: int) -> tuple[int, int]:
        """``(start_ns, end_ns)`` of rank ``rank``'s spawn on the driver's clock: from the
        driver's spawn call to the end of the actor's ``__init__`` (clock-corrected, kept
        within the time the driver saw it ready)."""
        start = self.spawn_start_ns[rank]
        received = self.ready_ns[rank]
        offset = self.clock_offsets.get(rank, (0, 0))[0]
        end = self.infos[rank].init_end_ns - offset
        return start, min(max(end, start), received)

    def start_load(self, request: LoadRequest) -> tuple[dict[Any, int], int]:
        """Dispatch every rank's load without waiting (several groups then load at once):
        the refs to wait for and when they were dispatched, for :meth:`finish_load`."""
        dispatch_ns = time.time_ns()
        return {
            actor.load.remote(request): rank for rank, actor in enumerate(self.actors)
        }, dispatch_ns

    def finish_load(
        self,
        started: tuple[dict[Any, int], int],
        *,
        deadline: float,
        on_rank_done: Callable[[RankOutcome], None] | None = None,
    ) -> GroupLoad:
        """Wait for the loads :meth:`start_load` dispatched; stop at the first failure or
        at ``deadline``."""
        waiting, dispatch_ns = started
        outcomes: dict[int, RankOutcome] = {}

        def on_outcome(rank: int, outcome: RankOutcome) -> RankFailure | None:
            outcomes[rank] = outcome
            if outcome.error is not None:
                return _raised(outcome)
            if on_rank_done is not None:
                on_rank_done(outcome)
            return None

        failure = self._gather(waiting, deadline, "load", on_outcome)
        return GroupLoad(
            outcomes=outcomes,
            failure=failure,
            dispatch_ns=dispatch_ns,
        )

    def reload(self, request: LoadRequest, *, deadline: float) -> GroupLoad:
        """Reload every rank in parallel into its resident tensors (``RankActor.reload``).
        Unlike :meth:`finish_load`, a rank that fails does not end the wait: every rank's outcome
        is collected (until ``deadline``), so each says what it overwrote; ``failure`` is
        the first failed rank by rank order."""
        dispatch_ns = time.time_ns()
        waiting = {actor.reload.remote(request): rank for rank, actor in enumerate(self.actors)}
        outcomes: dict[int, RankOutcome] = {}

        def on_outcome(rank: int, outcome: RankOutcome) -> None:
            outcomes[rank] = outcome

        failure = self._gather(waiting, deadline, "reload", on_outcome)
        failed = [o for _, o in sorted(outcomes.items()) if o.error is not None]
        if failure is None and failed:
            failure = _raised(failed[0])
        return GroupLoad(outcomes=outcomes, failure=failure, dispatch_ns=dispatch_ns)

    def shutdown(self, *, timeout_s: float) -> None:
        """Ask every rank to leave its process group (each waits at most ``timeout_s``);
        best effort, before :meth:`kill` (a rank that is gone or slow is killed anyway)."""
        refs = [actor.shutdown.remote(timeout_s) for actor in self.actors]
        if not refs:
            return
        if cluster.head_lost():
            return
        try:
            ready, late = cluster.wait(
                refs, num_returns=len(refs), timeout=timeout_s + 1.0, phase="stopping the ranks"
            )
        except ClusterLostError as exc:
            log.warning("%s", exc)
            return
        for ref in ready:
            try:
                ray.get(ref)
            except RayError as exc:
                log.warning("a rank failed to leave its process group: %s", _first_line(str(exc)))
        if late:
            log.warning("%d rank(s) did not leave their process group in time", len(late))

    def kill(self) -> None:
        """Stop every rank actor (their tensors go with them). Idempotent."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    def _gather(
        self,
        waiting: dict[Any, int],
        deadline: float,
        what: str,
        on_result: Callable[[int, Any], RankFailure | None],
    ) -> RankFailure | None:
        """Collect results as they come; the first failure or the deadline ends the wait."""
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                rank = min(waiting.values())
                late = sorted(waiting.values())
                return RankFailure(
                    rank=rank,
                    node_id=self.node_id(rank),
                    kind="timeout",
                    cause=f"did not {what} in time (ranks still running: {late})",
                )
            phase = f"waiting for the ranks to {what}"
            ready, _ = cluster.wait(list(waiting), timeout=remaining, phase=phase)
            if not ready:
                continue
            rank = waiting.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except RayActorError as exc:
                # Losing the head takes its node's actors with it: say so, not "actor died".
                cluster.check_head(phase)
                return RankFailure(rank, self.node_id(rank), "died", describe_actor_error(exc))
            except RayError as exc:
                return RankFailure(rank, self.node_id(rank), "raised", _first_line(str(exc)))
            failure = on_result(rank, result)
            if failure is not None:
                return failure
        return None


def _raised(outcome: RankOutcome) -> RankFailure:
    """The failure of a rank whose load (or reload) raised."""
    assert outcome.error is not None
    return RankFailure(
        rank=outcome.rank,
        node_id=outcome.node_id,
        kind="raised",
        cause=outcome.error.describe(),
        input_error=outcome.error.input_error,
    )


def describe_actor_error(exc: RayActorError) -> str:
    """One line saying why an actor is gone, from Ray's multi-line message."""
    text = str(exc)
    if getattr(exc, "actor_init_failed", False):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return f"actor __init__ raised {lines[-1] if lines else 'an error'}"
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.startswith("\t") and line != _ACTOR_DIED_HEADLINE
    ]
    detail = " ".join(lines) or "unknown cause"
    detail = detail.split(" Some common causes")[0]
    return f"actor died: {detail}"


def failure_error(failure: RankFailure, *, timeout_s: float) -> RayloadError:
    """The exception a failed load raises: the rank's own :class:`InputError` (prefixed
    with rank and node), :class:`RankTimeoutError`, or :class:`RankFailedError`."""
    where = f"rank {failure.rank} on node {failure.node_id or 'unknown'}"
    if failure.input_error is not None:
        error = copy.copy(failure.input_error)
        error.args = (f"{where}: {failure.input_error}",)
        error.rank, error.node_id = failure.rank, failure.node_id
        return error
    if failure.kind == "timeout":
        return RankTimeoutError(
            f"{where} {failure.cause}: the load timed out after {timeout_s:g} s; raise the "
            "timeout or look at that rank's node (storage, memory)",
            rank=failure.rank,
            node_id=failure.node_id,
            timeout_s=timeout_s,
        )
    return RankFailedError(
        f"{where} failed: {failure.cause}",
        rank=failure.rank,
        node_id=failure.node_id,
        cause=failure.cause,
    )


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)
