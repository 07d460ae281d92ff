"""Run the benchmark and keep its results in the repository: ``benchmarks/results/``.

    python benchmarks/run.py                      # 1 GB, TP 1 2 4, cold and warm, 3 repeats
    python benchmarks/run.py --quick              # smoke-level: 0.25 GB tiny-llama, 1 repeat
    python benchmarks/run.py --tp 4 --repeat 5    # any `rayload bench` argument

The same as ``rayload bench --out benchmarks/results ...``; see docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rayload.cli import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main(["bench", "--out", str(RESULTS), *sys.argv[1:]]))
