"""Does pre-importing torch and rayload in Ray's worker processes make the rank actors'
spawn faster? Measured side by side, as ratios, one fresh local Ray per trial.

A dropped experiment (the hook loses: docs/benchmarks.md, "pre-importing in Ray's worker
setup hook"), kept here to be rerun, outside the package:

    python benchmarks/preimport_hook.py '{"checkpoint": DIR, "tp_size": 4, "repeat": 3}'

runs ``repeat`` pairs of trials, alternating the order (plain, hook; hook, plain; ...),
each in its own interpreter that starts its own local Ray as rayload does
(``address="local"``, no dashboard) and then runs one ``rayload.load``:

* ``plain``: ``ray.init`` as rayload's :func:`rayload.cluster.connect` calls it;
* ``hook``: the same with ``runtime_env={"worker_process_setup_hook": _preimport}``:
  every worker of the job, including the idle workers Ray prestarts when the driver
  connects, imports torch and the rank actor's module when it starts, before any actor is
  given to it. (The runs in docs/benchmarks.md named the same function by its import path
  when it lived in the package; Ray pickles this one by value.)

Each trial reports ``ray.init``'s wall time, the load's wall time, their sum (what a user
waits for), the slowest rank's spawn and its parts, and how many ranks got a worker Ray
had started before their spawn. The ratios are hook / plain, per pair and as the median.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import time
from typing import Any

VARIANTS = ("plain", "hook")


def _preimport() -> None:
    """The ``worker_process_setup_hook`` of the ``hook`` trials: the rank actor's heavy
    imports (torch comes with it), done when a Ray worker starts rather than when the rank
    actor's module is first loaded."""
    import rayload.actors.rank_actor  # noqa: F401


def _trial(checkpoint: str, tp: int, variant: str) -> dict[str, Any]:
    """One trial in this (fresh) interpreter: start Ray, load once, shut Ray down."""
    import ray

    import rayload
    from rayload.benchmark.startfloor import spawn_parts
    from rayload.tracing import metrics, schema

    options: dict[str, Any] = {}
    if variant == "hook":
        options["runtime_env"] = {"worker_process_setup_hook": _preimport}
    start = time.perf_counter()
    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        **options,
    )
    init_s = time.perf_counter() - start
    try:
        start = time.perf_counter()
        result = rayload.load(checkpoint, tp_size=tp, method="scratch", device="cpu")
        load_s = time.perf_counter() - start
        spans = result.trace.spans() if result.trace else []
        prestarted = sum(
            1
            for s in spans
            if s.name == schema.SPAWN_WORKER_WAIT_SPAN
            and (s.attributes or {}).get("rayload.worker_started_before_spawn")
        )
        spawn = result.startup_metrics["aggregate"][metrics.ACTOR_STARTUP]["max"]
        parts = spawn_parts(spans)
        result.close()
    finally:
        ray.shutdown()
    return {
        "variant": variant,
        "init_s": init_s,
        "load_s": load_s,
        "init_and_load_s": init_s + load_s,
        "spawn_s": spawn,
        "imports_s": parts.get(schema.SPAWN_IMPORTS_SPAN, 0.0),
        "ranks_on_prestarted_workers": prestarted,
    }


_FIGURES = ("init_s", "load_s", "init_and_load_s", "spawn_s", "imports_s")


def measure_preimport(checkpoint: str, tp: int, *, repeat: int) -> dict[str, Any]:
    """``repeat`` pairs of trials (module docstring), each in a child interpreter."""
    trials = []
    for rep in range(repeat):
        for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            args = json.dumps({"trial": variant, "checkpoint": checkpoint, "tp_size": tp})
            done = subprocess.run(
                [sys.executable, __file__, args],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{variant} trial failed: {done.stderr.strip()[-2000:]}")
            trials.append(json.loads(done.stdout.strip().splitlines()[-1]))
    by = {v: [t for t in trials if t["variant"] == v] for v in VARIANTS}
    medians = {v: {k: statistics.median(t[k] for t in by[v]) for k in _FIGURES} for v in by}
    ratios = {
        k: [h[k] / p[k] for p, h in zip(by["plain"], by["hook"], strict=True) if p[k] > 0]
        for k in _FIGURES
    }
    return {
        "tp_size": tp,
        "repeat": repeat,
        "medians": medians,
        "ratio_hook_over_plain": {k: statistics.median(r) for k, r in ratios.items() if r},
        "ratios_per_pair": ratios,
        "trials": trials,
    }


if __name__ == "__main__":
    arguments = json.loads(sys.argv[1])
    if "trial" in arguments:
        found = _trial(arguments["checkpoint"], int(arguments["tp_size"]), arguments["trial"])
    else:
        found = measure_preimport(
            arguments["checkpoint"], int(arguments["tp_size"]), repeat=int(arguments["repeat"])
        )
    print(json.dumps(found))
