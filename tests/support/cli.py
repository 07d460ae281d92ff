"""Run the ``rayload`` command in a subprocess and check its one-line errors."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``rayload ARGS`` with this interpreter; never raises on a non-zero exit."""
    return subprocess.run(
        [sys.executable, "-m", "rayload.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit code 2, exactly one line on stderr, no traceback, every needle in that line."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0]
