"""``rayload bench`` end to end on a tiny checkpoint, and its bad-input handling."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayload.cli import main


def test_bench_cli_writes_report_and_exits_zero(
    bench_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "bench",
        "--checkpoint",
        str(bench_checkpoint),
        "--tp",
        "2",
        "--cache",
        "warm",
        "--repeat",
        "1",
        "--methods",
        "scratch",
        "safe_open_slice",
        "--out",
        str(tmp_path / "out"),
        "--workdir",
        str(tmp_path / "work"),
        "--no-startup",  # whole rayload.load timings: tests/benchmark/test_startup.py
        "--no-split-probe",  # its rows: tests/benchmark/test_harness.py (bench_result)
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| scratch | 2 |" in out and "| safe_open_slice | 2 |" in out
    assert "| limit | 1 |" in out  # the limit always runs: every ratio refers to it
    assert "cold page cache" not in out
    assert sorted(p.suffix for p in (tmp_path / "out").iterdir()) == [".json", ".md", ".png"]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--methods", "nope"], "unknown benchmark case(s) ['nope']"),
        (["--tp", "0"], "--tp needs sizes >= 1"),
    ],
)
def test_bench_cli_rejects_bad_arguments_with_exit_2(
    extra: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--checkpoint", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


def test_bench_cli_runs_the_expert_cases_side_by_side(
    moe_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "bench",
        "--checkpoint",
        str(moe_checkpoint),
        "--tp",
        "2",
        "--methods",
        "scratch",
        "scratch_ep",
        "whole_experts",
        "--cache",
        "cold",
        "--repeat",
        "1",
        "--no-startup",
        "--no-split-probe",
        "--out",
        str(tmp_path / "out"),
        "--workdir",
        str(tmp_path / "work"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for case, layout in (
        ("scratch", "tp"),
        ("scratch_ep", "ep"),
        ("whole_experts", "whole_experts"),
    ):
        assert f"| {case} | 2 |" in out and f"| {case} | {layout} | 2 | cold |" in out
    assert "| scratch_ep expert bytes per rank (plan, tp=2) | = all experts' / 2 |" in out
