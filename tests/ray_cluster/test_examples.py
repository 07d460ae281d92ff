"""examples/load_tp4.py runs top to bottom on the session cluster (Serve and job-submit
examples have their own tests)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_load_tp4_example_runs_and_shows_every_rank(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    no_leaks: object,
) -> None:
    script = EXAMPLES / "load_tp4.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--trace-dir", str(tmp_path)])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("rank ")] == [
        "rank 0",
        "rank 1",
        "rank 2",
        "rank 3",
    ]
    assert "is split on dim 0" in out and (tmp_path / "trace.html").is_file()
