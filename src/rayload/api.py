"""The public entry point: :func:`load` a checkpoint onto Ray, one actor per TP rank, and get
a :class:`LoadResult` holding the resident weights, the per-rank reports, the startup
metrics and the trace id.

One load, in order (each step a span of the startup trace)::

    validate input (driver)  ->  placement group  ->  spawn rank actors (parallel)
      ->  clock offsets  ->  [ranks' devices + rank 0's address, for a process group]
      ->  load every rank (parallel, one deadline): join the process group, read the
          shards, build and fill the model= module  ->  trace + metrics

After the load, ``LoadResult.apply`` runs engine code on every rank; the engine phases it
records (``state.phase(name)``) join the same trace, and ``LoadResult.write_trace`` writes
it again with them.

Bad input fails in the driver before any actor starts (:class:`InputError`). A rank that
raises, dies or hangs ends the load with :class:`RankFailedError` /
:class:`RankTimeoutError`; the other ranks are stopped, the placement group removed, and
the trace is still written with the failing rank marked ERROR.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import ray

from rayload import cluster
from rayload.actors.hooks import hooks_from_env
from rayload.actors.launch import (
    load_ranks,
    plan_process_group,
    reload_ranks,
    spawn_ranks,
    spawn_seconds,
)
from rayload.actors.messages import Applied, LoadRequest, RankState
from rayload.actors.process_group import check_process_group
from rayload.actors.rank_group import RankActorGroup
from rayload.errors import CheckpointError, ConfigError, RankFailedError
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.methods import LoadMethod
from rayload.loading.model import ModelContext, ModelFactory
from rayload.loading.plan import ShardPlan, plan_shards
from rayload.loading.rank import same_plan_problem
from rayload.loading.report import RankReport, mixed_method_warnings
from rayload.loading.rules import resolve_rules
from rayload.options import (
    check_device,
    check_model_role,
    check_strategy,
    check_tp_size,
    parse_method,
)
from rayload.placement import RankPlacement, create_placement_group
from rayload.placement.placement_group import current_placement
from rayload.progress import LoadProgress, ProgressCallback
from rayload.tracing import (
    StartupTrace,
    export_otlp,
    prepare_trace_dir,
    publish_ray_metrics,
    schema,
    startup_metrics,
    write_trace_files,
)

log = logging.getLogger(__name__)


OTLP_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 5.0
"""How long ``close()`` lets each rank destroy its process group before killing it."""


@dataclass(eq=False)
class LoadResult:
    """The weights of every rank, resident in their actors, and what the load cost.

    A context manager: leaving it (or :meth:`close`) destroys the ranks' process group,
    stops the actors, removes the placement group rayload created, and shuts Ray down if
    :func:`load` started it. ``placement`` says where the ranks run (group, bundles,
    strategy, node per rank); ``warnings`` lists what the ranks disagreed on (methods,
    devices, fallbacks). ``trace`` is the load's :class:`~rayload.tracing.StartupTrace`,
    to which :meth:`apply` adds the engine phases; :meth:`write_trace` writes it again.
    ``process_group`` is the backend the ranks' ``torch.distributed`` group uses (None
    when the load made none).
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
    _group: RankActorGroup | None = field(default=None, repr=False)
    _started_ray: bool = field(default=False, repr=False)
    _outputs: _TraceOutputs | None = field(default=None, repr=False)
    _request: LoadRequest | None = field(default=None, repr=False)
    _reloads: int = field(default=0, repr=False)

    @property
    def tp_size(self) -> int:
        return self.plan.tp_size

    def shard(self, rank: int, name: str) -> Any:
        """A CPU copy of rank ``rank``'s tensor ``name`` (KeyError if the rank has none)."""
        self._check_open()
        if not 0 <= rank < len(self.actors):
            raise IndexError(f"rank {rank} out of range for tp_size {len(self.actors)}")
        return self._call(rank, self.actors[rank].shard.remote(name))

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(state, *args, **kwargs)`` on every rank, in parallel, where ``state`` is
        that rank's :class:`~rayload.actors.messages.RankState` (its resident tensors, the
        ``model=`` module, the process group, rank, device); return the results in rank
        order. This is how an engine builds on the loaded weights without moving them.

        ``with state.phase("warmup"):`` inside ``fn`` records ``engine.warmup`` for that
        rank; the phases come back with the results and join :attr:`trace` (clock-corrected
        like the load's rank spans). :meth:`write_trace` writes them out. When ``fn``
        raises on some ranks, the first rank's error is raised once every rank answered.
        """
        self._check_open()
        refs = [actor.apply_traced.remote(fn, *args, **kwargs) for actor in self.actors]
        results = []
        error: Exception | None = None
        for rank, ref in enumerate(refs):
            try:
                applied: Applied = self._call(rank, ref)
            except Exception as exc:  # raised below, once every rank's phases are merged
                error = error or exc
                continue
            self._add_engine_spans(rank, applied.spans)
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
        ``rank.to_device``: ``rayload.copied_into_resident``).

        The reload is its own trace (root ``rayload.reload``), written to
        ``<trace_dir>/reload-<n>/`` of the load's ``trace_dir`` and exported over OTLP like
        the load's. Returns a :class:`ReloadResult`; :attr:`ranks` becomes its reports,
        :attr:`startup_metrics` stays the load's. A rank that fails raises its error (as
        for :func:`load`) and the actors stay up: a rank that failed before writing keeps
        its old weights; the message and ``error.overwritten`` (rank -> tensor names) say
        exactly which tensors had begun to be overwritten.
        """
        self._check_open()
        assert self._group is not None
        if self._request is None or self._outputs is None:
            raise RuntimeError("this LoadResult was not made by rayload.load: nothing to reload")
        start_ns = time.time_ns()
        loaded = self._request
        requested = loaded.method if method is None else method
        source = _validate(
            loaded.path if path is None else path,
            self.tp_size,
            requested,
            loaded.device,
            self.placement.strategy,
            timeout,
            loaded.model_role,
        )
        deadline = time.monotonic() + timeout
        _check_same_plan(self.plan, source, loaded)
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
        request = replace(
            loaded,
            path=source,
            method=str(LoadMethod(requested)),
            traceparent=trace.traceparent(),
        )
        try:
            ranks = reload_ranks(trace, self._group, request, deadline=deadline, timeout=timeout)
        except BaseException as exc:
            outputs.write(trace.finish(error=str(exc) or type(exc).__name__))
            raise
        warnings = mixed_method_warnings(ranks)
        metrics = startup_metrics(
            ranks,
            placement_seconds=0.0,
            actor_startup_seconds={},
            model_role=loaded.model_role,
        )
        files = outputs.write(trace.finish())
        self.ranks = ranks
        self._request = replace(loaded, path=source)
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
        if self._group is not None:
            refs = [actor.engine_spans.remote() for actor in self.actors]
            for rank, ref in enumerate(refs):
                self._add_engine_spans(rank, self._call(rank, ref))
        outputs = self._outputs
        if trace_dir is not None:
            outputs = _TraceOutputs(trace_dir, outputs.otlp_endpoint)
            outputs.prepare()
        files = outputs.write(self.trace.spans())
        if trace_dir is None:
            self.trace_files = files
        return files

    def close(self) -> None:
        """Destroy the ranks' process group (best effort, a few seconds at most), stop the
        actors and release the placement group (and Ray, if load started it). Idempotent."""
        if self._group is not None and self.process_group is not None:
            self._group.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S)
        _release(self._group, self.placement, self._started_ray)
        self._group, self._started_ray = None, False
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
        if self._group is None:
            raise RuntimeError(
                f"load {self.trace_id} is closed: its rank actors and weights are gone"
            )

    def _add_engine_spans(self, rank: int, payload: bytes | None) -> None:
        if payload is None or self.trace is None or self._group is None:
            return
        self.trace.add_engine(payload, *self._group.clock_offsets.get(rank, (0, None)))

    def _call(self, rank: int, ref: ray.ObjectRef) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            node = self.ranks[rank].node_id
            raise RankFailedError(
                f"rank {rank} on node {node} is gone: {exc.__class__.__name__}; its weights "
                "are lost, load again",
                rank=rank,
                node_id=node,
                cause=str(exc).splitlines()[0],
            ) from exc


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

    Raises :class:`~rayload.errors.InputError` (bad input, before any actor starts),
    :class:`~rayload.errors.RankFailedError` or :class:`~rayload.errors.RankTimeoutError`.
    """
    start_ns = time.time_ns()
    source = _validate(path, tp_size, method, device, placement_strategy, timeout, model_role)
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
    outputs = _TraceOutputs(trace_dir, otlp_endpoint)
    outputs.prepare()
    hooks = hooks_from_env()
    deadline = time.monotonic() + timeout
    prepared_ns = time.time_ns()
    started_ray = _connect(address, deadline)
    connected_ns = time.time_ns()
    # The root span starts where the load started, so driver-side config parsing and Ray
    # start-up are inside the trace's total, as their own spans.
    trace = StartupTrace(tp_size=tp_size, model_role=model_role, start_ns=start_ns)
    trace.add_span(schema.PREPARE_SPAN, start_ns, prepared_ns, {"tp_size": tp_size})
    trace.add_span(schema.CONNECT_SPAN, prepared_ns, connected_ns, {"ray.started": started_ray})
    placement: RankPlacement | None = None
    group: RankActorGroup | None = None
    # Backstop for Ray calls that block while the head is gone (see rayload.cluster).
    watch = cluster.HeadWatch(lambda error: outputs.write(trace.finish(error=str(error))))
    watch.start()
    try:
        watch.phase = "creating the placement group"
        placement, placement_seconds = _place(trace, tp_size, device, placement_strategy, deadline)
        _notify(progress, LoadProgress("placed", tp_size))
        group = RankActorGroup(placement, want_gpu=device != "cpu", hooks=hooks)
        watch.phase = "starting the ranks"
        spawn_ranks(trace, group, deadline=deadline, timeout=timeout)
        _notify(progress, LoadProgress("spawned", tp_size))
        group_spec = plan_process_group(
            trace, group, process_group, device, deadline=deadline, timeout=timeout
        )
        request = LoadRequest(
            path=source,
            tp_size=tp_size,
            method=str(LoadMethod(method)),
            device=device,
            traceparent=trace.traceparent(),
            strict=strict,
            rules=rules,
            model_role=model_role,
            process_group=group_spec,
            model=model,
            model_config=dict(checkpoint.config or {}) if model is not None else None,
            expert_parallel=expert_parallel,
        )
        watch.phase = "loading the ranks"
        ranks = load_ranks(
            trace, group, request, deadline=deadline, timeout=timeout, progress=progress
        )
        warnings = mixed_method_warnings(ranks)
        for warning in warnings:
            log.warning("%s", warning)
        metrics = startup_metrics(
            ranks,
            placement_seconds=placement_seconds,
            actor_startup_seconds=spawn_seconds(group),
            model_role=model_role,
        )
        watch.phase = "finishing the load"
        publish_ray_metrics(metrics)
        files = outputs.write(trace.finish())
        watch.stop()
    except BaseException as exc:
        watched_to_the_end = watch.stop()
        _release(group, placement, started_ray)
        if watched_to_the_end:  # else the watch already wrote the failed trace
            outputs.write(trace.finish(error=str(exc) or type(exc).__name__))
        raise
    return LoadResult(
        trace_id=trace.trace_id,
        plan=plan,
        ranks=ranks,
        startup_metrics=metrics,
        actors=list(group.actors),
        warnings=warnings,
        trace_files=files,
        placement=placement,
        trace=trace,
        process_group=None if group_spec is None else group_spec.backend,
        _group=group,
        _started_ray=started_ray,
        _outputs=outputs,
        _request=request,
    )


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


def _check_same_plan(loaded: ShardPlan, source: str, request: LoadRequest) -> None:
    """Raise :class:`CheckpointError` naming the first tensor the checkpoint at ``source``
    plans differently from the loaded plan (from its headers: no tensor data read)."""
    checkpoint = open_checkpoint(source)
    plan = plan_shards(
        checkpoint, loaded.tp_size, rules=request.rules, expert_parallel=request.expert_parallel
    )
    problem = same_plan_problem(loaded, plan)
    if problem is not None:
        tensor, message = problem
        raise CheckpointError(
            f"{source}: cannot reload into the loaded tensors: {message}; a reload needs the "
            "load's tensors, shapes and dtypes (load a different model with rayload.load)",
            file=source,
            tensor=tensor or None,
        )


@dataclass(frozen=True)
class _TraceOutputs:
    """Where a finished trace goes; used on success and on failure alike."""

    trace_dir: str | os.PathLike[str] | None
    otlp_endpoint: str | None

    def prepare(self) -> None:
        """Fail before the load, not after it, when the trace directory is unwritable."""
        if self.trace_dir is not None:
            prepare_trace_dir(os.fspath(self.trace_dir))

    def reload_outputs(self, n: int) -> _TraceOutputs:
        """Where the ``n``-th reload's trace goes: ``<trace_dir>/reload-<n>``, same OTLP."""
        trace_dir = None if self.trace_dir is None else os.path.join(self.trace_dir, f"reload-{n}")
        return _TraceOutputs(trace_dir, self.otlp_endpoint)

    def write(self, spans: Sequence[Any]) -> dict[str, str]:
        """Write the trace files (format -> path) and export over OTLP to the endpoint or
        the ``OTEL_EXPORTER_OTLP_*`` variables; an export failure is only logged."""
        files: dict[str, str] = {}
        if self.trace_dir is not None:
            written = write_trace_files(spans, os.fspath(self.trace_dir))
            files = {fmt: str(path) for fmt, path in written.items()}
        export_otlp(spans, self.otlp_endpoint, timeout_s=OTLP_TIMEOUT_S)
        return files


