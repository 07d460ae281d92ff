"""Replicas started together, from one object store: pipelined peers against today's
peers and no peers, side by side in one run (issue #31).

    PYTHONPATH=src:tests python benchmarks/pipeline.py [--size-gb 1] [--counts 1 2 4 8]
        [--rounds 2] [--store-mbps 100] [--link-mbps 200] [--cases ...] [--warmup 1]
        [--out benchmarks/results/NAME]

The store is moto on 127.0.0.1 behind the tests' counting proxy (tests/support/s3.py),
which sends bodies at ``--store-mbps`` for all connections together, as one link to a
remote store would. Each peer channel is paced to ``--link-mbps`` (the
``peer_link_mbps`` test hook), as one network link between two machines would be. Both
limits emulate a cluster's network on one host: the figures are labelled so.

Cases, for each replica count ``n`` (TP=1, ``n`` replicas in one ``rayload.load``):

* ``pipelined``: the default (``peer_fanout=2``): replicas still loading forward each
  piece as it lands;
* ``today``: ``peer_fanout=0``, the replicas receive once their holder has loaded;
* ``no-peers``: ``method="scratch"``, every replica reads the store;
* ``no-prefault`` (only with ``--cases``): ``pipelined`` with no rank faulting in memory
  ahead of its writes (the ``prefault`` test hook: the receivers' prefault and the
  storage reader's alike);
* ``packed`` (only with ``--cases``): ``pipelined`` with each piece of several tensors
  packed into a buffer of its own on both sides of a channel (the ``peer_pack`` test
  hook), as before such runs crossed from and into the tensors' own memory.

Interleaved: each round runs every (count, case) once, the cases alternating within a
count, after ``--warmup`` unrecorded loads (default 1) of the largest count: this VM backs
its memory lazily, so the first touch of a page costs far more than later ones and the
first rounds would be slower whatever ran in them. Per load: the wall time of
``rayload.load`` (the rank actors' start-up included), the weights' time (first rank's
``rank.load`` start to the last one's end, from the reports) and the bytes the server
sent. From the written trace, each replica's
``rank.peer_pieces`` (from whom, first and last piece) feeds the model of the pipeline
(docs/benchmarks.md): the time one more level of the tree adds.

Writes ``OUT.json`` (every sample), ``OUT.md`` (the table) and ``OUT.png`` (time to the
last replica against the replica count, per case).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = {
    "pipelined": {"peer_fanout": 2},
    "today": {"peer_fanout": 0},
    "no-peers": {"method": "scratch"},
    "no-prefault": {"peer_fanout": 2},
    "packed": {"peer_fanout": 2},
}
DEFAULT_CASES = ["pipelined", "today", "no-peers"]
HOOKS = {"no-prefault": {"prefault": False}, "packed": {"peer_pack": True}}
"""Test hooks a case adds to the link's (``no-prefault``: pipelined, no rank faulting in
its new memory ahead of the bytes; ``packed``: pipelined, every piece of several tensors
packed into a buffer of its own and copied out, as before runs of tensors crossed in
place; run them with ``--cases``)."""


def _pieces(trace_dir: Path) -> tuple[list[dict[str, Any]], int | None]:
    """Each ``rank.peer_pieces`` span of the trace (replica, source, first and last piece
    in ns, pieces, bytes), and when the first ``rank.read`` of a replica that received
    nothing from a peer began (ns): the store's first bytes come right after."""
    data = json.loads((trace_dir / "trace.otlp.json").read_text())
    out, reads = [], []
    for resource_spans in data["resourceSpans"]:
        resource = {
            a["key"]: next(iter(a["value"].values()))
            for a in resource_spans.get("resource", {}).get("attributes", [])
        }
        replica = int(resource.get("rayload.replica", 0))
        for scope in resource_spans["scopeSpans"]:
            for span in scope["spans"]:
                if span["name"] == "rank.read":
                    reads.append((replica, int(span["startTimeUnixNano"])))
                if span["name"] != "rank.peer_pieces":
                    continue
                attrs = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                out.append(
                    {
                        "replica": replica,
                        "source": attrs["rayload.source"],
                        "start_ns": int(span["startTimeUnixNano"]),
                        "end_ns": int(span["endTimeUnixNano"]),
                        "pieces": int(attrs["rayload.pieces"]),
                        "bytes": int(attrs["rayload.bytes"]),
                    }
                )
    for p in out:
        p["read_ns"] = min(ns for replica, ns in reads if replica == p["replica"])
    receivers = {p["replica"] for p in out}
    store = [ns for replica, ns in reads if replica not in receivers]
    return out, min(store) if store else None


