"""GPU figures that the rank-process harness does not produce (run by benchmarks/gpu.sh).

    python benchmarks/gpu_figures.py probe          # what rayload's probe sees (GDS, cuFile)
    python benchmarks/gpu_figures.py h2d [GiB]      # host-to-device bandwidth, pinned/pageable
    python benchmarks/gpu_figures.py sweep CKPT     # scratch onto cuda:0, reader settings
    python benchmarks/gpu_figures.py summary JSON   # GB/s per GPU and effective methods

Every sub-command prints lines of ``key: value`` and exits non-zero on a failed check.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

TARGET_GBPS = 35.0


def probe() -> int:
    import torch

    from rayload.loading.probe import probe_environment

    env = probe_environment()
    print(f"torch: {torch.__version__} (CUDA {torch.version.cuda})")
    for key, value in sorted(vars(env).items()):
        print(f"probe.{key}: {value}")
    print(f"probe.gds_available: {env.gds_available}")
    print(f"probe.gds_missing_reason: {env.gds_missing_reason}")
    if not env.cuda_available:
        print("FAIL: torch sees no CUDA device", file=sys.stderr)
        return 1
    return 0


def h2d(gib: float) -> int:
    """Copy ``gib`` GiB host-to-device from a pinned and from a pageable buffer, 5 times
    each after one warm-up, timed with CUDA events; print the median GB/s (10^9 B/s)."""
    import torch

    nbytes = int(gib * (1 << 30))
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for label, pinned in (("pinned", True), ("pageable", False)):
        src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        rates = []
        for i in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=pinned)
            end.record()
            end.synchronize()
            if i:
                rates.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        print(
            f"h2d.{label}_gbps: {statistics.median(rates):.1f} (runs: "
            f"{', '.join(f'{r:.1f}' for r in rates)})"
        )
        del src
    return 0


def sweep(checkpoint: str, repeat: int = 2) -> int:
    """scratch, TP=1, onto the local GPU from the page cache with several reader settings
    (threads x chunk size, staging = threads + 2 pinned chunks): the best of ``repeat``
    loads as GB/s of ``load_rank`` end to end (headers, plan, pinned allocation, reads,
    copies, ``rank.sync``), and that load's phases. In-process, one load at a time."""
    import torch

    from rayload.loading import load_rank
    from rayload.loading.backends import ReaderOptions

    files = sorted(os.path.join(checkpoint, f) for f in os.listdir(checkpoint))
    for path in files:  # into the page cache
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    torch.zeros(1, device="cuda")
    print(f"sweep.cpus: {os.cpu_count()}")
    for threads in (4, 8, 12, 16):
        for chunk_mib in (8, 32, 64):
            options = ReaderOptions(threads=threads, chunk_bytes=chunk_mib << 20)
            best: tuple[float, Any] | None = None
            for _ in range(repeat):
                t0 = time.perf_counter()
                tensors, report = load_rank(
                    checkpoint, 0, 1, "scratch", "cuda", reader_options=options, strict=True
                )
                seconds = time.perf_counter() - t0
                nbytes = report.bytes_read
                del tensors
                if best is None or seconds < best[0]:
                    best = (seconds, report)
            assert best is not None
            seconds, report = best
            phases = ", ".join(f"{p.name} {p.seconds * 1e3:.1f} ms" for p in report.phases)
            print(
                f"sweep.scratch.threads{threads}.chunk{chunk_mib}MiB: "
                f"{nbytes / seconds / 1e9:.1f} GB/s ({nbytes / 1e9:.2f} GB in "
                f"{seconds:.3f} s; {phases})"
            )
            torch.cuda.empty_cache()
    return 0


def summary(path: str) -> int:
    """GB/s per GPU (TP=1, one GPU: checkpoint bytes / median wall) of every rayload case,
    its effective method, and the 35 GB/s page-cache target."""
    with open(path) as f:
        result: dict[str, Any] = json.load(f)
    failed = False
    for s in result["summary"]:
        if s["tp_size"] != 1 or s["kind"] != "rayload":
            continue
        gbps = s["gbps"]
        line = (
            f"{s['cache']}.{s['case']}: {gbps:.1f} GB/s per GPU, effective "
            f"{','.join(s['effective']) or '-'}, runs {s['runs']}"
        )
        if s["cache"] == "warm":
            met = gbps >= TARGET_GBPS
            line += (
                f", target >= {TARGET_GBPS:g} GB/s from page cache: {'met' if met else 'MISSED'}"
            )
        print(line)
        failed |= s["runs"] == 0
    for sample in result["samples"]:
        for rank in sample["ranks"]:
            if rank.get("fallback_reason"):
                print(f"fallback: {sample['case']} ({sample['cache']}): {rank['fallback_reason']}")
    for problem in result["consistency"]:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if failed or result["consistency"] else 0


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["probe"]
    if command == "probe":
        sys.exit(probe())
    if command == "h2d":
        sys.exit(h2d(float(rest[0]) if rest else 4.0))
    if command == "sweep":
        sys.exit(sweep(rest[0]))
    if command == "summary":
        sys.exit(summary(rest[0]))
    sys.exit(f"unknown command {command!r}; use probe, h2d, sweep or summary")
