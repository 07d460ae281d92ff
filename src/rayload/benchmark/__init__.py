"""``rayload bench``: rayload's load methods side by side with the peers and the disk limit.

One process per TP rank, started together at a barrier, for each case; cold (evicted) and
warm page cache; medians of interleaved repetitions; bytes read and peak memory measured
inside each rank process. ``run_benchmark`` returns the result as a JSON-able dict and
``write_report`` writes it as JSON, markdown and a PNG chart. Linux only (``/proc``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayload.benchmark.runner import BenchConfig

__all__ = ["BenchConfig", "run_benchmark", "write_report"]


def run_benchmark(
    config: BenchConfig, *, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Prepare the checkpoint, run every case and return the result as plain JSON types."""
    from rayload.benchmark import runner, summary, targets, verify
    from rayload.benchmark.cases import CASES

    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = machine_info()
    prep = runner.prepare(config, progress)
    samples = runner.run_all(config, prep, progress)
    consistency: list[str] = []
    references: list[dict[str, Any]] = []
    if config.verify:
        layouts = dict.fromkeys(
            CASES[s.case].layout for s in samples if CASES[s.case].kind != "limit"
        )
        progress(f"reading the reference tensors of layout(s) {', '.join(layouts)} to verify")
        refs = verify.references(prep, layouts, config.tp_sizes)
        consistency = verify.consistency(samples, refs)
        references = verify.references_jsonable(refs)
    summaries = summary.summarize(samples, prep.checkpoint_bytes)
    tp = max(config.tp_sizes)
    amplification = None
    not_applicable = _not_applicable(config)
    for what, why in not_applicable.items():
        progress(f"{what}: {why}")
    if config.split_probe and "split probe" not in not_applicable:
        from rayload.benchmark.splits import split_amplification

        amplification = split_amplification(config, prep, tp, progress)
    load_breakdown = None
    if config.startup and "scratch" not in prep.skipped:
        from rayload.benchmark.startup import measure_startup

        progress(f"timing rayload.load (tp={tp}, scratch) with and without trace files")
        load_breakdown = measure_startup(
            prep.checkpoint, tp, repeat=config.repeat, device=config.device
        )
    items = targets.targets(
        summaries,
        tp=tp,
        load_breakdown=load_breakdown,
        amplification=amplification,
        layouts=prep.layouts,
    )
    result = {
        "schema": 1,
        "started": started,
        "config": config.to_dict(),
        "machine": machine,
        "loadavg_after": os.getloadavg(),
        "baseline_rss": baseline_rss(),
        "storage": {**_storage(prep.checkpoint), "not_applicable": not_applicable},
        "checkpoint": {
            "path": prep.checkpoint,
            "bytes": prep.checkpoint_bytes,
            "files": list(prep.files),
            "plan_rank_bytes": {str(k): list(v) for k, v in prep.plan_rank_bytes.items()},
            "converted": dict(prep.converted),
            "layouts": [dataclasses.asdict(p) for p in prep.layouts],
        },
        "skipped": dict(prep.skipped),
        "consistency": consistency,
        "references": references,
        "summary": summary.to_jsonable(summaries),
        "targets": summary.to_jsonable(items),
        "load_breakdown": load_breakdown,
        "amplification_by_kind": amplification,
        "samples": [s.to_dict() for s in samples],
    }
    return json.loads(json.dumps(result))  # plain JSON types: what write_report writes


def _storage(checkpoint: str) -> dict[str, Any]:
    """Where the checkpoint is: ``rayload.storage`` (``file`` | ``s3``) and, for object
    storage, the endpoint's host and the bucket (never a credential)."""
    from rayload.loading.storage import storage_for

    attributes = storage_for(checkpoint).attributes()
    kind = attributes.pop("rayload.storage")
    return {"kind": kind, **{k.removeprefix("rayload.storage."): v for k, v in attributes.items()}}


def _not_applicable(config: BenchConfig) -> dict[str, str]:
    """What of the benchmark does not apply to the configured checkpoint, and why."""
    if not config.remote:
        return {}
    return {
        "page cache": "the objects come from the server on every load, never from this "
        "machine's page cache: nothing evicted or warmed, one cache state (remote)",
        "split probe": "it writes one-layer subsets of the checkpoint to local disk, and "
        "nothing of an s3:// checkpoint is copied to this machine",
    }


def write_report(result: dict[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write ``result`` as ``bench-<time>.json``/``.md``/``.png`` and ``latest.*`` copies."""
    from rayload.benchmark import render
    from rayload.benchmark.summary import CaseSummary
    from rayload.benchmark.targets import Target

    summaries = [
        CaseSummary(**{**s, "effective": tuple(s["effective"])}) for s in result["summary"]
    ]
    items = [Target(**t) for t in result["targets"]]
    stem = "bench-" + result["started"].replace(":", "").replace("+", "p")[:17]
    return render.write(result, summaries, items, Path(out_dir), stem)


def machine_info() -> dict[str, Any]:
    """CPU, memory, kernel, disk and load: what a reader needs to judge the figures."""
    info: dict[str, Any] = {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "python": sys.version.split()[0],
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None
            )
        with open("/proc/meminfo") as f:
            info["mem_gb"] = round(int(f.readline().split()[1]) / 1e6, 1)
        info["disk"] = subprocess.run(
            ["df", "-hT", "/tmp"], capture_output=True, text=True, check=False, timeout=10
        ).stdout.strip()
    except OSError as exc:
        info["error"] = str(exc)
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
    return info


def baseline_rss() -> int:
    """RSS of a fresh interpreter after importing python, torch and the readers: the
    floor every rank process starts from, reported apart from the per-case deltas."""
    code = (
        "import rayload.benchmark.worker as w; w.preload(); "
        "from rayload.benchmark.probes import rss_bytes; print(rss_bytes())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return int(done.stdout.split()[-1])
