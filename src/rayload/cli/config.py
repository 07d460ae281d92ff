"""``rayload config``: the options of a load (:class:`~rayload.config.LoadConfig`), as a
table or, with ``--schema``, as the JSON schema a config file follows."""

from __future__ import annotations

import argparse

from rayload.cli.common import AddCommand


def _cmd_config(args: argparse.Namespace) -> int:
    import json

    from rayload.config import LoadConfig, options_table

    print(json.dumps(LoadConfig.model_json_schema(), indent=2) if args.schema else options_table())
    return 0


_CONFIG_EPILOG = """\
A config file (`rayload load --config FILE`, Serve's application args) is YAML or JSON with
these names; flags given with it replace its values:

  path: /models/llama
  tp_size: 4
  method: auto
  trace_dir: traces/

examples:
  rayload config                          the options: type, default, what each does
  rayload config --schema > load.schema.json"""


def add_commands(add: AddCommand) -> None:
    p = add("config", _cmd_config, "show the options of a load and their defaults", _CONFIG_EPILOG)
    p.add_argument(
        "--schema",
        action="store_true",
        help="print the JSON schema of a config file instead (JSON Schema, from LoadConfig)",
    )
