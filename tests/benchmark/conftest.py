"""A tiny generated checkpoint and one benchmark run over it, shared by the benchmark tests.

The run is session-scoped: one harness run (every case this machine
can run, TP 2, cold and warm, 2 repetitions) costs seconds of forking, so every test that
only reads its result shares it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rayload.benchmark import BenchConfig, run_benchmark
from rayload.loading.synthetic import write_checkpoint


@pytest.fixture(scope="session")
def bench_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("bench") / "ckpt", preset="tiny-llama")


@pytest.fixture(scope="session")
def bench_config(bench_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> BenchConfig:
    return BenchConfig(
        checkpoint=str(bench_checkpoint),
        workdir=str(tmp_path_factory.mktemp("bench-work")),
        tp_sizes=(2,),
        repeat=2,
        startup=False,  # whole rayload.load calls: tests/benchmark/test_startup.py
    )


@pytest.fixture(scope="session")
def bench_result(bench_config: BenchConfig) -> dict[str, Any]:
    return run_benchmark(bench_config, progress=lambda line: None)
