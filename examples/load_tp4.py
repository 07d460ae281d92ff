"""Load a generated tiny Llama with TP=4 on a local Ray and look at what each rank holds.

    python examples/load_tp4.py                 # CPU
    python examples/load_tp4.py --device auto   # the GPUs, where the cluster has 4

Runs top to bottom in well under a minute; uses only the public API.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import rayload
from rayload.loading import write_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--trace-dir", default="rayload-example-traces")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "tiny-llama", preset="tiny-llama")
        with rayload.load(path, tp_size=4, device=args.device, trace_dir=args.trace_dir) as result:
            for report in result.ranks:
                print(
                    f"rank {report.rank}: {report.tensors} tensors, {report.bytes_read} bytes, "
                    f"{report.method.effective} on {report.device} ({report.seconds:.3f} s)"
                )
            name = "model.layers.0.self_attn.q_proj.weight"
            print(f"{name} is split on dim {result.plan.split_dim(name)}:")
            for rank in range(result.tp_size):
                print(f"  rank {rank} holds {tuple(result.shard(rank, name).shape)}")
            total = result.startup_metrics["aggregate"]["total_model_loading_seconds"]
            print(f"slowest rank took {total['max']:.3f} s; trace {result.trace_id}")
            print(f"trace files: {result.trace_files['html']} (and .json formats next to it)")


if __name__ == "__main__":
    main()
