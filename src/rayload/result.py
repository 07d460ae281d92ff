"""What :func:`rayload.load` returns: :class:`LoadResult`, the weights of every rank resident
in their actors (one TP group per replica), with the per-rank reports, the start-up
metrics and the trace; and :class:`ReloadResult`, what :meth:`LoadResult.reload` did.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import ray

from rayload import cluster
from rayload.actors.messages import Applied, LoadRequest
from rayload.actors.peers import PeerRef
from rayload.actors.rank_group import RankActorGroup
from rayload.actors.sharing import RECEIVING_METHODS, PeerSharing, reload_sources
from rayload.config import LoadConfig
from rayload.driver import (
    TraceOutputs,
    check_same_plan,
    release,
    reload_replicas,
    ship_checkpoint,
    validate,
)
from rayload.errors import RankFailedError
from rayload.loading.identity import peer_key
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import ShardPlan
from rayload.loading.report import RankReport, mixed_method_warnings
from rayload.loading.storage import storage_deadline
from rayload.placement import RankPlacement
from rayload.tracing import StartupTrace, schema, startup_metrics

SHUTDOWN_TIMEOUT_S = 5.0
"""How long ``close()`` lets each rank destroy its process group before killing it."""


@dataclass(eq=False)
class LoadResult:
    """The weights of every rank, resident in their actors, and what the load cost.

    A context manager: leaving it (or :meth:`close`) destroys the ranks' process groups,
    stops the actors, removes the placement groups rayload created, takes the replicas out
    of the cluster's peer directory, and shuts Ray down if :func:`load` started it.

    With ``replicas=N`` there are N TP groups of ``tp_size`` ranks: ``actors`` and
    ``ranks`` list them replica by replica (replica ``i``'s rank ``r`` at
    ``i * tp_size + r``), :meth:`apply` runs on all of them (``state.replica`` tells them
    apart), :meth:`shard` takes ``replica=``. ``placement`` is replica 0's placement,
    ``placements`` every replica's; ``replica_ids`` their ids in the peer directory,
    ``peer_key`` the checkpoint identity and plan they are offered under.
    ``warnings`` lists what the ranks disagreed on (methods, devices, fallbacks) and peer
    directory trouble. ``trace`` is the load's :class:`~rayload.tracing.StartupTrace`, to
    which :meth:`apply` adds the engine phases; :meth:`write_trace` writes it again.
    ``process_group`` is the backend the ranks' ``torch.distributed`` group uses (one
    group per replica; None when the load made none). ``config`` is what the load was
    asked to do.
    """

    trace_id: str
    plan: ShardPlan
    ranks: list[RankReport]
    startup_metrics: dict[str, Any]
    actors: list[Any]
    placement: RankPlacement
    warnings: list[str] = field(default_factory=list)
    trace_files: dict[str, str] = field(default_factory=dict)
    trace: StartupTrace | None = field(default=None, repr=False)
    process_group: str | None = None
    placements: list[RankPlacement] = field(default_factory=list)
    replica_ids: list[str] = field(default_factory=list)
    peer_key: str = ""
    config: LoadConfig | None = None
    _groups: list[RankActorGroup] = field(default_factory=list, repr=False)
    _sharing: PeerSharing | None = field(default=None, repr=False)
    _started_ray: bool = field(default=False, repr=False)
    _outputs: TraceOutputs | None = field(default=None, repr=False)
    _requests: list[LoadRequest] = field(default_factory=list, repr=False)
    _reloads: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not self.placements:
            self.placements = [self.placement]

    @property
    def tp_size(self) -> int:
        return self.plan.tp_size

    @property
    def replicas(self) -> int:
        """How many TP groups (data-parallel copies) this load holds."""
        return max(len(self._groups), 1)

    def shard(self, rank: int, name: str, *, replica: int = 0) -> Any:
        """A CPU copy of tensor ``name`` of rank ``rank`` (of ``replica``); KeyError if the
        rank has none."""
        self._check_open()
        if not 0 <= rank < self.tp_size:
            raise IndexError(f"rank {rank} out of range for tp_size {self.tp_size}")
        if not 0 <= replica < self.replicas:
            raise IndexError(f"replica {replica} out of range for {self.replicas} replica(s)")
        index = replica * self.tp_size + rank
        return self._call(index, self.actors[index].shard.remote(name))

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(state, *args, **kwargs)`` on every rank (of every replica), in
        parallel, where ``state`` is that rank's :class:`~rayload.actors.messages.RankState`
        (its resident tensors, the ``model=`` module, the process group, rank, replica,
        device); return the results in the order of :attr:`actors`. This is how an engine
        builds on the loaded weights without moving them.

        ``with state.phase("warmup"):`` inside ``fn`` records ``engine.warmup`` for that
        rank; the phases come back with the results and join :attr:`trace` (clock-corrected
        like the load's rank spans). :meth:`write_trace` writes them out. When ``fn``
        raises on some ranks, the first rank's error is raised once every rank answered.
        """
        self._check_open()
        refs = [actor.apply_traced.remote(fn, *args, **kwargs) for actor in self.actors]
        results = []
        error: Exception | None = None
        for index, ref in enumerate(refs):
            try:
                applied: Applied = self._call(index, ref)
            except Exception as exc:  # raised below, once every rank's phases are merged
                error = error or exc
                continue
            self._add_engine_spans(index, applied.spans)
            results.append(applied.value)
        if error is not None:
            raise error
        return results

    def reload(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        method: str | LoadMethod | None = None,
        timeout: float = 600.0,
    ) -> ReloadResult:
        """Read the checkpoint at ``path`` (default: the one loaded, again) into the same
        actors' resident tensors, in place: no actor is started, no tensor allocated or
        replaced, so a ``model=`` module (whose parameters share the tensors' storage) has
        the new weights. ``method`` defaults to the load's.

        The checkpoint must have the load's plan: the same tensors on every rank, with the
        same shapes and dtypes. The driver checks that from the headers before any byte is
        written; otherwise a :class:`~rayload.errors.CheckpointError` names the first tensor
        that differs and nothing changes. ``scratch`` and ``converted`` read straight into
        the tensors; the other methods load fresh ones and copy them in (said on the rank's
        ``rank.to_device``: ``rayload.copied_into_resident``). The replicas reload one after
        the other, each not offered to other loads while it does: replica 0 from storage,
        the others (with ``auto`` or ``peer``) from replica 0 over the peer channel, so the
        cluster reads the new checkpoint once; a rank whose source fails reads storage (a
        reported fallback).

        The reload is its own trace (root ``rayload.reload``), written to
        ``<trace_dir>/reload-<n>/`` of the load's ``trace_dir`` and exported over OTLP like
        the load's. Returns a :class:`ReloadResult`; :attr:`ranks` becomes its reports,
        :attr:`startup_metrics` stays the load's. A rank that fails raises its error (as
        for :func:`load`) and the actors stay up: a rank that failed before writing keeps
        its old weights; the message and ``error.overwritten`` (rank -> tensor names) say
        exactly which tensors had begun to be overwritten.
        """
        self._check_open()
        if not self._requests or self._outputs is None or self.config is None:
            raise RuntimeError("this LoadResult was not made by rayload.load: nothing to reload")
        start_ns = time.time_ns()
        loaded = self._requests[0]
        changes = {"path": loaded.path if path is None else path, "timeout": timeout}
        config = self.config.replace(**changes, **({} if method is None else {"method": method}))
        requested = config.method
        source = validate(config.path)
        deadline = time.monotonic() + timeout
        with storage_deadline(timeout):
            checkpoint = check_same_plan(self.plan, source, loaded)
        trace = StartupTrace(
            tp_size=self.tp_size,
            model_role=loaded.model_role,
            start_ns=start_ns,
            root_name=schema.RELOAD_ROOT_SPAN,
        )
        trace.add_span(schema.PREPARE_SPAN, start_ns, time.time_ns(), {"path": source})
        self._reloads += 1
        outputs = self._outputs.reload_outputs(self._reloads)
        outputs.prepare()
        # Replica 0 reloads first, from storage; the others then receive from it.
        sources: tuple[PeerRef, ...] = ()
        if len(self._groups) > 1 and LoadMethod(requested) in RECEIVING_METHODS:
            first = self.ranks[: self.tp_size]
            sources = reload_sources(
                self.actors[: self.tp_size], [r.node_id for r in first], self.replica_ids[0]
            )
        shipped = ship_checkpoint(checkpoint)
        requests = [
            replace(
                request,
                path=source,
                method=str(LoadMethod(requested)),
                traceparent=trace.traceparent(),
                peers=sources if index else (),
                peer_wait_s=timeout,
                checkpoint=shipped,
            )
            for index, request in enumerate(self._requests)
        ]
        if self._sharing is not None:
            self._sharing.reloading(self.replica_ids)
        try:
            ranks = reload_replicas(
                trace, self._groups, requests, deadline=deadline, timeout=timeout
            )
        except BaseException as exc:
            outputs.write(trace.finish(error=str(exc) or type(exc).__name__))
            raise
        if self._sharing is not None and self._sharing.registered:  # else nobody to re-key
            self._sharing.loaded(self.replica_ids, key=peer_key(checkpoint, self.plan))
        warnings = mixed_method_warnings(ranks)
        metrics = startup_metrics(
            ranks,
            placement_seconds=0.0,
            actor_startup_seconds={},
            model_role=loaded.model_role,
        )
        files = outputs.write(trace.finish())
        self.ranks = ranks
        self._requests = [replace(r, path=source, checkpoint=shipped) for r in self._requests]
        return ReloadResult(
            trace_id=trace.trace_id,
            path=source,
            ranks=ranks,
            startup_metrics=metrics,
            warnings=warnings,
            trace_files=files,
            trace=trace,
        )

    def write_trace(self, trace_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
        """Write the trace again, now with the engine phases, to ``trace_dir`` (default: the
        load's ``trace_dir``) and export it over OTLP as the load did; returns the files
        (format -> path), also kept in :attr:`trace_files` when they replace the load's.

        Phases recorded by an ``apply`` that raised are fetched from the ranks first. The
        root span ``rayload.load`` keeps the load's end: engine phases are its children
        and may end after it; the startup metrics are the load's, unchanged.
        """
        if self.trace is None or self._outputs is None:
            raise RuntimeError("this LoadResult has no startup trace to write")
        if self._groups:
            refs = [actor.engine_spans.remote() for actor in self.actors]
            for index, ref in enumerate(refs):
                self._add_engine_spans(index, self._call(index, ref))
        outputs = self._outputs
        if trace_dir is not None:
            outputs = TraceOutputs(trace_dir, outputs.otlp_endpoint)
            outputs.prepare()
        files = outputs.write(self.trace.spans())
        if trace_dir is None:
            self.trace_files = files
        return files

    def close(self) -> None:
        """Take the replicas out of the peer directory, destroy the ranks' process groups
        (best effort, a few seconds at most), stop the actors and release the placement
        groups (and Ray, if load started it). Idempotent."""
        if self._sharing is not None and not cluster.head_lost():
            self._sharing.drop()
        if self.process_group is not None:
            for group in self._groups:
                group.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S)
        release(self._groups, self.placements, self._started_ray)
        self._groups, self._started_ray = [], False
        self.actors = []

    def __enter__(self) -> LoadResult:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if not self._groups:
            raise RuntimeError(
                f"load {self.trace_id} is closed: its rank actors and weights are gone"
            )

    def _where(self, index: int) -> tuple[RankActorGroup, int]:
        """The group and rank of ``actors[index]``."""
        return self._groups[index // self.tp_size], index % self.tp_size

    def _add_engine_spans(self, index: int, payload: bytes | None) -> None:
        if payload is None or self.trace is None or not self._groups:
            return
        group, rank = self._where(index)
        self.trace.add_engine(payload, *group.clock_offsets.get(rank, (0, None)))

    def _call(self, index: int, ref: ray.ObjectRef) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            rank = index % self.tp_size
            node = self.ranks[index].node_id if index < len(self.ranks) else None
            replica = "" if self.replicas == 1 else f"replica {index // self.tp_size} "
            raise RankFailedError(
                f"{replica}rank {rank} on node {node} is gone: {exc.__class__.__name__}; its "
                "weights are lost, load again",
                rank=rank,
                node_id=node,
                cause=str(exc).splitlines()[0],
            ) from exc


@dataclass(frozen=True)
class ReloadResult:
    """What :meth:`LoadResult.reload` did: its own trace, the ranks' reports and the
    metrics of the reload (keys as the load's; ``placement_seconds`` 0 and
    ``actor_startup_seconds`` null: no placement, no actor started)."""

    trace_id: str
    path: str
    ranks: list[RankReport]
    startup_metrics: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    trace_files: dict[str, str] = field(default_factory=dict)
    trace: StartupTrace | None = field(default=None, repr=False, compare=False)
