"""``rayload bench --replicas 1 2 4``: peer loading on a cluster of several nodes.

On one ``ray.cluster_utils.Cluster`` (:mod:`rayload.benchmark.peer_cluster`: a CPU-less
head and one worker node per replica, each with its own object store), in one run:

* **together**: for each replica count ``n``, ``rayload.load(ckpt, tp, device="cpu",
  replicas=n)``, page cache dropped before; then ``n`` = the largest count again with
  ``method="scratch"`` (every replica reads storage: what loading without peers costs).
  Each records the bytes its ranks read (the sum of every ``rank.load``'s
  ``rayload.io.rchar`` in the written trace, not the plan's figures), the bytes received
  from peers, the weight population (the ``rayload.peers`` span's end, when the driver
  dispatches the loads, to the last ``rank.load``'s end) and the whole ``rayload.load``
  wall time, which includes spawning every rank actor: CPU work no loader avoids, and on
  a 2-core machine 8 actors' worth of it.
* **strided**: the same with 1 and the largest count on a tiny-llama-shaped checkpoint,
  whose closely strided split-1 rows the reader reads as whole runs: one replica reads
  more than its shards; the cluster should read what one replica reads.
* **pair**: a holder replica loaded on node 0; a new replica on node 0 (same node:
  loopback) and one on node 1 (cross-node: over the nodes' addresses), each
  receiving from it; then, with the holder closed, the same new replica on node 1 cold
  from storage.
* **rates**: what the parts can do in this run: the peer channel (a two-rank gloo group)
  between two nodes and within one, and one sequential cold read of the checkpoint.

:func:`run_peer_benchmark` runs all of it in a child interpreter (one ``ray.init`` per
process) and returns the JSON-able result; :func:`write_peer_report` writes it as
``bench-<time>.json`` and ``.md`` (:mod:`rayload.benchmark.peer_report`).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rayload.errors import ConfigError

_QUICK: dict[str, Any] = {"size_gb": 0.11, "strided": False}
"""What ``--quick`` changes: a ~110 MB checkpoint (one layer of the exact-read shape)
and no strided-shape loads."""


@dataclass(frozen=True)
class PeerBenchConfig:
    """One peer benchmark run.

    ``replicas``: the counts loaded together (each its own cold load); ``tp``: ranks per
    replica; ``size_gb``: the exact-read checkpoint's size; ``nodes``: worker nodes (at
    least the largest count, at least 2 for the pair); ``strided``: also the tiny-llama
    shape; ``pair``: the new-replica-from-peer vs cold-from-storage measurement.
    """

    replicas: tuple[int, ...] = (1, 2, 4)
    tp: int = 2
    size_gb: float = 0.256
    nodes: int | None = None
    strided: bool = True
    pair: bool = True
    workdir: str = "/tmp/rayload-bench"
    object_store_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not self.replicas or min(self.replicas) < 1:
            raise ConfigError(f"--replicas needs counts >= 1, got {list(self.replicas)}")
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp}")
        if self.size_gb <= 0:
            raise ConfigError(f"size_gb must be positive, got {self.size_gb}")
        if self.nodes is not None and self.nodes < max(2, *self.replicas):
            raise ConfigError(
                f"nodes must be at least {max(2, *self.replicas)} (one per replica, 2 for "
                f"the pair), got {self.nodes}"
            )

    @property
    def worker_nodes(self) -> int:
        return self.nodes or max(2, *self.replicas)

    @classmethod
    def quick(cls, **chosen: Any) -> PeerBenchConfig:
        """The quick mode (explicit options still win)."""
        return cls(**{**_QUICK, **chosen})


def run_peer_benchmark(
    config: PeerBenchConfig, *, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the whole measurement in a child interpreter; return its result."""
    # Its own cluster, not one RAY_ADDRESS or the like names; RAY_TMPDIR still says where.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY") or k == "RAY_TMPDIR"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "rayload.benchmark.peers",
            json.dumps(asdict(config)),
            str(out),
        ]
        progress(f"peer benchmark: {config.worker_nodes} nodes, replicas {list(config.replicas)}")
        done = subprocess.run(cmd, env=env, stdout=sys.stderr, check=False, timeout=3600)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the peer benchmark's child exited {done.returncode}")
        result: dict[str, Any] = json.loads(out.read_text())
    from rayload.benchmark.peer_report import targets_jsonable

    result["targets"] = targets_jsonable(result)
    return result


