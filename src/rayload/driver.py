"""The driver's steps of a load that :func:`rayload.load` and :class:`rayload.LoadResult`
share: check the arguments, connect to Ray, place the ranks, write the trace, release
everything. Each is one function so a load and a reload do a step the same way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rayload import cluster
from rayload.actors.launch import reload_ranks
from rayload.actors.messages import LoadRequest
from rayload.actors.rank_group import RankActorGroup
from rayload.errors import CheckpointError, ConfigError
from rayload.loading.checkpoint import Checkpoint, open_checkpoint
from rayload.loading.plan import ShardPlan, plan_shards, same_plan_problem
from rayload.loading.report import RankReport
from rayload.loading.storage import is_remote
from rayload.placement import RankPlacement, create_placement_group
from rayload.placement.placement_group import current_placement
from rayload.progress import LoadProgress, ProgressCallback
from rayload.tracing import StartupTrace, export_otlp, prepare_trace_dir, schema, write_trace_files

OTLP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class TraceOutputs:
    """Where a finished trace goes; used on success and on failure alike."""

    trace_dir: str | os.PathLike[str] | None
    otlp_endpoint: str | None

    def prepare(self) -> None:
        """Fail before the load, not after it, when the trace directory is unwritable."""
        if self.trace_dir is not None:
            prepare_trace_dir(os.fspath(self.trace_dir))

    def reload_outputs(self, n: int) -> TraceOutputs:
        """Where the ``n``-th reload's trace goes: ``<trace_dir>/reload-<n>``, same OTLP."""
        trace_dir = None if self.trace_dir is None else os.path.join(self.trace_dir, f"reload-{n}")
        return TraceOutputs(trace_dir, self.otlp_endpoint)

    def write(self, spans: Sequence[Any]) -> dict[str, str]:
        """Write the trace files (format -> path) and export over OTLP to the endpoint or
        the ``OTEL_EXPORTER_OTLP_*`` variables; an export failure is only logged."""
        files: dict[str, str] = {}
        if self.trace_dir is not None:
            written = write_trace_files(spans, os.fspath(self.trace_dir))
            files = {fmt: str(path) for fmt, path in written.items()}
        export_otlp(spans, self.otlp_endpoint, timeout_s=OTLP_TIMEOUT_S)
        return files


def validate(path: str | os.PathLike[str]) -> str:
    """The checkpoint path made absolute (actors may run with another working directory);
    :class:`CheckpointError` when nothing is there. (Every other option is checked by
    :class:`~rayload.config.LoadConfig`.)"""
    if is_remote(os.fspath(path)):
        return os.fspath(path).rstrip("/")  # its listing names what is missing
    source = os.path.abspath(os.fspath(path))
    if not os.path.exists(source):
        raise CheckpointError(
            f"{source}: no such checkpoint (expected a directory with model.safetensors, an "
            "index or a rayload manifest, or a .safetensors file)",
            file=source,
        )
    return source


def ship_checkpoint(checkpoint: Checkpoint) -> Any:
    """What the ranks get of the driver's opened ``checkpoint`` (the load request's
    ``checkpoint``): for object storage an ObjectRef, put once for every rank and replica
    (a checkpoint of 90k tensors pickles to ~13 MB in 0.4 s: once, not once per rank);
    None for files, whose headers each node reads from its own copy."""
    return ray.put(checkpoint) if checkpoint.versions else None


def check_same_plan(loaded: ShardPlan, source: str, request: LoadRequest) -> Checkpoint:
    """The checkpoint at ``source``, opened (its headers: no tensor data read); raises
    :class:`CheckpointError` naming the first tensor it plans differently from the loaded
    plan."""
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
    return checkpoint


def place(
    trace: StartupTrace,
    tp_size: int,
    device: str,
    strategy: str,
    deadline: float,
    *,
    reuse: bool = True,
) -> tuple[RankPlacement, float]:
    """Reuse the caller's placement group (``reuse``: inside a Serve replica) or create
    one; record ``rayload.placement``."""
    start = time.time_ns()
    attributes: dict[str, Any] = {"tp_size": tp_size, "placement.strategy": strategy}
    try:
        placement = current_placement(tp_size, need_gpus=device == "cuda") if reuse else None
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


def release(
    groups: Sequence[RankActorGroup], placements: Sequence[RankPlacement], started_ray: bool
) -> None:
    """Stop the actors, remove the placement groups rayload created, and shut Ray down
    when the load started it."""
    for group in groups:
        group.kill()
    if cluster.head_lost():
        # The GCS is gone and took the groups with it; a GCS call now would hang for a
        # minute. ray.shutdown() (~15 s after a lost head) is left to the caller.
        return
    for placement in placements:
        placement.remove()
    if started_ray and ray.is_initialized():
        ray.shutdown()


def reload_replicas(
    trace: StartupTrace,
    groups: Sequence[RankActorGroup],
    requests: Sequence[LoadRequest],
    *,
    deadline: float,
    timeout: float,
) -> list[RankReport]:
    """Reload every replica's ranks in turn (see :func:`~rayload.actors.launch.reload_ranks`)."""
    reports: list[RankReport] = []
    for group, request in zip(groups, requests, strict=True):
        reports.extend(reload_ranks(trace, group, request, deadline=deadline, timeout=timeout))
    return reports


def notify(progress: ProgressCallback | None, event: LoadProgress) -> None:
    if progress is not None:
        progress(event)