def _validate(
    path: str | os.PathLike[str],
    tp_size: int,
    method: str | LoadMethod,
    device: str,
    strategy: str,
    timeout: float,
    model_role: str,
) -> str:
    """Check the arguments; return the checkpoint path made absolute (actors may run with
    another working directory)."""
    check_tp_size(tp_size)
    parse_method(method)
    check_device(device)
    check_strategy(strategy)
    if not timeout > 0:
        raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
    check_model_role(model_role)
    source = os.path.abspath(os.fspath(path))
    if not os.path.exists(source):
        raise CheckpointError(
            f"{source}: no such checkpoint (expected a directory with model.safetensors, an "
            "index or a rayload manifest, or a .safetensors file)",
            file=source,
        )
    return source


def _connect(address: str | None, deadline: float) -> bool:
    """Make sure this process is connected to Ray; True when this call ran ``ray.init``.

    ``address`` None follows Ray's own rules (``RAY_ADDRESS``, then the cluster ``ray start``
    recorded, else a new local Ray); ``"local"`` always starts a new one. An address that
    does not answer fails in seconds naming where it came from (:mod:`rayload.cluster`).
    Ray's console noise stays off the driver (``log_to_driver=False``): a rank's errors
    travel back in its outcome instead.
    """
    return cluster.connect(address, deadline=deadline)


