"""The ``rayload`` command line.

Each sub-command is one ``_cmd_<name>(args) -> int`` function that parses nothing itself
and calls the library; ``main`` turns :class:`~rayload.errors.RayloadError` into one line
on stderr and the error's exit code (2 bad input, 1 failed load), with the traceback only
under ``--debug``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NoReturn, TextIO

from rayload.errors import ClusterLostError, ConfigError, RayloadError
from rayload.options import DEVICES, PROCESS_GROUPS, STRATEGIES

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
    plan = plan_shards(checkpoint, args.tp, rules=args.rules, expert_parallel=args.expert_parallel)
    summary = describe_plan(plan, checkpoint.root)
    print(json.dumps(summary) if args.json else render_plan(summary))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from rayload.loading.convert import convert_checkpoint
    from rayload.loading.manifest import MANIFEST_NAME

    out = convert_checkpoint(
        args.dir, args.out, args.tp, rules=args.rules, expert_parallel=args.expert_parallel
    )
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
    from rayload.cli_output import LineProgress, load_json, load_summary

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
            expert_parallel=args.expert_parallel,
            process_group=None if args.process_group == "none" else args.process_group,
            address=args.address,
            placement_strategy=args.placement_strategy,
            trace_dir=args.trace_dir,
            otlp_endpoint=args.otlp_endpoint,
            timeout=args.timeout,
            progress=None if args.json else LineProgress(),
            replicas=args.replicas,
            peers=not args.no_peers,
            shared_copy=args.shared_copy,
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
    from rayload.cli_output import LineProgress, load_summary
    from rayload.loading.describe import human_bytes
    from rayload.loading.synthetic import write_checkpoint

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


def _cmd_directory(args: argparse.Namespace) -> int:
    import contextlib
    import json

    import ray

    from rayload.actors.directory import (
        DIRECTORY_NAME,
        NAMESPACE,
        DirectoryUnavailable,
        call,
        directory,
        stop_directory,
    )
    from rayload.cli_output import directory_table

    name = f"{DIRECTORY_NAME} in namespace {NAMESPACE}"
    stdout = sys.stdout  # as in `load`: Ray's notices go to stderr
    with contextlib.redirect_stdout(sys.stderr):
        started_ray = _join_cluster(args.address)
        try:
            actor = directory(create=False)
            entries, silent = [], None
            if actor is not None:
                try:
                    entries = call(actor.entries, timeout_s=_DIRECTORY_TIMEOUT_S)
                except DirectoryUnavailable as exc:
                    silent = exc
            stopped = args.stop and actor is not None and stop_directory()
        finally:
            if started_ray:
                ray.shutdown()
    if silent is not None and not stopped:
        raise RayloadError(
            f"the peer directory ({name}) does not answer: {silent}; `rayload directory "
            "--stop` kills it, and the next load starts a new one"
        )
    replicas = [entry.summary() for entry in entries]
    if args.json:
        doc: dict[str, object] = {
            "directory": DIRECTORY_NAME,
            "namespace": NAMESPACE,
            "running": actor is not None and not stopped,
            "replicas": replicas,
        }
        if args.stop:
            doc["stopped"] = stopped
        print(json.dumps(doc), file=stdout)
        return 0
    if actor is None:
        print(
            f"no peer directory on this cluster ({name}): no load with peers ran here since "
            "the cluster started or the directory was stopped",
            file=stdout,
        )
        return 0
    if replicas:
        print(directory_table(replicas), file=stdout)
    elif silent is None:
        print(f"the peer directory ({name}) lists no replica", file=stdout)
    if stopped:
        listed = "" if silent is None else f" (it did not answer: {silent})"
        print(
            f"stopped the peer directory{listed}; the replicas it listed keep their weights "
            "but are no longer offered to new loads",
            file=stdout,
        )
    return 0


_DIRECTORY_TIMEOUT_S = 10.0
"""How long ``rayload directory`` waits for the directory to answer."""


def _join_cluster(address: str | None) -> bool:
    """Join the running cluster at ``address`` (as ``load`` finds it) for a command that
    only looks at it; True when this call ran ``ray.init``. Nothing found, or ``local``,
    is a :class:`~rayload.errors.ConfigError`: a new local Ray has nothing to show."""
    import time

    import ray

    from rayload import cluster

    if ray.is_initialized():
        return False
    found = cluster.find_address(address)
    if found.address in (None, "local"):
        raise ConfigError(
            "no Ray cluster to look in (no --address, RAY_ADDRESS or `ray start` cluster on "
            "this machine): pass --address host:port of the cluster the loads ran on"
        )
    try:
        cluster.check_reachable(found)
    except ConfigError as exc:
        cause = exc.__cause__
        reason = getattr(cause, "strerror", None) or str(cause or exc)
        raise ConfigError(
            f"cannot reach a Ray cluster at {found.address} ({found.describe()}): {reason}; "
            "pass the --address of the running cluster the loads ran on"
        ) from exc
    return cluster.connect(address, deadline=time.monotonic() + cluster.CONNECT_TIMEOUT_S)


def _cmd_bench(args: argparse.Namespace) -> int:
    from rayload.benchmark import BenchConfig, run_benchmark, write_report

    if args.replicas:
        return _bench_peers(args)
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


_PROCESS_GROUPS = (*PROCESS_GROUPS, "none")

_QUICK = {"size_gb": 0.25, "preset": "tiny-llama", "repeat": 1}
"""What ``rayload bench --quick`` sets (explicit options still win)."""

_DESCRIPTION = """\
Load the weights of a tensor-parallel model onto a Ray cluster, one actor per TP rank,
each reading only its own shard of a safetensors checkpoint, and show where start-up
time goes: one trace of every rank (Jaeger, Perfetto, HTML) and a table of metrics."""

_EPILOG = """\
common commands:
  rayload demo                                   tiny generated model, TP=2, local Ray
  rayload make-checkpoint /tmp/llama --preset llama-1b --size-gb 1
  rayload inspect /tmp/llama                     files, tensors, dtypes, shapes
  rayload plan /tmp/llama --tp 4                 bytes per rank, replicated, amplification
  rayload load /tmp/llama --tp 4 --trace-dir traces/
  rayload load /tmp/llama --tp 4 --method scratch --device cpu --json
  rayload convert /tmp/llama /tmp/llama-tp4 --tp 4
  rayload load /tmp/llama-tp4 --tp 4 --method converted
  rayload load /tmp/llama --tp 2 --replicas 3          3 copies, storage read once
  rayload directory                              replicas offered to new loads
  rayload bench --quick

