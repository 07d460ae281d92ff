"""A ``ray job submit`` entrypoint: load a checkpoint with rayload inside a Ray job and print
the result as one JSON line.

On one machine, from the repository root (the same RAY_AUTH_MODE for both commands: Ray
2.59+ turns token authentication on by default for local clusters; with it on, both
commands must see the same token, e.g. ~/.ray/auth_token)::

    RAY_AUTH_MODE=disabled ray start --head --port 6390 --dashboard-port 8265 --num-cpus 2
    RAY_AUTH_MODE=disabled ray job submit --address http://127.0.0.1:8265 \\
        --working-dir examples -- python job_submit.py --tp 2
    ray stop   # stops every Ray on this machine

Inside the job ``rayload.load`` joins the job's cluster (``RAY_ADDRESS`` is set by Ray).
Without ``--checkpoint`` the job writes a tiny generated Llama to a temp dir on the node
that runs the job's driver: fine on one node; on several nodes pass a path every node can
read (shared storage).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import rayload
from rayload.loading import write_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="checkpoint directory (default: generate one)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or write_checkpoint(Path(tmp) / "tiny-llama")
        with rayload.load(path, tp_size=args.tp, device=args.device) as result:
            summary = {
                "trace_id": result.trace_id,
                "tp_size": result.tp_size,
                "ranks": [report.to_dict() for report in result.ranks],
                "startup_metrics": result.startup_metrics,
            }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
