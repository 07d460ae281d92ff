"""A ``ray job submit`` entrypoint: load a TP model with rayload inside a Ray job, run one
forward pass over its ranks and print the result as one JSON line.

On one machine, from the repository root (the same RAY_AUTH_MODE for both commands: Ray
2.59+ turns token authentication on by default for local clusters; with it on, both
commands must see the same token, e.g. ~/.ray/auth_token)::

    RAY_AUTH_MODE=disabled ray start --head --port 6390 --dashboard-port 8265 --num-cpus 2
    RAY_AUTH_MODE=disabled ray job submit --address http://127.0.0.1:8265 \\
        --working-dir examples -- python job_submit.py --tp 2 --token-ids 1 2 3 4 5
    ray stop   # stops every Ray on this machine

Inside the job ``rayload.load`` joins the job's cluster (``RAY_ADDRESS`` is set by Ray) and
gives every rank its part of rayload's reference TP model (``model=build_model``, one
``torch.distributed`` group over the ranks); the line holds the load's trace id, ranks and
metrics, and ``top5``: the ids of the 5 highest next-token logits after ``--token-ids``.
``--config FILE`` reads the load's options from a YAML or JSON file of
:class:`rayload.LoadConfig` fields (``rayload config`` lists them); the flags given replace
its values. ``--replicas N`` loads N copies of the TP group: replica 0 reads storage, the others
receive its shards through Ray's object store (their ranks' ``source`` says from whom);
every replica runs the forward, ``top5`` is replica 0's.
Without ``--checkpoint`` the job writes a tiny generated Llama (float32) to a temp dir on
the node that runs the job's driver: fine on one node; on several nodes pass a path every
node can read (shared storage), or ``--checkpoint s3://bucket/prefix``: each rank then
fetches its own byte ranges, with the endpoint and credentials of its node's standard AWS
environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...; set where ``ray start`` runs),
never passed through the job or Ray.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import rayload
from rayload.config import config_from_file, read_config_file
from rayload.loading import write_checkpoint
from rayload.models import build_model

if TYPE_CHECKING:
    from rayload.api import RankState


def next_token_top5(state: RankState, token_ids: list[int]) -> list[int]:
    """On one rank, run with every other rank: the ids of the 5 highest next-token logits."""
    with torch.inference_mode():
        logits = state.model(torch.tensor([token_ids], device=state.device))
    return logits[0, -1].topk(5).indices.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML or JSON file of rayload.LoadConfig fields")
    parser.add_argument(
        "--checkpoint", help="checkpoint directory or s3://bucket/prefix (default: generate one)"
    )
    parser.add_argument("--tp", type=int, help="TP size (default: 2)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="(default: cpu)")
    parser.add_argument("--replicas", type=int, help="copies of the TP group (default: 1)")
    parser.add_argument(
        "--token-ids",
        type=int,
        nargs="+",
        default=[1, 2, 3, 4, 5],
        help="the prompt whose next token the model predicts (default: 1 2 3 4 5)",
    )
    args = parser.parse_args()
    flags = {"path": args.checkpoint, "tp_size": args.tp, "device": args.device}
    flags["replicas"] = args.replicas
    given = {name: value for name, value in flags.items() if value is not None}
    options = read_config_file(args.config) if args.config else {}
    defaults = {k: v for k, v in {"tp_size": 2, "device": "cpu"}.items() if k not in options}

    with tempfile.TemporaryDirectory() as tmp:
        if "path" not in {**options, **given}:
            given["path"] = str(write_checkpoint(Path(tmp) / "tiny-llama", dtype="f32"))
        try:
            if args.config:
                config = config_from_file(args.config, {**defaults, **given})
            else:
                config = rayload.LoadConfig.validated({**defaults, **given})
        except rayload.RayloadError as exc:
            sys.exit(f"job_submit.py: error: {exc}")
        with rayload.load(config, model=build_model) as result:
            top5 = result.apply(next_token_top5, args.token_ids)[0]
            summary = {
                "trace_id": result.trace_id,
                "tp_size": result.tp_size,
                "replica_ids": result.replica_ids,
                "ranks": [report.to_dict() for report in result.ranks],
                "startup_metrics": result.startup_metrics,
                "top5": top5,
            }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