def _place(
    trace: StartupTrace, tp_size: int, device: str, strategy: str, deadline: float
) -> tuple[RankPlacement, float]:
    """Reuse the caller's placement group or create one; record ``rayload.placement``."""
    start = time.time_ns()
    attributes: dict[str, Any] = {"tp_size": tp_size, "placement.strategy": strategy}
    try:
        placement = current_placement(tp_size, need_gpus=device == "cuda")
        if placement is None:
            cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
            if device == "cuda" and cluster_gpus < 1:
                raise ConfigError("device='cuda' but the Ray cluster has no GPUs; use --device cpu")
            placement = create_placement_group(
                tp_size,
                strategy=strategy,
                use_gpus=device == "cuda" or (device == "auto" and cluster_gpus >= 1),
                timeout_s=deadline - time.monotonic(),
            )
    except BaseException as exc:
        trace.add_span(schema.PLACEMENT_SPAN, start, time.time_ns(), attributes, str(exc))
        raise
    end = time.time_ns()
    attributes["placement.strategy"] = placement.strategy
    attributes["placement.reused"] = not placement.owned
    attributes["placement.rank_bundle"] = str(dict(placement.bundles[placement.bundle_of(0)]))
    trace.add_span(schema.PLACEMENT_SPAN, start, end, attributes)
    return placement, (end - start) / 1e9


def _release(
    group: RankActorGroup | None, placement: RankPlacement | None, started_ray: bool
) -> None:
    if group is not None:
        group.kill()
    if cluster.head_lost():
        # The GCS is gone and took the group with it; a GCS call now would hang for a
        # minute. ray.shutdown() (~15 s after a lost head) is left to the caller.
        return
    if placement is not None:
        placement.remove()
    if started_ray and ray.is_initialized():
        ray.shutdown()


def _notify(progress: ProgressCallback | None, event: LoadProgress) -> None:
    if progress is not None:
        progress(event)


__all__ = [
    "LoadProgress",
    "LoadResult",
    "ModelContext",
    "ProgressCallback",
    "RankState",
    "ReloadResult",
    "load",
]
