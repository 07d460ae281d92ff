"""Would a rank gain by reading its shard while it imports torch? (issue 15, "overlap")

Each trial is a fresh interpreter that either imports torch and then reads a file of one
rank's shard size cold (``seq``), or starts the read in a thread and imports torch
meanwhile (``overlap``); pairs alternate their order. Prints one JSON object per trial
and the median ratio overlap / seq of the time to "torch imported and bytes in memory".

    python benchmarks/overlap_import_read.py [--mb 256] [--pairs 5]

A rank actor cannot do this today: Ray imports the actor's module (torch included)
before its constructor runs, so the read could only start in the constructor of an actor
whose module does not import torch, with the rank's read plan passed at spawn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_TRIAL = r"""
import json, os, sys, threading, time
mode, path = sys.argv[1], sys.argv[2]

def read_all():
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    buf = bytearray(size)
    view, off = memoryview(buf), 0
    while off < size:
        off += os.preadv(fd, [view[off : off + (32 << 20)]], off)
    os.close(fd)
    return buf

start = time.perf_counter()
if mode == "seq":
    import torch
    imported = time.perf_counter()
    read_all()
else:
    thread = threading.Thread(target=read_all)
    thread.start()
    import torch
    imported = time.perf_counter()
    thread.join()
done = time.perf_counter()
print(json.dumps({"mode": mode, "import_s": imported - start, "total_s": done - start}))
"""


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _trial(mode: str, path: Path) -> dict[str, float | str]:
    _drop_cache(path)
    out = subprocess.run(
        [sys.executable, "-c", _TRIAL, mode, str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="shard size in MiB (default 256)")
    parser.add_argument("--pairs", type=int, default=5, help="trial pairs (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.bin"
        with path.open("wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
        ratios = []
        for i in range(args.pairs):
            order = ("seq", "overlap") if i % 2 == 0 else ("overlap", "seq")
            trials = {mode: _trial(mode, path) for mode in order}
            for trial in trials.values():
                print(json.dumps(trial))
            ratios.append(float(trials["overlap"]["total_s"]) / float(trials["seq"]["total_s"]))
    print(
        json.dumps(
            {
                "mb": args.mb,
                "pairs": args.pairs,
                "ratios": [round(r, 3) for r in ratios],
                "median_overlap_over_seq": round(statistics.median(ratios), 3),
                "load_average": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
