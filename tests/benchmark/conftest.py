"""Tiny generated checkpoints, and one benchmark run over each, shared by the benchmark
tests.

``bench_result`` / ``moe_result`` (with their ``bench_config`` / ``moe_config``) are
background runs (tests/conftest.py) of bench_script.py: a harness run costs about a minute
of forking rank processes, so it runs in a process of its own beside the rest of the
suite, and every test that reads its result shares it. ``bench_result``: every case this
machine can run on a tiny Llama, TP 2, cold and warm, 2 repetitions. ``moe_result``: plain
TP, expert parallel and every expert whole (and safe_open for the TP layout) on a tiny
Mixtral, TP 4, cold and warm, 1 repetition.

``bench_checkpoint`` / ``moe_checkpoint``: the same presets written here, for the tests
that run the CLI or read a layout themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rayload.benchmark import BenchConfig
from rayload.loading.synthetic import write_checkpoint
from support.background import BackgroundRuns


def _finished(background_runs: BackgroundRuns, name: str) -> Path:
    done = background_runs.result(name)
    assert done.run.returncode == 0, done.run.stderr[-4000:]
    return done.workdir


def _config(workdir: Path) -> BenchConfig:
    fields = json.loads((workdir / "config.json").read_text())
    return BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


@pytest.fixture(scope="session")
def bench_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("bench") / "ckpt", preset="tiny-llama")


@pytest.fixture(scope="session")
def bench_result(background_runs: BackgroundRuns) -> dict[str, Any]:
    workdir = _finished(background_runs, "bench_result")
    return dict(json.loads((workdir / "result.json").read_text()))


@pytest.fixture(scope="session")
def bench_config(background_runs: BackgroundRuns, bench_result: dict[str, Any]) -> BenchConfig:
    return _config(_finished(background_runs, "bench_result"))


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("bench-moe") / "ckpt", preset="tiny-mixtral")


@pytest.fixture(scope="session")
def moe_result(background_runs: BackgroundRuns) -> dict[str, Any]:
    workdir = _finished(background_runs, "moe_result")
    return dict(json.loads((workdir / "result.json").read_text()))


@pytest.fixture(scope="session")
def moe_config(background_runs: BackgroundRuns, moe_result: dict[str, Any]) -> BenchConfig:
    return _config(_finished(background_runs, "moe_result"))
