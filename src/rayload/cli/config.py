"""``rayload config``: the options of a load (:class:`~rayload.config.LoadConfig`), as a
table or, with ``--schema``, as the JSON schema a config file follows."""

from __future__ import annotations

import argparse
import typing
from typing import Literal

from rayload.cli.common import AddCommand
from rayload.config import LoadConfig
from rayload.loading.methods import LoadMethod


def options_table() -> str:
    """The options of a load as a markdown table (name, type, default, doc): the table
    in docs/design.md, printed by ``rayload config``."""
    rows = ["| option | type | default | what it does |", "|---|---|---|---|"]
    for name, field in LoadConfig.model_fields.items():
        default = "required" if field.is_required() else f"`{_shown(field.default)}`"
        kind = _type_name(field.annotation)
        rows.append(f"| `{name}` | {kind} | {default} | {field.description} |")
    return "\n".join(rows)


def _shown(value: object) -> str:
    """A default as YAML spells it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _type_name(annotation: object) -> str:
    if annotation is LoadMethod:
        return " \\| ".join(m.value for m in LoadMethod)
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return " \\| ".join(str(a) for a in args)
    if args:
        return " \\| ".join(_type_name(a) for a in args)
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _cmd_config(args: argparse.Namespace) -> int:
    import json

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
