"""Tiny generated checkpoints and one benchmark run over each, shared by the benchmark tests.

The runs are session-scoped: one harness run costs seconds of forking, so every test that
only reads its result shares it. ``bench_result``: every case this machine can run on a
tiny Llama, TP 2, cold and warm, 2 repetitions. ``moe_result``: plain TP, expert parallel
and every expert whole (and safe_open for the TP layout) on a tiny Mixtral, TP 4, cold
and warm, 1 repetition.
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


MOE_METHODS = ("scratch", "scratch_ep", "whole_experts", "safe_open_slice")


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("bench-moe") / "ckpt", preset="tiny-mixtral")


@pytest.fixture(scope="session")
def moe_config(moe_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> BenchConfig:
    return BenchConfig(
        checkpoint=str(moe_checkpoint),
        workdir=str(tmp_path_factory.mktemp("bench-moe-work")),
        tp_sizes=(4,),
        repeat=1,
        methods=MOE_METHODS,
        startup=False,
        split_probe=False,
    )


@pytest.fixture(scope="session")
def moe_result(moe_config: BenchConfig) -> dict[str, Any]:
    return run_benchmark(moe_config, progress=lambda line: None)
