"""``rayload load`` (its flags made from :class:`~rayload.config.LoadConfig`'s fields, or
read from ``--config FILE``) and ``rayload demo``."""

from __future__ import annotations

import argparse
import sys

from rayload.cli.common import AddCommand, add_json
from rayload.cli.fields import add_config_flags, given_fields, option_name
from rayload.config import LoadConfig, config_from_file
from rayload.errors import ConfigError


def load_config(args: argparse.Namespace) -> LoadConfig:
    """The config of ``rayload load``: ``--config FILE`` with the flags given replacing
    its values, or the flags alone (``DIR`` and ``--tp`` then required)."""
    given = given_fields(args)
    if args.config is not None:
        return config_from_file(args.config, given)
    missing = [
        option_name(name)
        for name, field in LoadConfig.model_fields.items()
        if field.is_required() and name not in given
    ]
    if missing:
        raise ConfigError(f"give {' and '.join(missing)} (or --config FILE holding them)")
    return LoadConfig.validated(given)


def _cmd_load(args: argparse.Namespace) -> int:
    import contextlib
    import json

    from rayload.api import load
    from rayload.cli_output import LineProgress, load_json, load_summary

    config = load_config(args)
    # Ray's driver prints worker-death notices to stdout; while Ray runs, stdout is sent to
    # stderr so stdout carries only rayload's own output (one JSON object with --json).
    stdout = sys.stdout
    progress = None if args.json else LineProgress()
    with contextlib.redirect_stdout(sys.stderr), load(config, progress=progress) as result:
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


_LOAD_EPILOG = """\
examples:
  rayload load /tmp/llama --tp 4 --trace-dir traces/
  rayload load /tmp/llama --tp 2 --method fastsafetensors_gdr --device cuda --strict-method
  rayload load /tmp/llama --tp 8 --address 10.0.0.1:6379 --placement-strategy SPREAD
  rayload load /tmp/llama --tp 4 --otlp-endpoint http://localhost:4317 --json
  rayload load /tmp/llama --tp 2 --replicas 4 --address 10.0.0.1:6379
  rayload load --config load.yaml --no-peers     the file's options, a flag replacing one

A config file holds LoadConfig's field names (`rayload config` lists them), e.g.
  path: /tmp/llama
  tp_size: 4"""


def add_commands(add: AddCommand) -> None:
    p = add("load", _cmd_load, "load a checkpoint onto Ray, one actor per TP rank", _LOAD_EPILOG)
    add_config_flags(p)
    p.add_argument(
        "--config",
        metavar="FILE",
        help="YAML or JSON file of load options (the field names of `rayload config`); the "
        "flags given replace its values",
    )
    add_json(
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
