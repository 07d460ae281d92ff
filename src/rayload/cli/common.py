"""What the command modules share: the parser class, the ``add`` function each module
registers its commands with, and the arguments several commands take."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import NoReturn, Protocol

FORMATTER = argparse.RawDescriptionHelpFormatter

HF_LAYOUTS = "a directory with model.safetensors or an index and its shards"


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


Command = Callable[[argparse.Namespace], int]
"""A sub-command: parses nothing itself, calls the library, returns the exit code."""


class AddCommand(Protocol):
    """``add(name, func, help, epilog=None)``: a sub-command's parser, ``func`` its run."""

    def __call__(
        self, name: str, func: Command, help: str, epilog: str | None = None
    ) -> Parser: ...


def listed(values: Iterable[object]) -> str:
    return ", ".join(str(v) for v in values)


def add_dir(
    p: argparse.ArgumentParser,
    help: str = f"checkpoint: {HF_LAYOUTS}, or one converted by `rayload convert` (a "
    "manifest and rank files); or one .safetensors file",
) -> None:
    p.add_argument("dir", help=help)


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON object")
