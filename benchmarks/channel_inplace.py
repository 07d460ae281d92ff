"""One peer channel, with runs of tensors crossing in place against packed, interleaved.

    PYTHONPATH=src:tests python benchmarks/channel_inplace.py [--size-gb 1] [--rounds 6]

A synthetic Llama shard (``tiny-llama`` scaled to ``--size-gb``: thousands of tensors
under 256 KiB, as the pipeline benchmark's) crosses a real two-rank gloo channel on
loopback, the holder's :class:`~rayload.actors.peers.ShardServer` and the receiver in two
threads of one process. Cases:

* ``in_place``: both sides' tensors laid out by ``host_buffers`` (as a storage load's
  and a peer receiver's are), so each piece of several tensors is sent from and received
  into their own memory (``channel.span``);
* ``packed``: one ``torch.empty`` per tensor on both sides (as before), so each such
  piece is packed on the holder (``torch.cat``) and copied out of a bucket on the
  receiver.

Every round runs each case once in a fresh process (fresh memory on both sides, as a new
replica's is), the order alternating round by round. Prints each run's wall and process
CPU seconds of the receive, then the medians.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time

CASES = ("in_place", "packed")


def _one(case: str, size_gb: float) -> str:
    import torch

    from rayload.actors.peers import ShardServer, receive
    from rayload.loading.arrivals import Arrivals
    from rayload.loading.reader.sinks import host_buffers
    from rayload.loading.synthetic import preset_shape

    shape = preset_shape("tiny-llama", size_gb=size_gb)
    sizes = [math.prod(dims) * 2 for _, dims in shape.tensors()]
    names = [f"t{i}" for i in range(len(sizes))]

    def layout() -> list[torch.Tensor]:
        if case == "in_place":
            return host_buffers(sizes)
        return [torch.empty(n, dtype=torch.uint8) for n in sizes]

    held = dict(zip(names, layout(), strict=True))
    for k, buffer in enumerate(held.values()):
        buffer.fill_(k % 251)
    server = ShardServer()
    server.loaded(held)
    into = dict(zip(names, layout(), strict=True))
    arrivals = Arrivals(list(into), list(into.values()))
    channel = server.open("127.0.0.1", 0.0, dict(zip(names, sizes, strict=True)))
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in receive(channel, "127.0.0.1", into, arrivals.landed_name):
        pass
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    for k in range(0, len(names), 97):
        assert bool((into[names[k]] == k % 251).all()), names[k]
    return f"{case} {wall:.4f} {cpu:.4f} {len(sizes)} {sum(sizes)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--one", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(_one(args.one, args.size_gb), flush=True)
        return
    runs: dict[str, list[tuple[float, float]]] = {case: [] for case in CASES}
    for rnd in range(args.rounds):
        for case in CASES if rnd % 2 == 0 else CASES[::-1]:
            out = subprocess.run(
                [sys.executable, __file__, "--one", case, "--size-gb", str(args.size_gb)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()
            runs[case].append((float(out[1]), float(out[2])))
            print(
                f"round {rnd} {case:8s} wall {out[1]} s  cpu {out[2]} s  "
                f"({out[3]} tensors, {int(out[4]) / 1e9:.2f} GB)",
                flush=True,
            )
    for case, xs in runs.items():
        walls, cpus = [w for w, _ in xs], [c for _, c in xs]
        print(
            f"{case}: median wall {statistics.median(walls):.3f} s "
            f"({min(walls):.3f}-{max(walls):.3f}), cpu {statistics.median(cpus):.3f} s "
            f"({min(cpus):.3f}-{max(cpus):.3f})"
        )
    ratio = statistics.median(w for w, _ in runs["packed"]) / statistics.median(
        w for w, _ in runs["in_place"]
    )
    print(f"packed / in_place (median wall): {ratio:.2f}x")


if __name__ == "__main__":
    main()
