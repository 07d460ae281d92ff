"""The ``rayload`` command.

Each sub-command is one ``_cmd_<name>(args) -> int`` function that parses nothing itself
and calls the library; ``main`` turns :class:`~rayload.errors.RayloadError` into one line
on stderr and the error's exit code (2 bad input, 1 failed load), with the traceback only
under ``--debug``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from rayload.errors import RayloadError

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from rayload.loading.checkpoint import open_checkpoint
    from rayload.loading.describe import describe_checkpoint, render_checkpoint

    summary = describe_checkpoint(open_checkpoint(args.dir))
    print(json.dumps(summary) if args.json else render_checkpoint(summary))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from rayload.loading.checkpoint import open_checkpoint
    from rayload.loading.describe import describe_plan, render_plan
    from rayload.loading.plan import plan_shards

    checkpoint = open_checkpoint(args.dir)
    plan = plan_shards(checkpoint, args.tp, rules=args.rules)
    summary = describe_plan(plan, checkpoint.root)
    print(json.dumps(summary) if args.json else render_plan(summary))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from rayload.loading.convert import convert_checkpoint
    from rayload.loading.manifest import MANIFEST_NAME

    out = convert_checkpoint(args.dir, args.out, args.tp, rules=args.rules)
    print(f"converted {args.dir} for tp={args.tp}: {out / MANIFEST_NAME}")
    return 0


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from rayload.loading.checkpoint import open_checkpoint
    from rayload.loading.describe import human_bytes
    from rayload.loading.synthetic import write_checkpoint

    out = write_checkpoint(
        args.out,
        preset=args.preset,
        size_gb=args.size_gb,
        dtype=args.dtype,
        num_files=args.files,
        seed=args.seed,
    )
    checkpoint = open_checkpoint(out)
    print(
        f"wrote {out}: {args.preset}, {len(checkpoint.tensors)} tensors, "
        f"{human_bytes(checkpoint.tensor_bytes)} in {len(checkpoint.files)} files"
    )
    return 0


def _cmd_load(args: argparse.Namespace) -> int:
    import contextlib
    import json

    from rayload.api import load
    from rayload.progress import LineProgress, load_json, load_summary

    # Ray's driver prints worker-death notices to stdout; while Ray runs, stdout is sent to
    # stderr so stdout carries only rayload's own output (one JSON object with --json).
    stdout = sys.stdout
    with (
        contextlib.redirect_stdout(sys.stderr),
        load(
            args.dir,
            args.tp,
            method=args.method,
            device=args.device,
            strict=args.strict_method,
            rules=args.rules,
            address=args.address,
            placement_strategy=args.placement_strategy,
            trace_dir=args.trace_dir,
            otlp_endpoint=args.otlp_endpoint,
            timeout=args.timeout,
            progress=None if args.json else LineProgress(),
        ) as result,
    ):
        print(json.dumps(load_json(result)) if args.json else load_summary(result), file=stdout)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import os
    import tempfile
    from pathlib import Path

    import ray

    from rayload.api import load
    from rayload.loading.describe import human_bytes
    from rayload.loading.synthetic import write_checkpoint
    from rayload.progress import LineProgress, load_summary

    trace_dir = os.path.abspath(args.trace_dir)
    with tempfile.TemporaryDirectory(prefix="rayload-demo-") as tmp:
        path = write_checkpoint(Path(tmp) / "tiny-llama", preset="tiny-llama")
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"rayload demo: tiny Llama checkpoint ({human_bytes(size)}) in {path}")
        print(f"rayload demo: loading it with TP={args.tp} on a local Ray ...", flush=True)
        # A fresh local Ray unless this process already has one: the checkpoint lives in a
        # local temp dir that the nodes of some other cluster could not read.
        address = None if ray.is_initialized() else "local"
        with load(
            path, args.tp, address=address, trace_dir=trace_dir, progress=LineProgress()
        ) as result:
            print(load_summary(result))
    print(
        f"rayload demo: traces in {trace_dir}: open trace.html in a browser, load "
        "trace.chrome.json in https://ui.perfetto.dev or trace.jaeger.json in Jaeger's "
        "'JSON File' upload"
    )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from rayload.benchmark import BenchConfig, run_benchmark, write_report

    quick = {"size_gb": 0.25, "preset": "tiny-llama", "repeat": 1} if args.quick else {}
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

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = run_benchmark(config, progress=progress)
    paths = write_report(result, args.out)
    print(paths["md"].read_text())
    for kind, path in paths.items():
        progress(f"wrote {kind}: {path}")
    for problem in result["consistency"]:
        print(f"rayload: error: {problem}", file=sys.stderr)
    return 1 if result["consistency"] else 0


def _add_rules(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rules", help="sharding rules file (JSON; default: the preset of config.json)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rayload", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> _Parser:
        p: _Parser = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = add("inspect", _cmd_inspect, "list a checkpoint's files, tensors, dtypes and shapes")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true")

    p = add("plan", _cmd_plan, "show per-rank bytes, replicated bytes and read amplification")
    p.add_argument("dir")
    p.add_argument("--tp", type=int, required=True)
    _add_rules(p)
    p.add_argument("--json", action="store_true")

    p = add("convert", _cmd_convert, "write a pre-sharded checkpoint for one tp size")
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--tp", type=int, required=True)
    _add_rules(p)

    p = add("make-checkpoint", _cmd_make_checkpoint, "write a synthetic Llama-style checkpoint")
    p.add_argument("out")
    p.add_argument("--preset", default="tiny-llama", choices=["tiny-llama", "llama-1b"])
    p.add_argument("--size-gb", type=float, help="scale the layer count to about this size")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument("--files", type=int, help="number of safetensors files (default: by size)")
    p.add_argument("--seed", type=int, default=0)

    p = add("load", _cmd_load, "load a checkpoint onto Ray, one actor per TP rank")
    p.add_argument("dir")
    p.add_argument("--tp", type=int, required=True)
    _add_rules(p)
    p.add_argument("--method", default="auto")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--strict-method", action="store_true")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    p.add_argument(
        "--placement-strategy", default="STRICT_PACK", choices=["STRICT_PACK", "PACK", "SPREAD"]
    )
    p.add_argument("--trace-dir")
    p.add_argument("--otlp-endpoint")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true")

    p = add("demo", _cmd_demo, "load a tiny generated model with TP=2 on a local Ray")
    p.add_argument("--trace-dir", default="rayload-demo-traces")
    p.add_argument("--tp", type=int, default=2)

    p = add("bench", _cmd_bench, "benchmark rayload against peers and the disk limit")
    p.add_argument("--size-gb", type=float, help="generated checkpoint size (default 1.0)")
    p.add_argument("--tp", type=int, nargs="+", help="TP sizes (default 1 2 4)")
    p.add_argument("--cache", nargs="+", choices=["cold", "warm"], help="default: both")
    p.add_argument("--repeat", type=int, help="repetitions per case, medians (default 3)")
    p.add_argument("--out", default="bench-out", help="where to write .json/.md/.png")
    p.add_argument("--methods", nargs="+", help="cases to run (default: all this machine can)")
    p.add_argument("--quick", action="store_true", help="0.25 GB tiny-llama, 1 repetition")
    p.add_argument("--checkpoint", help="benchmark this checkpoint instead of a generated one")
    p.add_argument("--workdir", help="where generated checkpoints live (/tmp/rayload-bench)")
    p.add_argument("--preset", choices=["tiny-llama", "llama-1b"], help="default llama-1b")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where ranks load (default cpu)")
    p.add_argument("--no-verify", action="store_true", help="skip the cross-case tensor check")
    p.add_argument("--no-startup", action="store_true", help="skip timing whole rayload.load")
    p.add_argument(
        "--no-split-probe", action="store_true", help="skip read amplification by tensor kind"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except RayloadError as exc:
        if args.debug:
            raise
        print(f"rayload: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("rayload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
