"""Run by the ``bench_result`` and ``moe_result`` background runs (tests/conftest.py): one
benchmark harness run over a tiny checkpoint written here, in a process of its own so its
minute overlaps the rest of the suite. Writes ``config.json`` (the :class:`BenchConfig`)
and ``result.json`` (what :func:`run_benchmark` returned) into WORKDIR.

``llama``: every case this machine can run on a tiny Llama, TP 2, cold and warm, 2
repetitions. ``moe``: plain TP, expert parallel and every expert whole (and safe_open for
the TP layout) on a tiny Mixtral, TP 4, cold and warm, 1 repetition.

Usage: ``python bench_script.py WORKDIR {llama,moe}``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rayload.benchmark import BenchConfig, run_benchmark
from rayload.loading.synthetic import write_checkpoint

MOE_METHODS = ("scratch", "scratch_ep", "whole_experts", "safe_open_slice")


def bench_config(name: str, workdir: Path) -> BenchConfig:
    (workdir / "work").mkdir()
    if name == "llama":
        return BenchConfig(
            checkpoint=str(write_checkpoint(workdir / "ckpt", preset="tiny-llama")),
            workdir=str(workdir / "work"),
            tp_sizes=(2,),
            repeat=2,
            startup=False,  # whole rayload.load calls: tests/benchmark/test_startup.py
        )
    return BenchConfig(
        checkpoint=str(write_checkpoint(workdir / "ckpt", preset="tiny-mixtral")),
        workdir=str(workdir / "work"),
        tp_sizes=(4,),
        repeat=1,
        methods=MOE_METHODS,
        startup=False,
        split_probe=False,
    )


def main() -> None:
    workdir, name = Path(sys.argv[1]), sys.argv[2]
    config = bench_config(name, workdir)
    (workdir / "config.json").write_text(json.dumps(config.to_dict()))
    result = run_benchmark(config, progress=lambda line: None)
    (workdir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