def _load(
    url: str, n: int, case: str, proxy: Any, trace_dir: Path, link_mbps: float
) -> dict[str, Any]:
    import rayload

    hooks = {"peer_link_mbps": link_mbps, **HOOKS.get(case, {})}
    os.environ["RAYLOAD_TEST_HOOKS"] = json.dumps(hooks)
    prefix = url.removeprefix("s3://") + "/"
    proxy.clear()
    started = time.perf_counter()
    with rayload.load(
        url, 1, device="cpu", replicas=n, timeout=900, trace_dir=trace_dir, **CASES[case]
    ) as result:
        wall = time.perf_counter() - started
        ranks = result.ranks
        ids = list(result.replica_ids)
    served = proxy.served_bytes(prefix)
    pieces, store_read_ns = _pieces(trace_dir) if n > 1 and case != "no-peers" else ([], None)
    bodies = [
        r.sent_ns
        for r in proxy.requests(prefix)
        if r.method == "GET" and r.body_bytes and store_read_ns and r.sent_ns >= store_read_ns
    ]
    return {
        "n": n,
        "case": case,
        "wall_s": wall,
        "weights_s": (max(r.end_ns for r in ranks) - min(r.start_ns for r in ranks)) / 1e9,
        "replica_s": [r.seconds for r in ranks],
        "served": served,
        "from_peers": [r.bytes_from_peers for r in ranks],
        "fallbacks": [r.method.fallback_reason for r in ranks if r.method.fallback_reason],
        "replica_ids": ids,
        "pieces": pieces,
        "store_read_ns": store_read_ns,
        "store_first_body_ns": min(bodies) if bodies else None,
        "first_rank_start_ns": min(r.start_ns for r in ranks),
    }


def _depths(ids: list[str], pieces: list[dict[str, Any]]) -> dict[int, int]:
    """Each replica's level in the tree its sources make (0: reads storage)."""
    parent = {
        p["replica"]: ids.index(p["source"].split()[1].removeprefix("replica="))
        for p in pieces
        if p["source"].startswith("peer ")
    }
    depth: dict[int, int] = {}
    for replica in range(len(ids)):
        d, r = 0, replica
        while r in parent:
            d, r = d + 1, parent[r]
        depth[replica] = d
    return depth


def _model(rows: list[dict[str, Any]], fanout: int) -> dict[str, Any]:
    """The pipeline's model, fitted to the pipelined loads: the last replica's weights
    time = one replica's alone (``alone``) + ``tail`` (how long after its own source
    the first level has its last piece: a pair of replicas) + ``hop`` per further level
    (how much later a level's first piece comes than its parent's, within one load)."""
    alone = statistics.median([r["weights_s"] for r in rows if r["n"] == 1] or [float("nan")])
    hops, tails = [], []
    for r in rows:
        if r["n"] < 2:
            continue
        depth = _depths(r["replica_ids"], r["pieces"])
        first: dict[int, float] = {}
        for p in r["pieces"]:
            d, at = depth[p["replica"]], (p["start_ns"] - r["first_rank_start_ns"]) / 1e9
            first[d] = min(first.get(d, at), at)
            if r["n"] == 2:
                tails.append((p["end_ns"] - r["first_rank_start_ns"]) / 1e9 - alone)
        hops += [first[d + 1] - first[d] for d in sorted(first) if d + 1 in first]
    return {
        "alone_s": alone,
        "tail_s": statistics.median(tails) if tails else 0.0,
        "hop_s": statistics.median(hops) if hops else 0.0,
        "fanout": fanout,
    }


def depth_of(n: int, fanout: int) -> int:
    """The deepest level of a tree of ``n`` replicas of fan-out ``fanout`` (the order in
    which rayload's ``choose_sources`` places them: replica i's parent is (i-1)//fanout)."""
    deepest = 0
    for i in range(1, n):
        d, r = 0, i
        while r:
            d, r = d + 1, (r - 1) // fanout
        deepest = max(deepest, d)
    return deepest


def predict(model: dict[str, Any], n: int, fanout: int) -> float:
    """The model's time to the last of ``n`` replicas in a tree of fan-out ``fanout``,
    each with a CPU and a link of its own (what a cluster has and this host has not)."""
    depth = depth_of(n, fanout)
    if depth == 0:
        return float(model["alone_s"])
    return float(model["alone_s"] + model["tail_s"] + (depth - 1) * model["hop_s"])


