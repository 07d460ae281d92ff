"""Run the ``rayload`` command in this process and check its one-line errors.

``run_cli`` calls ``rayload.cli.main(argv)`` with stdout and stderr captured, as a fresh
``rayload`` process would show them: the log handler ``main`` installs with
``logging.basicConfig`` (a no-op under pytest, whose capture handlers hold the root logger)
and Python's default warning filters both write into the captured stderr, so a stray log
line or warning still breaks "exactly one line on stderr". A test that must prove something
of a fresh process (it starts or stops its own Ray, imports, signals, the entry-point
script) runs ``python -m rayload.cli`` itself and says why.
"""

from __future__ import annotations

import io
import logging
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

from rayload.cli import main


@dataclass(frozen=True)
class CliRun:
    """What ``rayload ARGS`` printed and its exit code (the fields of a CompletedProcess)."""

    returncode: int
    stdout: str
    stderr: str


@contextmanager
def _fresh_process_logging_and_warnings(stderr: io.StringIO) -> Iterator[None]:
    """The root logger without handlers (so ``main``'s ``basicConfig`` installs its own on
    the redirected stderr) and the interpreter's default warning filters, then as before."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning):
                warnings.simplefilter("ignore", category)
            warnings.simplefilter("ignore", ResourceWarning)
            yield
        for w in caught:
            stderr.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def run_cli(*args: str) -> CliRun:
    """``rayload ARGS`` in this process; never raises on a non-zero exit (argparse's
    ``SystemExit`` included)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        redirect_stdout(stdout),
        redirect_stderr(stderr),
        _fresh_process_logging_and_warnings(stderr),
    ):
        try:
            code = main(list(args))
        except SystemExit as exited:
            code = 0 if exited.code is None else int(exited.code)
    return CliRun(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())


@dataclass(frozen=True)
class FreshDemo:
    """What ``rayload demo`` in a fresh process did (the ``fresh_demo`` fixture of
    tests/conftest.py): its exit and output, and the trace directory it wrote."""

    run: subprocess.CompletedProcess[str]
    trace_dir: Path


def assert_one_line_error(result: CliRun, *needles: str) -> None:
    """Exit code 2, exactly one line on stderr, no traceback, every needle in that line."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0]
