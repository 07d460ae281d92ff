"""The whole ``rayload.load`` wall time, split into Ray start, placement, actor start and
weight loading, and the cost of tracing.

It runs in a child interpreter (``python -m rayload.benchmark.startup``) so that Ray never
lives in the benchmark process: Ray start is timed from a cold ``ray.init``, then the
loads join that Ray. Runs with and without trace files alternate (off-on, on-off, ...) to
spread drift over both. Rank spans are recorded in both: rayload cannot switch span
recording off, so "tracing on" measures the trace files and their export path.

That difference is too noisy to judge a target of a few percent where actor start varies
far more from one load to the next (docs/benchmarks.md has the figures), so after every
load the tracing work itself is replayed on that load's real rank reports and timed step
by step
(:mod:`rayload.benchmark.tracecost`): ``tracing`` in the result holds its median
critical path and that as a percentage of each load's whole wall time and of its model
loading time. The page cache is warm for every load: the cold-cache read is what the
rank cases measure. Then, on the same Ray, :mod:`rayload.benchmark.startfloor` measures
the start-up floor of the machine beside rayload's spawn, and ``reload()`` beside fresh
loads (``start_up`` in the result).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from rayload.benchmark.startfloor import measure_floor
from rayload.benchmark.tracecost import cost_fractions, tracing_cost
from rayload.errors import LoadFailedError
from rayload.tracing import metrics

PARTS = (
    metrics.PLACEMENT,
    metrics.ACTOR_STARTUP,
    metrics.PREPARATION,
    metrics.POPULATION,
    metrics.TOTAL,
)


def measure_startup(
    checkpoint: str,
    tp_size: int,
    *,
    repeat: int,
    method: str = "scratch",
    device: str = "cpu",
    floor: bool = True,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Run the measurement in a child interpreter and return its JSON result. ``floor``:
    then, on the same Ray, the start-up floor and reload against fresh loads
    (:mod:`rayload.benchmark.startfloor`), under ``"start_up"``."""
    args = json.dumps(
        {
            "checkpoint": checkpoint,
            "tp_size": tp_size,
            "repeat": repeat,
            "method": method,
            "device": device,
            "floor": floor,
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "rayload.benchmark.startup", args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise LoadFailedError(f"rayload.load benchmark failed (exit {done.returncode}): {tail}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _one_load(checkpoint: str, tp: int, method: str, device: str, trace: bool) -> dict[str, Any]:
    import rayload

    with tempfile.TemporaryDirectory(prefix="rayload-bench-trace-") as tmp:
        start = time.perf_counter()
        result = rayload.load(
            checkpoint,
            tp_size=tp,
            method=method,
            device=device,
            trace_dir=tmp if trace else None,
        )
        loaded = time.perf_counter() - start
        aggregate = result.startup_metrics["aggregate"]
        reports = list(result.ranks)
        result.close()
    run: dict[str, Any] = {"trace_files": trace, "wall_s": loaded}
    run.update({k: aggregate[k]["max"] for k in PARTS})
    run["other_s"] = loaded - sum(
        run[k] for k in (metrics.PLACEMENT, metrics.ACTOR_STARTUP, metrics.TOTAL)
    )
    run["tracing"] = tracing_cost(reports)
    run["tracing"].update(cost_fractions(run["tracing"], run))
    return run


def _medians(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    keys = ("wall_s", *PARTS, "other_s")
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def _tracing_medians(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Median over every load (with and without trace files) of each tracing figure."""
    keys = runs[0]["tracing"].keys()
    return {k: statistics.median(r["tracing"][k] for r in runs) for k in keys}


def _main(args: dict[str, Any]) -> dict[str, Any]:
    import ray

    from rayload.benchmark import probes
    from rayload.loading.checkpoint import open_checkpoint

    tp, ckpt = int(args["tp_size"]), str(args["checkpoint"])
    probes.warm(open_checkpoint(ckpt).files)
    start = time.perf_counter()
    ray.init(
        address="local",  # its own Ray, even where another on this machine is recorded
        num_cpus=max(tp, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
    )
    ray_start = time.perf_counter() - start
    runs = []
    start_up = None
    try:
        for rep in range(int(args["repeat"])):
            for trace in (False, True) if rep % 2 == 0 else (True, False):
                runs.append(_one_load(ckpt, tp, args["method"], args["device"], trace))
        if args.get("floor", False):
            start_up = measure_floor(
                ckpt,
                tp,
                repeat=int(args["repeat"]),
                method=args["method"],
                device=args["device"],
                other_spawns=[r[metrics.ACTOR_STARTUP] for r in runs],
            )
    finally:
        ray.shutdown()
    off = _medians([r for r in runs if not r["trace_files"]])
    on = _medians([r for r in runs if r["trace_files"]])
    return {
        "tp_size": tp,
        "method": args["method"],
        "ray_start_s": ray_start,
        "without_trace_files": off,
        "with_trace_files": on,
        "trace_overhead_pct": 100 * (on["wall_s"] - off["wall_s"]) / off["wall_s"],
        "tracing": _tracing_medians(runs),
        "wall_s_spread_without": [
            min(r["wall_s"] for r in runs if not r["trace_files"]),
            max(r["wall_s"] for r in runs if not r["trace_files"]),
        ],
        "runs": runs,
        "start_up": start_up,
    }


if __name__ == "__main__":
    print(json.dumps(_main(json.loads(sys.argv[1]))))