def _table(
    rows: list[dict[str, Any]],
    model: dict[str, Any],
    counts: list[int],
    size: int,
    label: str,
    rounds: int,
    store_mbps: float,
) -> list[str]:
    """The result's markdown: measured medians, every round, the model against them and
    its predictions."""
    alone = model["alone_s"]
    lines = [f"Checkpoint {label}; {rounds} rounds, interleaved.", ""]
    lines += [
        "| replicas | pipelined | today's peers | no peers | pipelined / one alone "
        "| model | served (pipelined) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in counts:

        def med(case: str, key: str = "weights_s", n: int = n) -> float:
            values = [r[key] for r in rows if r["n"] == n and r["case"] == case]
            return statistics.median(values) if values else float("nan")

        served = max(r["served"] for r in rows if r["n"] == n and r["case"] == "pipelined")
        lines.append(
            f"| {n} | {med('pipelined'):.2f} s (wall {med('pipelined', 'wall_s'):.2f}) | "
            f"{_seconds(med('today'))} | {_seconds(med('no-peers'))} | "
            f"**{med('pipelined') / alone:.2f}x** | {predict(model, n, 2):.2f} s | "
            f"{served / size:.3f}x |"
        )
    lines += [
        "",
        "Rounds (weights s): "
        + "; ".join(f"n={r['n']} {r['case']} {r['weights_s']:.2f}" for r in rows),
        *_paired_lines(rows, "no-prefault"),
        *_paired_lines(rows, "packed"),
        *_first_piece_lines(rows, store_mbps),
        "",
        f"Model (fitted): one replica alone {model['alone_s']:.2f} s; the first level's last "
        f"piece {model['tail_s']:.2f} s after that; each further level {model['hop_s']:.3f} s",
        "",
        "| replicas | depth (fan-out 2) | predicted, fan-out 2 | depth (chain) "
        "| predicted, chain |",
        "|---|---|---|---|---|",
    ]
    for n in sorted({*counts, 100, 1000}):
        lines.append(
            f"| {n} | {depth_of(n, 2)} | {predict(model, n, 2):.2f} s | {depth_of(n, 1)} | "
            f"{predict(model, n, 1):.2f} s |"
        )
    return lines


def _seconds(value: float) -> str:
    """``value`` s, or a dash for a case that did not run at that count."""
    return "-" if value != value else f"{value:.2f} s"


def _first_piece_lines(rows: list[dict[str, Any]], store_mbps: float) -> list[str]:
    """When the receivers of the pipelined loads had their first piece (the latest
    receiver; per count, each round): after the store's read began; after the store sent
    that read's first body bytes; after those bytes or the receiver's own read began,
    whichever was later. Beside it, one full piece's time at the store's rate."""
    each = []
    for n in sorted({r["n"] for r in rows}):
        late = []
        for r in rows:
            if r["n"] != n or r["case"] != "pipelined" or not r["pieces"] or not r["store_read_ns"]:
                continue
            body = r.get("store_first_body_ns") or r["store_read_ns"]
            after = [
                max(p["start_ns"] - since(p) for p in r["pieces"]) / 1e9
                for since in (
                    lambda p, r=r: r["store_read_ns"],
                    lambda p, b=body: b,
                    lambda p, b=body: max(b, p.get("read_ns", 0)),
                )
            ]
            late.append(" / ".join(f"{s:.2f}" for s in after))
        if late:
            each.append(f"n={n} " + "; ".join(late) + " s")
    if not each:
        return []
    from rayload.actors.channel import BUCKET_BYTES

    return [
        "",
        "Every receiver's first piece (the latest receiver, each round), after the store's "
        "read began / after the store's first body bytes of that read / after those bytes "
        f"or the receiver's own read began, whichever came later: {', '.join(each)}; one "
        f"{BUCKET_BYTES >> 20} MiB piece at the store's rate takes "
        f"{BUCKET_BYTES / (store_mbps * 1e6):.3f} s",
    ]


def _paired_lines(rows: list[dict[str, Any]], case: str) -> list[str]:
    """``case`` against ``pipelined``, the two loads of each round and count side by side
    (their ratio; the median of those), when the run had that case."""
    pairs = []
    for r in rows:
        if r["case"] != case:
            continue
        [p] = [
            q for q in rows if (q["n"], q["round"], q["case"]) == (r["n"], r["round"], "pipelined")
        ]
        pairs.append((r["n"], r["round"], p["weights_s"], r["weights_s"]))
    if not pairs:
        return []
    each = "; ".join(f"n={n} round {k}: {a:.2f} vs {b:.2f} s" for n, k, a, b in pairs)
    ratio = statistics.median(b / a for _, _, a, b in pairs)
    return [
        "",
        f"pipelined vs {case}, same round: {each}; median {case} / pipelined {ratio:.3f}x",
    ]


def _plot(rows: list[dict[str, Any]], path: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    counts = sorted({r["n"] for r in rows})
    for case in CASES:
        xs = [n for n in counts if any(r["n"] == n and r["case"] == case for r in rows)]
        if not xs:  # a case this run did not have
            continue
        ys = [
            statistics.median(r["weights_s"] for r in rows if r["n"] == n and r["case"] == case)
            for n in xs
        ]
        ax.plot(xs, ys, marker="o", label=case)
    ax.set_xlabel("replicas started together (TP=1)")
    ax.set_ylabel("time to the last replica's weights (s, median)")
    ax.set_title(label, fontsize=9)
    ax.set_xticks(counts)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--store-mbps", type=float, default=100.0)
    parser.add_argument("--link-mbps", type=float, default=200.0)
    parser.add_argument(
        "--cases", nargs="+", choices=list(CASES), default=DEFAULT_CASES, help="cases to run"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unrecorded pipelined loads of the largest count first (this VM backs its "
        "memory lazily: a page's first touch costs far more than later ones)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--from-json", type=Path, default=None, help="render a run's OUT.json again, no loads"
    )
    args = parser.parse_args()
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
        rows, out = data["rows"], args.from_json.with_suffix("")
        counts = sorted({r["n"] for r in rows})
        rounds = 1 + max(r["round"] for r in rows)
        model = _model([r for r in rows if r["case"] == "pipelined"], 2)
        table = _table(
            rows, model, counts, data["size"], data["label"], rounds, data.get("store_mbps", 100.0)
        )
        text = "\n".join(table)
        print(text)
        data["model"] = model
        out.with_suffix(".json").write_text(json.dumps(data, indent=1))
        out.with_suffix(".md").write_text(text + "\n")
        _plot(rows, out.with_suffix(".png"), data["label"])
        return

    import ray

    from rayload.loading import open_checkpoint, write_checkpoint
    from support.s3 import s3_server

    s3 = s3_server()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(
            Path(tmp) / "ckpt", size_gb=args.size_gb, num_files=max(2, round(args.size_gb * 48))
        )
        size = open_checkpoint(path).tensor_bytes
        url = s3.upload(path, "bench", "pipeline")
    s3.proxy.rate = args.store_mbps * 1e6
    label = (
        f"{size / 1e6:.0f} MB, store {args.store_mbps:g} MB/s, each peer link "
        f"{args.link_mbps:g} MB/s (emulated on one host)"
    )
    print(f"checkpoint: {label}", flush=True)
    out = args.out or Path("benchmarks/results") / f"pipeline-{time.strftime('%Y-%m-%dT%H%M%S')}"
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as traces:
            for k in range(args.warmup):
                row = _load(
                    url,
                    max(args.counts),
                    "pipelined",
                    s3.proxy,
                    Path(traces) / f"warmup-{k}",
                    args.link_mbps,
                )
                print(f"warm-up n={row['n']} weights {row['weights_s']:6.2f} s", flush=True)
            for rnd in range(args.rounds):
                for n in args.counts:
                    cases = ["pipelined"] if n == 1 else list(args.cases)
                    if rnd % 2:
                        cases.reverse()
                    for case in cases:
                        row = _load(
                            url,
                            n,
                            case,
                            s3.proxy,
                            Path(traces) / f"{rnd}-{n}-{case}",
                            args.link_mbps,
                        )
                        row["round"] = rnd
                        rows.append(row)
                        print(
                            f"round {rnd} n={n} {case:9s} weights {row['weights_s']:6.2f} s  "
                            f"wall {row['wall_s']:6.2f} s  served {row['served'] / size:.3f}x"
                            + (f"  fallbacks {len(row['fallbacks'])}" if row["fallbacks"] else ""),
                            flush=True,
                        )
    finally:
        ray.shutdown()
    model = _model([r for r in rows if r["case"] == "pipelined"], CASES["pipelined"]["peer_fanout"])
    lines = _table(rows, model, args.counts, size, label, args.rounds, args.store_mbps)
    text = "\n".join(lines)
    print("\n" + text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "label": label,
                "size": size,
                "store_mbps": args.store_mbps,
                "rows": rows,
                "model": model,
            },
            indent=1,
        )
    )
    out.with_suffix(".md").write_text(text + "\n")
    _plot(rows, out.with_suffix(".png"), label)
    print(f"wrote {out}.json, .md, .png")


if __name__ == "__main__":
    sys.exit(main())
