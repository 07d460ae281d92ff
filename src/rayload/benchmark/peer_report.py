"""The peer benchmark's figures as targets and a markdown report.

Targets (issue 14), each judged on figures of the same run:

* storage: the largest count of replicas started together read at most 1.05x the
  checkpoint's bytes from files (sum of the ranks' ``rchar``), beside the same count
  loaded without sharing (``method="scratch"``);
* strided shape (documented, no threshold of its own): the cluster read what one replica
  reads (its reader's own amplification included), not ``n`` times it;
* time: the largest count's weight population within 1.5x one replica's; the whole
  ``rayload.load`` wall time beside it (spawning actors: no loader avoids it);
* a new replica from a loaded one at least 2x faster (weight population) than the same
  replica cold from storage, on the holder's node and on another node, with Ray's
  transfer rates and the disk's cold rate of the same run beside it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rayload.loading.report import READ

_MB = 1e6


@dataclass(frozen=True)
class PeerTarget:
    """One target: what it asks, the measured figure, the threshold, whether it was met,
    and what explains it (a figure of the same run)."""

    name: str
    measured: float
    threshold: float | None
    met: bool | None
    note: str = ""


def targets(result: dict[str, Any]) -> list[PeerTarget]:
    """The targets that the figures in ``result`` allow judging."""
    out: list[PeerTarget] = []
    ckpt = result["checkpoints"]["exact"]["bytes"]
    together = [t for t in result["together"] if t["method"] == "auto"]
    by_count = {t["replicas"]: t for t in together}
    top = max(by_count)
    alone = by_count.get(1)
    big = by_count[top]
    scratch = next((t for t in result["together"] if t["method"] == "scratch"), None)
    share = big["rchar_total"] / ckpt
    note = f"{scratch['rchar_total'] / ckpt:.2f}x without sharing (scratch)" if scratch else ""
    out.append(
        PeerTarget(
            f"storage bytes, {top} replicas together / checkpoint", share, 1.05, share <= 1.05, note
        )
    )
    if "strided" in result and len(result["strided"]) == 2:
        one, many = result["strided"]
        ratio = many["rchar_total"] / one["rchar_total"]
        one_x = one["rchar_total"] / one["shard_bytes"]
        out.append(
            PeerTarget(
                f"strided shape: storage bytes, {many['replicas']} replicas / 1 replica",
                ratio,
                1.05,
                ratio <= 1.05,
                f"one replica reads {one_x:.2f}x its shards (whole runs of split-1 rows)",
            )
        )
    if alone is not None and top > 1:
        # Judged by the slowest rank.read, as the pair: the weight population also carries
        # the ranks' process-group joins, which vary by tenths of a second from run to run.
        ratio = _slowest_read(big) / _slowest_read(alone)
        population = big["population_s"] / alone["population_s"]
        wall = big["wall_s"] / alone["wall_s"]
        out.append(
            PeerTarget(
                f"{top} replicas together / 1 replica: slowest rank.read",
                ratio,
                1.5,
                ratio <= 1.5,
                f"weight population {population:.2f}x; "
                f"whole rayload.load: {wall:.2f}x ({big['wall_s']:.1f} s vs "
                f"{alone['wall_s']:.1f} s; spawn {big['spawn_s']:.1f} s vs "
                f"{alone['spawn_s']:.1f} s)",
            )
        )
    pair = result.get("pair")
    if pair:
        cold = pair["storage_cold"]
        rates = result.get("rates", {})
        for key, where, rate in (
            ("peer_same_node", "same node", rates.get("same_node_MBps")),
            ("peer_cross_node", "cross-node", rates.get("cross_node_MBps")),
        ):
            # Judged by the slowest rank.read: where the bytes come from is all that differs;
            # the weight population also carries each load's own resolve and group join.
            speedup = _slowest_read(cold) / _slowest_read(pair[key])
            population = cold["population_s"] / pair[key]["population_s"]
            disk = rates.get("disk_cold_MBps", 0.0)
            via = ", ".join(sorted(set(pair[key].get("rank_via", {}).values()))) or "?"
            note = f"via {via}; weight population {population:.2f}x"
            if rate:
                note += f"; channel {where} {rate:.0f} MB/s vs disk cold {disk:.0f} MB/s"
            out.append(
                PeerTarget(
                    f"new replica from a loaded one ({where}): rank.read speed-up vs cold",
                    speedup,
                    2.0,
                    speedup >= 2.0,
                    note,
                )
            )
    return out


def _slowest_read(row: dict[str, Any]) -> float:
    """The longest ``rank.read`` of a load's ranks (s)."""
    return max(row["rank_read_s"].values())