exit codes: 0 success; 2 bad input or arguments (one line on stderr, the traceback with
--debug); 1 a rank failed (named with its node and the cause) or an internal error.
Run `rayload COMMAND --help` for the options of a command."""

_LOAD_EPILOG = """\
examples:
  rayload load /tmp/llama --tp 4 --trace-dir traces/
  rayload load /tmp/llama --tp 2 --method fastsafetensors_gdr --device cuda --strict-method
  rayload load /tmp/llama --tp 8 --address 10.0.0.1:6379 --placement-strategy SPREAD
  rayload load /tmp/llama --tp 4 --otlp-endpoint http://localhost:4317 --json
  rayload load /tmp/llama --tp 2 --replicas 4 --address 10.0.0.1:6379"""

_DIRECTORY_EPILOG = """\
One detached actor per cluster (rayload-peer-directory, namespace rayload) maps each
checkpoint and plan (the peer key) to the replicas that hold it; loads with peers create
it and register there. States: loading, loaded.

examples:
  rayload directory --address 10.0.0.1:6379
  rayload directory --json
  rayload directory --stop"""

_FORMATTER = argparse.RawDescriptionHelpFormatter


def _listed(values: Iterable[object]) -> str:
    return ", ".join(str(v) for v in values)


_HF_LAYOUTS = "a directory with model.safetensors or an index and its shards"


def _add_dir(
    p: argparse.ArgumentParser,
    help: str = f"checkpoint: {_HF_LAYOUTS}, or one converted by `rayload convert` (a "
    "manifest and rank files); or one .safetensors file",
) -> None:
    p.add_argument("dir", help=help)


def _add_tp(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--tp", type=int, required=True, metavar="N", help=f"tensor-parallel size: {what}"
    )


def _add_rules(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rules",
        metavar="FILE",
        help="JSON file of sharding rules (default: the preset for config.json's "
        "architectures; with none, every tensor is replicated)",
    )


def _add_expert_parallel(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="divide a mixture-of-experts model's experts among the ranks, whole (rank r "
        "holds the r-th contiguous block), instead of splitting every expert (vLLM's name)",
    )


def _add_json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON object")


def build_parser() -> argparse.ArgumentParser:
    """The ``rayload`` parser: one sub-command per ``_cmd_<name>``, every option with one
    line of help naming its choices and default (taken from the code, never retyped)."""
    from rayload.benchmark.cases import CASES
    from rayload.benchmark.runner import CACHES, BenchConfig
    from rayload.loading.methods import LoadMethod
    from rayload.loading.synthetic import DTYPES, FILE_TARGET_BYTES, PRESETS

    bench = BenchConfig()  # its defaults, shown in bench's help

    parser = _Parser(
        prog="rayload", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_FORMATTER
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, title="commands"
    )

    def add(
        name: str, func: Callable[[argparse.Namespace], int], help: str, epilog: str | None = None
    ) -> _Parser:
        p: _Parser = sub.add_parser(
            name, help=help, description=help, epilog=epilog, formatter_class=_FORMATTER
        )
        p.set_defaults(func=func)
        return p

    p = add("inspect", _cmd_inspect, "list a checkpoint's files, tensors, dtypes and shapes")
    _add_dir(p)
    _add_json(p, "the summary")

    p = add("plan", _cmd_plan, "show per-rank bytes, replicated bytes and read amplification")
    _add_dir(p)
    _add_tp(p, "the number of ranks to plan for (required)")
    _add_rules(p)
    _add_expert_parallel(p)
    _add_json(p, "the plan")

    p = add("convert", _cmd_convert, "write a pre-sharded checkpoint for one tp size")
    _add_dir(p, f"the Hugging Face checkpoint to convert: {_HF_LAYOUTS}; or one .safetensors file")
    p.add_argument("out", help="output directory: new, or empty")
    _add_tp(p, "the number of ranks the output is sharded for (required)")
    _add_rules(p)
    _add_expert_parallel(p)

    p = add(
        "make-checkpoint",
        _cmd_make_checkpoint,
        "write a synthetic Llama- or Mixtral-shaped checkpoint",
    )
    p.add_argument("out", help="output directory: new, or one that holds no checkpoint")
    p.add_argument(
        "--preset",
        default="tiny-llama",
        choices=list(PRESETS),
        help="model shape: %(choices)s (default: %(default)s)",
    )
    p.add_argument(
        "--size-gb",
        type=float,
        metavar="GB",
        help="scale the layer count to about this many GB (default: the preset's layers)",
    )
    p.add_argument(
        "--dtype",
        default="bf16",
        choices=list(DTYPES),
        help="tensor dtype: %(choices)s (default: %(default)s)",
    )
    p.add_argument(
        "--files",
        type=int,
        metavar="N",
        help="number of safetensors files "
        f"(default: one per {FILE_TARGET_BYTES >> 20} MiB, at least 2)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the random values (default: %(default)s)",
    )

    p = add("load", _cmd_load, "load a checkpoint onto Ray, one actor per TP rank", _LOAD_EPILOG)
    _add_dir(p)
    _add_tp(p, "the number of ranks, one Ray actor each (required)")
    _add_rules(p)
    _add_expert_parallel(p)
    p.add_argument(
        "--process-group",
        default="auto",
        choices=_PROCESS_GROUPS,
        metavar="BACKEND",
        help="torch.distributed group across the ranks: %(choices)s; auto: nccl on CUDA, "
        "gloo on cpu (default: %(default)s)",
    )
    p.add_argument(
        "--method",
        default="auto",
        help=f"load method: {_listed(m.value for m in LoadMethod)}; auto chooses per rank "
        "from the node and the checkpoint (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        metavar="DEVICE",
        help="where the weights go: %(choices)s; auto: the rank's GPU when Ray gave it one, "
        "else cpu (default: %(default)s)",
    )
    p.add_argument(
        "--strict-method",
        action="store_true",
        help="fail (exit 2) where a rank would fall back to another load method",
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="Ray to join: host:port, ray://..., auto, or local for a new local Ray (default: "
        "RAY_ADDRESS, else a `ray start` cluster on this machine, else a new local Ray)",
    )
    p.add_argument(
        "--placement-strategy",
        default="STRICT_PACK",
        choices=STRATEGIES,
        metavar="STRATEGY",
        help="placement group strategy: %(choices)s; inside a Ray Serve replica its own "
        "group is used (default: %(default)s)",
    )
    p.add_argument(
        "--trace-dir",
        metavar="DIR",
        help="write the trace here as OTLP JSON, Jaeger JSON, Chrome/Perfetto JSON and HTML "
        "(default: no files)",
    )
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="send the trace over OTLP: an http(s)://.../v1/traces URL over HTTP, anything "
        "else over gRPC (default: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, else not sent)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="seconds the whole load may take, placement included (default: %(default)s)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel copies of the TP group, a placement group each; replica 0 reads "
        "storage, the others receive its bytes from it over torch.distributed (gloo) (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--shared-copy",
        action="store_true",
        help="keep a copy of each loaded rank's shards in its node's Ray object store, so "
        "a new replica on the same node copies them from shared memory (costs the shards' "
        "size per rank in the object store)",
    )
    p.add_argument(
        "--no-peers",
        action="store_true",
        help="use no peer directory: receive nothing from other loads' replicas and offer "
        "them none (this load's replicas still share)",
    )
    _add_json(
        p,
        "the result (trace_id, tp_size, replicas, replica_ids, peer_key, startup_metrics, "
        "ranks of every replica, warnings)",
    )

    p = add("demo", _cmd_demo, "load a tiny generated model with TP=2 on a local Ray")
    p.add_argument(
        "--trace-dir",
        default="rayload-demo-traces",
        metavar="DIR",
        help="where to write the trace files (default: %(default)s)",
    )
    p.add_argument(
        "--tp", type=int, default=2, metavar="N", help="number of ranks (default: %(default)s)"
    )

    p = add(
        "directory",
        _cmd_directory,
        "list the replicas the cluster's peer directory offers to new loads",
        _DIRECTORY_EPILOG,
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="Ray cluster to look in: host:port, ray://... or auto (default: RAY_ADDRESS, "
        "else a `ray start` cluster on this machine)",
    )
    p.add_argument(
        "--stop",
        action="store_true",
        help="then kill the directory: loaded replicas keep their weights, new loads start "
        "an empty one",
    )
    _add_json(p, "the replicas (replica, key, path, tp_size, state, job, nodes, age_s)")

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
        help=f"TP sizes (default: {_listed(bench.tp_sizes)})",
    )
    p.add_argument(
        "--cache",
        nargs="+",
        choices=list(CACHES),
        help=f"page cache before each case: %(choices)s (default: {_listed(bench.caches)})",
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
        help=f"cases to run: {_listed(CASES)} (default: every case this machine can run; "
        "limit always runs)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run: {_listed(f'{k}={v}' for k, v in _QUICK.items())}",
    )
    p.add_argument(
        "--checkpoint", metavar="DIR", help="benchmark this checkpoint instead of a generated one"
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
    return parser


def _report_error(exc: RayloadError, *, as_json: bool, stdout: TextIO | None = None) -> None:
    """One line on stderr; with ``--json`` also the one stdout object, ``{"error", "kind",
    "exit_code"}``, so a script reading stdout always gets JSON."""
    message = str(exc) or type(exc).__name__
    print(f"rayload: error: {message}", file=sys.stderr)
    if as_json:
        import json

        doc = {"error": message, "kind": type(exc).__name__, "exit_code": exc.exit_code}
        print(json.dumps(doc), file=stdout or sys.stdout)


def _exit_when_stuck(*, as_json: bool) -> None:
    """As the command, a load stuck in a Ray call on a lost head ends with the one error line
    and exit 1 (from the head watch's thread), before Ray's core would kill the process."""
    from rayload import cluster

    stdout = sys.stdout  # `load` sends sys.stdout to stderr while Ray runs

    def leave(error: ClusterLostError) -> None:
        _report_error(error, as_json=as_json, stdout=stdout)
        _leave_now(error.exit_code)

    cluster.on_stuck(leave)


def _leave_now(code: int) -> NoReturn:
    """Exit without Ray's exit handler, which spends ~15 s (or, in a GCS call, a minute of
    CPU and then kills the process with core dumps) on a dead head."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if argv is None:
        _exit_when_stuck(as_json=bool(getattr(args, "json", False)))
    try:
        return int(args.func(args))
    except RayloadError as exc:
        if args.debug:
            raise
        _report_error(exc, as_json=bool(getattr(args, "json", False)))
        if isinstance(exc, ClusterLostError) and argv is None:
            _leave_now(exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt:
        print("rayload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
