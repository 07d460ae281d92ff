"""A rank reports when its worker process was created, to 10 ms, on the wall clock."""

from __future__ import annotations

import subprocess
import sys
import time

from rayload.actors.rank_actor import process_start_ns

TICK_NS = 20_000_000


def test_process_start_is_when_a_new_process_was_created() -> None:
    before = time.time_ns()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from rayload.actors.rank_actor import process_start_ns; print(process_start_ns())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    after = time.time_ns()
    assert before - TICK_NS <= int(out.stdout) <= after


def test_process_start_of_this_process_is_in_the_past() -> None:
    start = process_start_ns()
    assert start is not None and start < time.time_ns()
