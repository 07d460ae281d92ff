"""``rayload bench``: the benchmarks of :mod:`rayload.benchmark` (``--replicas``: the peer
benchmark)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rayload.cli.common import AddCommand, listed
from rayload.options import DEVICES


def _cmd_bench(args: argparse.Namespace) -> int:
    from rayload.benchmark import BenchConfig, run_benchmark, write_report
    from rayload.benchmark.runner import no_cache_states
    from rayload.loading.storage import is_remote

    if args.replicas:
        return _bench_peers(args)
    if args.cache and args.checkpoint and is_remote(args.checkpoint):
        raise no_cache_states(args.checkpoint)  # even --cache cold warm, the files' default
    quick = _QUICK if args.quick else {}
    chosen = {
        "size_gb": args.size_gb,
        "preset": args.preset,
        "repeat": args.repeat,
        "tp_sizes": tuple(args.tp) if args.tp else None,
        "caches": tuple(args.cache) if args.cache else None,
        "methods": tuple(args.methods) if args.methods else None,
        "checkpoint": args.checkpoint,
        "workdir": args.workdir,
        "device": args.device,
        "verify": False if args.no_verify else None,
        "startup": False if args.no_startup else None,
        "split_probe": False if args.no_split_probe else None,
    }
    config = BenchConfig(**{**quick, **{k: v for k, v in chosen.items() if v is not None}})

    result = run_benchmark(config, progress=_bench_progress)
    _show_report(write_report(result, args.out))
    for problem in result["consistency"]:
        print(f"rayload: error: {problem}", file=sys.stderr)
    return 1 if result["consistency"] else 0


def _bench_peers(args: argparse.Namespace) -> int:
    """``rayload bench --replicas N...``: the peer benchmark on a local multi-node Cluster."""
    from rayload.benchmark.peers import PeerBenchConfig, run_peer_benchmark, write_peer_report
    from rayload.errors import ConfigError

    if args.tp and len(args.tp) > 1:
        raise ConfigError("with --replicas, give one --tp size (ranks per replica)")
    chosen = {
        "replicas": tuple(args.replicas),
        "tp": args.tp[0] if args.tp else None,
        "size_gb": args.size_gb,
        "workdir": args.workdir,
    }
    chosen = {k: v for k, v in chosen.items() if v is not None}
    config = PeerBenchConfig.quick(**chosen) if args.quick else PeerBenchConfig(**chosen)

    result = run_peer_benchmark(config, progress=_bench_progress)
    _show_report(write_peer_report(result, args.out))
    return 0


def _bench_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _show_report(paths: dict[str, Path]) -> None:
    """A bench report: its markdown on stdout, where each file went on stderr."""
    print(paths["md"].read_text())
    for kind, path in paths.items():
        _bench_progress(f"wrote {kind}: {path}")


_QUICK = {"size_gb": 0.25, "preset": "tiny-llama", "repeat": 1}
"""What ``rayload bench --quick`` sets (explicit options still win)."""


def add_commands(add: AddCommand) -> None:
    from rayload.benchmark.cases import CASES
    from rayload.benchmark.runner import CACHES, BenchConfig
    from rayload.loading.synthetic import PRESETS

    bench = BenchConfig()  # its defaults, shown in bench's help

    p = add("bench", _cmd_bench, "benchmark rayload against peers and the disk limit")
    p.add_argument(
        "--size-gb",
        type=float,
        metavar="GB",
        help=f"generated checkpoint size in GB (default: {bench.size_gb})",
    )
    p.add_argument(
        "--tp",
        type=int,
        nargs="+",
        metavar="N",
        help=f"TP sizes (default: {listed(bench.tp_sizes)})",
    )
    p.add_argument(
        "--cache",
        nargs="+",
        choices=list(CACHES),
        help=f"page cache before each case: %(choices)s (default: {listed(bench.caches)})",
    )
    p.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help=f"repetitions per case, tables show medians (default: {bench.repeat})",
    )
    p.add_argument(
        "--out",
        default="bench-out",
        metavar="DIR",
        help="where to write the .json, .md and .png report (default: %(default)s)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        metavar="CASE",
        help=f"cases to run: {listed(CASES)} (default: every case this machine can run; "
        "limit always runs)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run: {listed(f'{k}={v}' for k, v in _QUICK.items())}",
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="benchmark this checkpoint (a directory, or s3://bucket/prefix, read where it "
        "is) instead of a generated one",
    )
    p.add_argument(
        "--workdir",
        metavar="DIR",
        help=f"where generated checkpoints live (default: {bench.workdir})",
    )
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        help=f"generated model shape: %(choices)s (default: {bench.preset})",
    )
    p.add_argument(
        "--device",
        choices=[d for d in DEVICES if d != "auto"],
        metavar="DEVICE",
        help=f"where ranks load: %(choices)s (default: {bench.device})",
    )
    p.add_argument(
        "--no-verify", action="store_true", help="skip the cross-case check of the tensors"
    )
    p.add_argument("--no-startup", action="store_true", help="skip timing whole rayload.load calls")
    p.add_argument(
        "--no-split-probe",
        action="store_true",
        help="skip measuring read amplification by kind of tensor",
    )
    p.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        metavar="N",
        help="run the peer benchmark instead: each count of TP replicas loaded together, "
        "cold, on a local multi-node ray.cluster_utils.Cluster (storage bytes, bytes from "
        "peers, weight population, total), and a new replica from a loaded one vs cold; "
        "--tp (one size), --size-gb, --quick, --workdir and --out apply",
    )
