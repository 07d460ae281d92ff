"""The command line explains itself: every command and every option has one line of help
naming its choices and default, and ``rayload --help`` reads as plain text with the
common commands at the end."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rayload.cli import build_parser, main
from rayload.loading.methods import LoadMethod


def _parsers(
    parser: argparse.ArgumentParser, name: str = "rayload"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``rayload`` and every sub-command's parser, with the command line that reaches it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, subparser in action.choices.items():
                yield from _parsers(subparser, f"{name} {command}")


def _options() -> Iterator[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    """Every argument of every parser but ``--help`` and the sub-command switch (whose
    commands are checked as commands)."""
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                yield name, parser, action


def _label(action: argparse.Action) -> str:
    return "/".join(action.option_strings) or action.dest


def _shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text ``--help`` prints for ``action``, ``%(default)s`` and the like filled."""
    return parser._get_formatter()._expand_help(action)


def test_every_command_has_one_line_of_help() -> None:
    missing = []
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [
                    f"{name} {command.dest}"
                    for command in action._choices_actions
                    if not command.help or "\n" in command.help
                ]
    assert not missing, f"commands without one line of help: {missing}"


def test_every_option_and_positional_has_one_line_of_help() -> None:
    missing = [
        f"{name} {_label(action)}"
        for name, _, action in _options()
        if not action.help or action.help == argparse.SUPPRESS or "\n" in action.help
    ]
    assert not missing, f"arguments without one line of help: {missing}"


def test_options_with_choices_list_every_choice_in_their_help() -> None:
    unlisted = [
        f"{name} {_label(action)}: {choice!r} not in {_shown_help(parser, action)!r}"
        for name, parser, action in _options()
        if action.choices is not None
        for choice in action.choices
        if str(choice) not in _shown_help(parser, action)
    ]
    assert not unlisted, "\n".join(unlisted)


def test_options_with_a_default_show_it_in_their_help() -> None:
    hidden = [
        f"{name} {_label(action)}: default {action.default!r} not in "
        f"{_shown_help(parser, action)!r}"
        for name, parser, action in _options()
        if action.default not in (None, False, argparse.SUPPRESS)
        and str(action.default) not in _shown_help(parser, action)
    ]
    assert not hidden, "\n".join(hidden)


def test_load_method_help_lists_every_load_method() -> None:
    """``--method`` takes no argparse ``choices`` (an unknown method gets the library's own
    error, which lists the valid values too), so its help must list them itself."""
    load = dict(_parsers(build_parser()))["rayload load"]
    (method,) = [a for a in load._actions if "--method" in a.option_strings]
    shown = _shown_help(load, method)
    assert all(m.value in shown for m in LoadMethod), shown


def _help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_has_no_rst_markup_and_ends_with_the_common_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _help_of([], capsys)
    assert "``" not in text and ":class:" not in text and ":func:" not in text
    epilog = build_parser().epilog
    assert epilog and text.rstrip().endswith(epilog.rstrip().splitlines()[-1])
    # the epilog's line breaks are kept (not re-wrapped), one example command per line
    examples = [line.split()[:2] for line in text.splitlines() if line.startswith("  rayload ")]
    commands = {cmd for _, cmd in examples}
    assert {
        "demo", "inspect", "plan", "load", "convert", "make-checkpoint", "bench", "directory"
    } <= commands  # fmt: skip


@pytest.mark.parametrize(
    "command",
    ["inspect", "plan", "convert", "make-checkpoint", "load", "demo", "bench", "directory"],
)
def test_command_help_has_no_rst_markup(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = _help_of([command], capsys)
    assert "``" not in text and ":class:" not in text


def test_parsing_a_ray_free_command_imports_no_ray() -> None:
    """Choices that live in Ray-importing modules (devices, placement strategies) are read
    only when used: ``rayload inspect`` and ``plan`` never pay for importing Ray."""
    code = (
        "import sys\n"
        "from rayload.cli import build_parser\n"
        "build_parser().parse_args(['plan', 'dir', '--tp', '2'])\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_command_and_option_is_in_the_docs() -> None:
    """Each command and each ``--option`` is written down in docs/ (the contract's command
    line, or the page that explains it: docs/ray.md for the peer options)."""
    text = "\n".join(page.read_text() for page in sorted(DOCS.glob("*.md")))
    missing = [
        f"{name} {option}"
        for name, parser in _parsers(build_parser())
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help" and option not in text
    ]
    missing += [
        name for name, _ in _parsers(build_parser()) if f"{name} " not in text and " " in name
    ]
    assert not missing, f"not in docs/*.md: {missing}"