def render_markdown(result: dict[str, Any]) -> str:
    """The report: run id, machine, one table per measurement, the targets."""
    ckpt = result["checkpoints"]["exact"]["bytes"]
    cfg = result["config"]
    lines = [
        f"# rayload peer benchmark {result['run_id']}",
        "",
        f"{result['started']}; replicas {cfg['replicas']} of TP={cfg['tp']} on a "
        f"{cfg['nodes'] or max(2, *cfg['replicas'])}-node ray.cluster_utils.Cluster (a CPU-less "
        f"head; object store {cfg['object_store_bytes'] / 2**30:.1f} GiB per node); exact-read "
        f"checkpoint {ckpt / _MB:.0f} MB (f32, hidden 2048); {result['machine'].get('cpus')} "
        f"CPUs, load average {_load(result)}. Weight population: from the driver's dispatch "
        "of the ranks' loads to the last rank loaded; rayload.load: the whole call, actor "
        "spawn included.",
        "",
        "## Replicas loaded together (cold)",
        "",
        "| checkpoint | replicas | method | storage MB (rchar) | x checkpoint "
        "| x one replica's shards | from peers MB | weight population s | slowest rank.read s "
        "| rayload.load s | spawn s | nodes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in [*result.get("together", []), *result.get("strided", [])]:
        name = row["checkpoint"]
        size = result["checkpoints"]["strided" if "tiny" in name else "exact"]["bytes"]
        lines.append(
            f"| {name} | {row['replicas']} | {row['method']} | {row['rchar_total'] / _MB:.1f} "
            f"| {row['rchar_total'] / size:.3f} | {row['rchar_total'] / row['shard_bytes']:.3f} "
            f"| {row['bytes_from_peers'] / _MB:.1f} | {row['population_s']:.2f} "
            f"| {_read_s(row)} | {row['wall_s']:.2f} | {row['spawn_s']:.2f} | {_nodes(row)} |"
        )
    pair = result.get("pair")
    if pair:
        lines += [
            "",
            "## A new replica: from a loaded one vs cold from storage",
            "",
            "| load | where | storage MB (rchar) | from peers MB | weight population s "
            "| slowest rank.read s | rayload.load s | source |",
            "|---|---|---|---|---|---|---|---|",
        ]
        labels = {
            "holder": "holder, cold from storage",
            "peer_same_node": "new replica from the holder",
            "peer_cross_node": "new replica from the holder",
            "storage_cold": "the same new replica, cold from storage",
        }
        where = {
            "holder": "node 0",
            "peer_same_node": "node 0 (holder's)",
            "peer_cross_node": "node 1",
            "storage_cold": "node 1",
        }
        for key, label in labels.items():
            row = pair[key]
            lines.append(
                f"| {label} | {where[key]} | {row['rchar_total'] / _MB:.1f} "
                f"| {row['bytes_from_peers'] / _MB:.1f} | {row['population_s']:.2f} "
                f"| {_read_s(row)} | {row['wall_s']:.2f} | {', '.join(row['sources'])} |"
            )
    rates = result.get("rates")
    if rates:
        lines += ["", "## Rates in this run (MB/s)", ""]
        lines += [f"- {k}: {v:.0f}" for k, v in rates.items()]
    lines += [
        "",
        "## Targets",
        "",
        "| target | measured | threshold | met | note |",
        "|---|---|---|---|---|",
    ]
    for t in targets(result):
        met = "-" if t.met is None else ("yes" if t.met else "**no**")
        threshold = "-" if t.threshold is None else f"{t.threshold:g}"
        lines.append(f"| {t.name} | {t.measured:.3f} | {threshold} | {met} | {t.note} |")
    return "\n".join(lines) + "\n"


def targets_jsonable(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [asdict(t) for t in targets(result)]


def _read_s(row: dict[str, Any]) -> str:
    seconds = row.get("rank_phases_s", {}).get(READ)
    return "-" if seconds is None else f"{seconds:.2f}"


def _nodes(row: dict[str, Any]) -> str:
    """Each replica's nodes as short ids, replicas separated by ``;``."""
    return "; ".join(",".join((n or "?")[:6] for n in nodes) for nodes in row["replica_nodes"])


def _load(result: dict[str, Any]) -> str:
    before = result["machine"].get("loadavg_before") or [0]
    after = result.get("loadavg_after") or [0]
    return f"{before[0]:.1f} before, {after[0]:.1f} after"
