"""Start-up against the floor of this machine, and a reload against a fresh load.

Runs inside the child interpreter of :mod:`rayload.benchmark.startup`, on the Ray it
started (one ``ray.init`` for the whole measurement). Each repetition, in this order:

* ``bare_interpreters``: ``tp`` processes of ``python -c pass`` launched at once, timed
  from the first launch to the last one's first statement (each prints
  ``time.time_ns()``);
* ``bare_imports``: the same, each running ``import torch, rayload`` first;
* ``bare_actors``: ``tp`` Ray actors of a class whose ``__init__`` does nothing, with
  rayload's CPU request, created at once, timed until every one answered a method call
  (each also says whether torch was imported in it: it must not be);
* ``ray_floor``: ``tp`` Ray actors whose module imports torch and rayload and that do
  nothing else (:mod:`rayload.benchmark.floor_actor`), in a placement group made as
  rayload makes one, with the rank actors' resources and options, timed until each
  answered: what Ray itself must pay for these ranks;
* a fresh ``rayload.load`` (its ``actor_startup_seconds``, from the ``rayload.spawn``
  spans, and its ``weight_population_seconds``), then ``result.reload()`` of the same
  checkpoint, then ``close`` + a second fresh ``rayload.load`` timed as one wall time.

Two floors. ``ray_floor`` is the tight one, the target's: the same workers Ray starts for
rayload's ranks, the same imports, started the way Ray staggers them, and no rayload work.
``floor`` (``bare_actors + bare_imports - bare_interpreters``) is the earlier, loose one:
``tp`` interpreters importing torch at the same instant on fewer cores contend harder than
Ray's staggered workers, so it can lie above what a spawn costs (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rayload.tracing import metrics, schema

_IMPORTS = "import torch, rayload"
_STAMP = "import time; print(time.time_ns(), flush=True)"
SPAWN_PARTS = (
    schema.SPAWN_WORKER_WAIT_SPAN,
    schema.SPAWN_PROCESS_START_SPAN,
    schema.SPAWN_IMPORTS_SPAN,
    schema.SPAWN_ACTOR_INIT_SPAN,
)
"""The children of the slowest rank's ``rayload.spawn`` reported beside its length."""


def processes_at_once(n: int, code: str, *, timeout_s: float = 300.0) -> float:
    """Seconds from launching ``n`` interpreters running ``code`` at once until the last
    of them has run it (each prints its ``time.time_ns()`` when done)."""
    start = time.time_ns()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"{code}\n{_STAMP}"], stdout=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]
    done = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{code!r} failed in a fresh interpreter (exit {proc.returncode})")
        done.append(int(out.split()[-1]))
    return (max(done) - start) / 1e9


def bare_actors(n: int, *, num_cpus: float) -> tuple[float, bool]:
    """Seconds from creating ``n`` do-nothing actors at once until each answered, and
    whether any of them had torch imported (the class is pickled by value, so its worker
    imports nothing of rayload)."""
    import ray

    class Bare:
        def __init__(self) -> None:
            pass

        def ready(self) -> bool:
            return "torch" in sys.modules

    remote: Any = ray.remote(Bare)
    start = time.perf_counter()
    actors = [remote.options(num_cpus=num_cpus).remote() for _ in range(n)]
    torch_seen = ray.get([a.ready.remote() for a in actors])
    elapsed = time.perf_counter() - start
    for actor in actors:
        ray.kill(actor)
    return elapsed, any(torch_seen)


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
    from rayload.placement.bundles import DEFAULT_CPUS_PER_RANK

    run: dict[str, Any] = {
        "bare_interpreters_s": processes_at_once(tp, "pass"),
        "bare_imports_s": processes_at_once(tp, _IMPORTS),
    }
    run["bare_actors_s"], run["bare_actor_imported_torch"] = bare_actors(
        tp, num_cpus=DEFAULT_CPUS_PER_RANK
    )
    run["floor_s"] = run["bare_actors_s"] + run["bare_imports_s"] - run["bare_interpreters_s"]
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
    "bare_interpreters_s",
    "bare_imports_s",
    "bare_actors_s",
    "floor_s",
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
        "floor_range": [min(r["floor_s"] for r in runs), max(r["floor_s"] for r in runs)],
        "ray_floor_range": [
            min(r["ray_floor_s"] for r in runs),
            max(r["ray_floor_s"] for r in runs),
        ],
        "ray_floor_imported_torch": all(r["ray_floor_imported_torch"] for r in runs),
        "spawn_parts": _median_parts([r["spawn_parts"] for r in runs]),
        "bare_actor_imported_torch": any(r["bare_actor_imported_torch"] for r in runs),
        "runs": runs,
    }


def _median_parts(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    keys = [k for k in (schema.SPAWN_SPAN, *SPAWN_PARTS) if all(k in p for p in parts)]
    return {k: statistics.median(p[k] for p in parts) for k in keys} if parts else {}
