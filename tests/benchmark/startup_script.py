"""Run by the ``startup_result`` background run (tests/conftest.py): the start-up
benchmark's quick mode (TP 2, one repetition of each measurement, floor included) on a
tiny Llama written here, through ``measure_startup`` (which runs it in a child interpreter
of its own). Prints the result as one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rayload.benchmark.startup import measure_startup
from rayload.loading.synthetic import write_checkpoint


def main() -> None:
    checkpoint = write_checkpoint(Path(sys.argv[1]) / "ckpt", preset="tiny-llama")
    print(json.dumps(measure_startup(str(checkpoint), 2, repeat=1)))


if __name__ == "__main__":
    main()
