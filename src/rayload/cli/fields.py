"""Command-line flags made from :class:`~rayload.config.LoadConfig`'s fields: one flag per
field, its help the field's doc, its choices the field's type, its default the field's.

``rayload load`` adds every field with :func:`add_config_flags` and turns what was given
back into fields with :func:`given_fields` (a flag not given leaves the field to
``--config FILE`` or the default); ``plan`` and ``convert`` add the few fields that apply
to them with their defaults (:func:`add_field_flag` with ``overridable=False``).
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable
from typing import Any, Literal

from pydantic.fields import FieldInfo

from rayload.config import Flag, LoadConfig
from rayload.loading.methods import LoadMethod

NONE = "none"
"""How the command line spells None for a field with choices (``--process-group none``)."""


def field_flag(name: str) -> Flag:
    """The :class:`~rayload.config.Flag` of field ``name`` (the default one if it has none)."""
    field = LoadConfig.model_fields[name]
    flags = [m for m in field.metadata if isinstance(m, Flag)]
    return flags[0] if flags else Flag()


def option_name(name: str) -> str:
    """The flag of field ``name``: ``--tp`` for ``tp_size``, ``DIR`` for ``path``."""
    flag = field_flag(name)
    if flag.positional:
        return (flag.name or name).upper()
    return flag.name or "--" + name.replace("_", "-")


def choices(name: str) -> list[str] | None:
    """The values field ``name`` takes, as the command line spells them (None: any)."""
    annotation = LoadConfig.model_fields[name].annotation
    if annotation is LoadMethod:
        return [m.value for m in LoadMethod]
    parts = (
        (annotation,) if typing.get_origin(annotation) is Literal else typing.get_args(annotation)
    )
    values = [
        str(v)
        for part in parts
        if typing.get_origin(part) is Literal
        for v in typing.get_args(part)
    ]
    if values and type(None) in parts:
        values.append(NONE)
    return values or None


def shown_default(field: FieldInfo) -> str:
    """The default as the help shows it."""
    default = field.default
    if isinstance(default, LoadMethod):
        return default.value
    return NONE if default is None else str(default)


def add_field_flag(
    parser: argparse.ArgumentParser,
    name: str,
    *,
    overridable: bool = True,
    required: bool = False,
) -> argparse.Action:
    """Add field ``name``'s flag to ``parser``.

    ``overridable`` (``rayload load``): nothing is set when the flag is not given (the
    config file or the field's default decides), and a bool is ``--x/--no-x`` so a flag
    can override the file either way. Otherwise the field's default is the flag's, and a
    bool (default False) is a plain ``--x``."""
    field = LoadConfig.model_fields[name]
    flag = field_flag(name)
    values = choices(name)
    help_text = field.description or ""
    # --method takes any string: an unknown one gets the library's message, listing them.
    argparse_choices = values if values and name != "method" else None
    notes = [", ".join(values)] if values else []
    if field.annotation is bool and overridable:
        notes.append(f"default: {option_name(name) if field.default else _negative(name)}")
    elif not field.is_required() and field.default is not None and field.annotation is not bool:
        notes.append(f"default: {shown_default(field)}")
    if notes:
        help_text += f" ({'; '.join(notes)})"
    kwargs: dict[str, Any] = {"help": help_text.replace("%", "%%"), "dest": name}
    if flag.positional:
        kwargs.pop("dest")
        return parser.add_argument(
            name,
            metavar=option_name(name),
            nargs="?" if overridable else None,
            default=argparse.SUPPRESS if overridable else None,
            help=kwargs["help"],
        )
    if overridable:
        kwargs["default"] = argparse.SUPPRESS
    elif not field.is_required():
        kwargs["default"] = field.default
    if field.annotation is bool:
        action = argparse.BooleanOptionalAction if overridable else "store_true"
        return parser.add_argument(option_name(name), action=action, **kwargs)
    return parser.add_argument(
        option_name(name),
        type=_scalar_type(field.annotation),
        choices=argparse_choices,
        metavar=flag.metavar,
        required=required,
        **kwargs,
    )


def _negative(name: str) -> str:
    return "--no-" + option_name(name).removeprefix("--")


def _scalar_type(annotation: Any) -> type:
    """``int`` or ``float`` for a numeric field, else ``str`` (the model parses the rest)."""
    return annotation if annotation in (int, float) else str


def add_config_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every field's flag, overridable (see :func:`add_field_flag`)."""
    return [add_field_flag(parser, name) for name in LoadConfig.model_fields]


def given_fields(args: argparse.Namespace, names: Iterable[str] | None = None) -> dict[str, Any]:
    """The fields whose flags were given, as the model takes them (``none`` -> None)."""
    given: dict[str, Any] = {}
    for name in LoadConfig.model_fields if names is None else names:
        if hasattr(args, name):
            value = getattr(args, name)
            values = choices(name)
            given[name] = None if values and NONE in values and value == NONE else value
    return given