def write_peer_report(result: dict[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write ``result`` as ``bench-<time>.json`` and ``.md`` in ``out_dir``."""
    from rayload.benchmark.peer_report import render_markdown

    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    stem = result["run_id"]
    paths = {"json": directory / f"{stem}.json", "md": directory / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["md"].write_text(render_markdown(result))
    return paths


def measure(config: PeerBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Everything, in this process (which must not have called ``ray.init``)."""
    from rayload.benchmark import machine_info
    from rayload.benchmark.peer_cluster import (
        checkpoint_files,
        cold_read_rate,
        local_cluster,
        transfer_rates,
        write_exact_checkpoint,
    )
    from rayload.loading.synthetic import write_checkpoint

    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = machine_info()
    work = Path(config.workdir)
    exact = write_exact_checkpoint(
        work / f"peers-exact-{config.size_gb:g}gb", size_gb=config.size_gb
    )
    checkpoints = {"exact": str(exact)}
    if config.strided:
        strided = work / f"peers-tiny-llama-{config.size_gb:g}gb"
        if not (strided / "config.json").exists():
            write_checkpoint(strided, preset="tiny-llama", size_gb=config.size_gb)
        checkpoints["strided"] = str(strided)
    top = max(config.replicas)
    result: dict[str, Any] = {
        "schema": 1,
        "kind": "peers",
        "started": started,
        "run_id": "bench-" + started.replace(":", "").replace("+", "p")[:17],
        "config": asdict(config),
        "machine": machine,
        "checkpoints": {
            name: {"path": path, "bytes": sum(os.path.getsize(f) for f in checkpoint_files(path))}
            for name, path in checkpoints.items()
        },
    }
    with (
        tempfile.TemporaryDirectory() as traces,
        local_cluster(config.worker_nodes, object_store_bytes=config.object_store_bytes),
    ):
        run = _Runner(config, Path(traces), progress)
        progress("warm-up load (imports into the page cache; not recorded)")
        run.together(exact, 1, "auto", record=False)
        progress("rates: the peer channel between and within nodes, the disk cold")
        result["rates"] = {
            **transfer_rates(),
            "disk_cold_MBps": cold_read_rate(checkpoint_files(exact)),
        }
        together = [run.together(exact, n, "auto") for n in config.replicas]
        together.append(run.together(exact, top, "scratch"))
        result["together"] = together
        if config.strided:
            path = Path(checkpoints["strided"])
            result["strided"] = [run.together(path, n, "auto") for n in sorted({1, top})]
        if config.pair:
            result["pair"] = run.pair(exact)
    result["loadavg_after"] = os.getloadavg()
    return result


class _Runner:
    def __init__(self, config: PeerBenchConfig, traces: Path, progress: Callable[[str], None]):
        self.config = config
        self.traces = traces
        self.progress = progress
        self.count = 0

    def _trace_dir(self) -> Path:
        self.count += 1
        return self.traces / f"load-{self.count}"

    def together(
        self, path: Path, replicas: int, method: str, *, record: bool = True
    ) -> dict[str, Any]:
        """``replicas`` replicas loaded by one ``rayload.load``, cold."""
        import rayload
        from rayload.benchmark.peer_cluster import checkpoint_files
        from rayload.benchmark.probes import evict

        if record:
            self.progress(f"{replicas} replica(s) together, method={method}, {path.name}, cold")
        trace_dir = self._trace_dir()
        evict(checkpoint_files(path))
        start = time.perf_counter()
        result = rayload.load(
            path,
            self.config.tp,
            method=method,
            device="cpu",
            replicas=replicas,
            trace_dir=trace_dir,
        )
        wall = time.perf_counter() - start
        try:
            ranks = [r.to_dict() for r in result.ranks]
            shard_bytes = sum(r.nbytes for r in result.plan.ranks)
        finally:
            result.close()
        return {
            "checkpoint": path.name,
            "replicas": replicas,
            "method": method,
            "wall_s": wall,
            "shard_bytes": shard_bytes,
            **load_figures(trace_dir, ranks),
        }

    def pair(self, path: Path) -> dict[str, Any]:
        """A new replica from a loaded one, on its node and on another, and cold."""
        import ray

        from rayload.benchmark.peer_cluster import checkpoint_files, pinned_loader
        from rayload.benchmark.probes import evict

        tp = self.config.tp
        out: dict[str, Any] = {}

        def pinned(loader: Any, method: str, shared_copy: bool = False) -> dict[str, Any]:
            trace_dir = self._trace_dir()
            evict(checkpoint_files(path))
            got = ray.get(loader.load.remote(str(path), tp, method, str(trace_dir), shared_copy))
            return {"wall_s": got["wall_s"], **load_figures(trace_dir, got["ranks"])}

        self.progress("pair: the holder on node 0, cold, keeping a shared copy")
        with pinned_loader(0, tp) as holder:
            out["holder"] = pinned(holder, "auto", shared_copy=True)
            out["holder"]["shared_copy_s"] = ray.get(holder.wait_shared_copy.remote())
            self.progress("pair: a new replica on node 0 from the holder (same node)")
            with pinned_loader(0, tp) as same:
                out["peer_same_node"] = pinned(same, "auto")
            self.progress("pair: a new replica on node 1 from the holder (cross-node)")
            with pinned_loader(1, tp) as cross:
                out["peer_cross_node"] = pinned(cross, "auto")
        self.progress("pair: the same new replica on node 1, cold from storage")
        with pinned_loader(1, tp) as cold:
            out["storage_cold"] = pinned(cold, "auto")
        return out


def load_figures(trace_dir: Path, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """What one load's written trace and rank reports say: rchar by replica and rank,
    bytes from storage and peers, weight population, spawn, each replica's nodes."""
    from rayload.loading.report import READ
    from rayload.tracing import schema

    # The driver's steps before it dispatches the ranks' loads: the last to end is the
    # start of the weight population.
    dispatch_after = (schema.PEERS_SPAN, schema.CLOCK_SYNC_SPAN, schema.SPAWN_SPAN)
    spans = read_spans(trace_dir)
    loads = [s for s in spans if s["name"] == schema.RANK_SPAN]
    rchar = {
        f"{s['resource'].get(schema.REPLICA, 0)}/{s['attributes'][schema.RANK]}": int(
            s["attributes"]["rayload.io.rchar"]
        )
        for s in loads
    }
    dispatch = max(s["end_ns"] for s in spans if s["name"] in dispatch_after)
    spawn = [s for s in spans if s["name"] == schema.SPAWN_SPAN]
    nodes: dict[int, list[str | None]] = {}
    for r in ranks:
        nodes.setdefault(int(r.get("replica", 0)), []).append(r.get("node_id"))
    return {
        "rchar": rchar,
        "rchar_total": sum(rchar.values()),
        "bytes_from_storage": sum(int(r["bytes_from_storage"]) for r in ranks),
        "bytes_from_peers": sum(int(r["bytes_from_peers"]) for r in ranks),
        "storage_by_replica": [
            sum(int(r["bytes_from_storage"]) for r in ranks if int(r.get("replica", 0)) == i)
            for i in sorted(nodes)
        ],
        "population_s": (max(s["end_ns"] for s in loads) - dispatch) / 1e9,
        "spawn_s": (max(s["end_ns"] for s in spawn) - min(s["start_ns"] for s in spawn)) / 1e9
        if spawn
        else None,
        "replica_nodes": [nodes[i] for i in sorted(nodes)],
        "rank_phases_s": _slowest_phases(spans),
        "rank_read_s": {
            f"{s['resource'].get(schema.REPLICA, 0)}/{s['attributes'][schema.RANK]}": round(
                (s["end_ns"] - s["start_ns"]) / 1e9, 4
            )
            for s in spans
            if s["name"] == READ
        },
        "rank_sources": {f"{r.get('replica', 0)}/{r['rank']}": r.get("source") for r in ranks},
        "rank_via": {
            f"{s['resource'].get(schema.REPLICA, 0)}/{s['attributes'][schema.RANK]}": s[
                "attributes"
            ].get("rayload.peer.via")
            for s in spans
            if s["name"] == READ and "rayload.peer.via" in s["attributes"]
        },
        "effective": sorted({str(r["method"]["effective"]) for r in ranks}),
        "sources": sorted({str(r.get("source", "")).split(" node=")[0] for r in ranks}),
    }


def _slowest_phases(spans: list[dict[str, Any]]) -> dict[str, float]:
    """Each rank span's longest duration over the ranks (``rank.read``: where a receiver
    waits for its holder's export and pulls it)."""
    out: dict[str, float] = {}
    for s in spans:
        if s["name"].startswith("rank."):
            seconds = (s["end_ns"] - s["start_ns"]) / 1e9
            out[s["name"]] = round(max(out.get(s["name"], 0.0), seconds), 4)
    return out


def read_spans(trace_dir: Path) -> list[dict[str, Any]]:
    """Every span of ``trace_dir/trace.otlp.json``: name, start/end (ns), attributes and
    resource attributes as plain values."""
    data = json.loads((trace_dir / "trace.otlp.json").read_text())
    spans = []
    for resource_spans in data["resourceSpans"]:
        resource = {
            a["key"]: _value(a["value"])
            for a in resource_spans.get("resource", {}).get("attributes", [])
        }
        for scope in resource_spans["scopeSpans"]:
            for span in scope["spans"]:
                spans.append(
                    {
                        "name": span["name"],
                        "start_ns": int(span["startTimeUnixNano"]),
                        "end_ns": int(span["endTimeUnixNano"]),
                        "attributes": {
                            a["key"]: _value(a["value"]) for a in span.get("attributes", [])
                        },
                        "resource": resource,
                    }
                )
    return spans


def _value(value: dict[str, Any]) -> Any:
    ((kind, raw),) = value.items()
    return int(raw) if kind == "intValue" else raw


def main(argv: list[str]) -> int:
    """``python -m rayload.benchmark.peers CONFIG_JSON OUT_JSON``."""
    raw = json.loads(argv[0])
    config = PeerBenchConfig(**{**raw, "replicas": tuple(raw["replicas"])})

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = measure(config, progress)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
