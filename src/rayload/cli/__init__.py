"""The ``rayload`` command line: one module per command (or family of commands), each
registering its parsers with ``add_commands(add)``:

::

    checkpoints.py   inspect, plan, convert, make-checkpoint (no Ray)
    load.py          load (flags from LoadConfig's fields, --config FILE), demo
    config.py        config (the options of a load; --schema)
    directory.py     directory (the peer directory's replicas)
    bench.py         bench
    fields.py        flags made from LoadConfig's fields
    common.py        the parser class and the arguments commands share

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
from collections.abc import Sequence
from typing import NoReturn, TextIO

from rayload.cli import bench, checkpoints, config, directory, load
from rayload.cli.common import FORMATTER, Command, Parser
from rayload.errors import ClusterLostError, RayloadError

log = logging.getLogger(__name__)

_COMMANDS = (checkpoints, load, config, directory, bench)
"""The command modules, in the order ``rayload --help`` lists their commands."""

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
  rayload load --config load.yaml --replicas 2    options from a YAML file, flags win
  rayload config                                 every option of a load, with defaults
  rayload directory                              replicas offered to new loads
  rayload bench --quick

exit codes: 0 success; 2 bad input or arguments (one line on stderr, the traceback with
--debug); 1 a rank failed (named with its node and the cause) or an internal error.
Run `rayload COMMAND --help` for the options of a command."""


def build_parser() -> argparse.ArgumentParser:
    """The ``rayload`` parser: one sub-command per ``_cmd_<name>``, every option with one
    line of help naming its choices and default (taken from the code, never retyped)."""
    parser = Parser(
        prog="rayload", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=FORMATTER
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, title="commands"
    )

    def add(name: str, func: Command, help: str, epilog: str | None = None) -> Parser:
        p: Parser = sub.add_parser(
            name, help=help, description=help, epilog=epilog, formatter_class=FORMATTER
        )
        p.set_defaults(func=func)
        return p

    for module in _COMMANDS:
        module.add_commands(add)
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


__all__ = ["build_parser", "main"]
