"""Start-up against Ray's floor for these ranks, and a reload against a fresh load.

Runs inside the child interpreter of :mod:`rayload.benchmark.startup`, on the Ray it
started (one ``ray.init`` for the whole measurement). Each repetition, in this order:

* ``ray_floor``: ``tp`` Ray actors whose module imports torch and rayload and that do
  nothing else (:mod:`rayload.benchmark.floor_actor`), in a placement group made as
  rayload makes one, with the rank actors' resources and options, timed until each
  answered: what Ray itself must pay for these ranks, started the way Ray staggers them;
* a fresh ``rayload.load`` (its ``actor_startup_seconds``, from the ``rayload.spawn``
  spans, and its ``weight_population_seconds``), then ``result.reload()`` of the same
  checkpoint, then ``close`` + a second fresh ``rayload.load`` timed as one wall time.

An earlier, loose floor (bare interpreters, bare imports and bare actors, each ``tp`` at
once) was measured here too and dropped once Ray's floor existed: ``tp`` interpreters
importing torch at the same instant contend harder than Ray's staggered workers, so it lay
above what a spawn costs (its figures stay in docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rayload.tracing import metrics, schema

SPAWN_PARTS = (
    schema.SPAWN_WORKER_WAIT_SPAN,
    schema.SPAWN_PROCESS_START_SPAN,
    schema.SPAWN_IMPORTS_SPAN,
    schema.SPAWN_ACTOR_INIT_SPAN,
)
"""The children of the slowest rank's ``rayload.spawn`` reported beside its length."""


def importing_actors(n: int) -> tuple[float, bool]:
    """Seconds from creating ``n`` actors of :class:`~rayload.benchmark.floor_actor.
    ImportingActor` at once, each in its bundle of a placement group made the way
    rayload makes one (same resources, strategy and actor options as its rank actors),
    until each answered: Ray's worker start plus the imports of torch and rayload, staggered
    as Ray staggers them, and nothing else. Also whether every one had torch imported."""
    import ray

    from rayload.benchmark.floor_actor import ImportingActor
    from rayload.placement.placement_group import create_placement_group

    placement = create_placement_group(n, use_gpus=False)
    remote: Any = ray.remote(ImportingActor)
    try:
        start = time.perf_counter()
        actors = []
        for rank in range(n):
            resources = placement.resources(rank, want_gpu=False)
            actors.append(
                remote.options(
                    num_cpus=resources.num_cpus,
                    num_gpus=resources.num_gpus,
                    scheduling_strategy=placement.scheduling_strategy(rank),
                    max_restarts=0,
                    max_task_retries=0,
                ).remote()
            )
        answers = ray.get([a.ready.remote() for a in actors])
        elapsed = time.perf_counter() - start
        for actor in actors:
            ray.kill(actor)
    finally:
        placement.remove()
    return elapsed, all(torch for _, torch, _ in answers)


def spawn_parts(spans: Sequence[Any]) -> dict[str, float]:
    """The slowest rank's ``rayload.spawn`` and its children, seconds (a part the spawn
    did not have, e.g. ``process_start`` of a pre-started worker, is 0)."""
    spawns = [s for s in spans if s.name == schema.SPAWN_SPAN]
    if not spawns:
        return {}
    slowest = max(spawns, key=lambda s: s.end_time - s.start_time)
    parts = {schema.SPAWN_SPAN: (slowest.end_time - slowest.start_time) / 1e9}
    parts.update(dict.fromkeys(SPAWN_PARTS, 0.0))
    children = [s for s in spans if s.parent is not None and s.name in parts]
    for s in children:
        if s.parent.span_id == slowest.context.span_id:
            parts[s.name] += (s.end_time - s.start_time) / 1e9
    return parts


def _load(checkpoint: str, tp: int, method: str, device: str) -> tuple[Any, float]:
    import rayload

    start = time.perf_counter()
    result = rayload.load(checkpoint, tp_size=tp, method=method, device=device)
    return result, time.perf_counter() - start


def _one_repetition(checkpoint: str, tp: int, method: str, device: str) -> dict[str, Any]:
    run: dict[str, Any] = {}
    run["ray_floor_s"], run["ray_floor_imported_torch"] = importing_actors(tp)
    result, run["fresh_wall_s"] = _load(checkpoint, tp, method, device)
    aggregate = result.startup_metrics["aggregate"]
    run["spawn_s"] = aggregate[metrics.ACTOR_STARTUP]["max"]
    run["fresh_population_s"] = aggregate[metrics.POPULATION]["max"]
    run["spawn_parts"] = spawn_parts(result.trace.spans() if result.trace else [])
    start = time.perf_counter()
    reloaded = result.reload()
    run["reload_wall_s"] = time.perf_counter() - start
    run["reload_population_s"] = reloaded.startup_metrics["aggregate"][metrics.POPULATION]["max"]
    start = time.perf_counter()
    result.close()
    again, _ = _load(checkpoint, tp, method, device)
    run["close_and_fresh_s"] = time.perf_counter() - start
    run["second_spawn_s"] = again.startup_metrics["aggregate"][metrics.ACTOR_STARTUP]["max"]
    again.close()
    return run


_MEDIANS = (
    "ray_floor_s",
    "fresh_wall_s",
    "spawn_s",
    "fresh_population_s",
    "reload_wall_s",
    "reload_population_s",
    "close_and_fresh_s",
)


def measure_floor(
    checkpoint: str,
    tp: int,
    *,
    repeat: int,
    method: str,
    device: str,
    other_spawns: Sequence[float] = (),
) -> dict[str, Any]:
    """``repeat`` repetitions (module docstring) on the connected Ray, with medians.

    ``rayload_spawn_s`` is the median slowest-rank spawn over every ``rayload.load`` of
    the measurement: the two of each repetition here and ``other_spawns`` (the loads
    :mod:`rayload.benchmark.startup` timed before, on the same Ray)."""
    runs = [_one_repetition(checkpoint, tp, method, device) for _ in range(repeat)]
    medians = {k: statistics.median(r[k] for r in runs) for k in _MEDIANS}
    spawns = [*other_spawns, *(s for r in runs for s in (r["spawn_s"], r["second_spawn_s"]))]
    return {
        "tp_size": tp,
        "method": method,
        "medians": medians,
        "rayload_spawn_s": statistics.median(spawns),
        "rayload_spawn_range": [min(spawns), max(spawns)],
        "rayload_spawns": len(spawns),
        "ray_floor_range": [
            min(r["ray_floor_s"] for r in runs),
            max(r["ray_floor_s"] for r in runs),
        ],
        "ray_floor_imported_torch": all(r["ray_floor_imported_torch"] for r in runs),
        "spawn_parts": _median_parts([r["spawn_parts"] for r in runs]),
        "runs": runs,
    }


def _median_parts(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    keys = [k for k in (schema.SPAWN_SPAN, *SPAWN_PARTS) if all(k in p for p in parts)]
    return {k: statistics.median(p[k] for p in parts) for k in keys} if parts else {}
