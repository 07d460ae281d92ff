"""GPU figures that the rank-process harness does not produce (run by benchmarks/gpu.sh).

    python benchmarks/gpu_figures.py probe          # what rayload's probe sees (GDS, cuFile)
    python benchmarks/gpu_figures.py h2d [GiB]      # host-to-device bandwidth, pinned/pageable
    python benchmarks/gpu_figures.py summary JSON   # GB/s per GPU and effective methods

Every sub-command prints lines of ``key: value`` and exits non-zero on a failed check.
"""

from __future__ import annotations

import json
import statistics
import sys
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
    if command == "summary":
        sys.exit(summary(rest[0]))
    sys.exit(f"unknown command {command!r}; use probe, h2d or summary")
