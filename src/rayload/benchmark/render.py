"""Write a benchmark result as JSON, a markdown report and a PNG bar chart."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rayload.benchmark.cases import CASES
from rayload.benchmark.layouts import TP
from rayload.benchmark.summary import MB, MOE_CASES, CaseSummary
from rayload.benchmark.targets import Target
from rayload.tracing import metrics, schema

log = logging.getLogger(__name__)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or math.isnan(value) else fmt.format(value)


_CACHE_TITLES = {
    "cold": "cold page cache",
    "warm": "warm page cache",
    "remote": "remote storage (no page cache)",
}


def table(summaries: Sequence[CaseSummary], cache: str) -> str:
    """The markdown table of one cache state."""
    peers = sorted({p for s in summaries for p in s.speedup})
    head = (
        [
            "case",
            "tp",
            "wall s (median)",
            "min-max",
            "GB/s",
            "rank MB read",
            "read ampl.",
            "peak RSS rise/rank MB",
            "shard MB",
            "x limit",
            "x limit_alloc",
        ]
        + [f"speedup vs {p}" for p in peers]
        + ["effective", "runs"]
    )
    rows = [head, ["---"] * len(head)]
    for s in summaries:
        if s.cache != cache:
            continue
        if not s.runs:
            rows.append([s.case, str(s.tp_size), f"FAILED: {s.error}"] + [""] * (len(head) - 3))
            continue
        rows.append(
            [
                s.case,
                str(s.tp_size),
                f"{s.wall_s:.3f}",
                f"{s.wall_s_min:.2f}-{s.wall_s_max:.2f}",
                f"{s.gbps:.2f}",
                f"{s.rank_bytes_read / MB:.0f}",
                f"{s.read_amplification:.3f}",
                f"{s.rss_peak_delta / MB:.0f}",
                f"{s.shard_bytes / MB:.0f}",
                _num(s.x_limit, "{:.2f}"),
                _num(s.x_limit_alloc, "{:.2f}"),
            ]
            + [_num(s.speedup.get(p), "{:.2f}") for p in peers]
            + [
                ", ".join(s.effective) or "-",
                f"{s.runs}" + (f" ({s.failures} failed)" if s.failures else ""),
            ]
        )
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def targets_table(items: Sequence[Target]) -> str:
    rows = [["target", "threshold", "measured", "met"], ["---"] * 4]
    for t in items:
        if t.met is None:
            met = "not measured" if t.measured == "not measured" else "-"
        else:
            met = "yes" if t.met else "**no**"
        rows.append([t.name, t.threshold, t.measured, met + (f" ({t.note})" if t.note else "")])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def markdown(
    result: dict[str, Any],
    summaries: Sequence[CaseSummary],
    items: Sequence[Target],
    chart: str | None,
) -> str:
    cfg, ck, machine = result["config"], result["checkpoint"], result["machine"]
    lines = [
        f"# rayload benchmark, {result['started']}",
        "",
        f"Checkpoint: {ck['path']}: {ck['bytes'] / 1e9:.3f} GB in {len(ck['files'])} files. "
        f"Machine: {machine.get('cpu', '?')}, {machine.get('cpus', '?')} CPUs, kernel "
        f"{machine.get('kernel', '?')}; load average before: {machine.get('loadavg_before')}, "
        f"after: {result.get('loadavg_after')}.",
        f"Repetitions: {cfg['repeat']} per case (medians), cases interleaved. "
        f"Process baseline RSS (python + torch + readers imported): "
        f"{result['baseline_rss'] / MB:.0f} MB.",
        "",
    ]
    for problem in result["consistency"]:
        lines.append(f"**Consistency problem:** {problem}")
    if not result["consistency"] and cfg["verify"]:
        layouts = sorted({r["layout"] for r in result.get("references", [])})
        lines.append(
            "Every case handed every rank bit-identical tensors to the reference of its "
            f"layout ({', '.join(layouts)}: safetensors get_slice of the rank's plan; "
            "digests agree)."
            if layouts  # results written before the references: cases agreed with each other
            else "Every case returned bit-identical shards for every rank (digests agree)."
        )
    for name, why in result["skipped"].items():
        lines.append(f"- skipped `{name}`: {why}")
    storage = result.get("storage") or {"kind": "file"}
    if storage["kind"] != "file":
        lines.append(
            f"- storage: {storage['kind']}, endpoint {storage.get('endpoint')}, bucket "
            f"{storage.get('bucket')}; bytes read are the bytes the ranks received from it"
        )
    for what, why in (storage.get("not_applicable") or {}).items():
        lines.append(f"- not applicable, {what}: {why}")
    lines.append("")
    for cache in cfg["caches"]:
        lines += [f"## {_CACHE_TITLES.get(cache, cache)}", "", table(summaries, cache), ""]
    experts = expert_table(summaries, ck.get("layouts", []), cfg["caches"])
    if experts:
        lines += ["## Experts: expert parallel, plain TP, every expert whole", "", experts, ""]
    if result.get("amplification_by_kind"):
        lines += [
            "## Read amplification by kind of tensor",
            "",
            "Worst rank's bytes read / the bytes its plan needs, on one-layer checkpoints "
            "holding only that kind of tensor, warm page cache.",
            "",
            _amplification(result["amplification_by_kind"]),
            "",
        ]
    lines += ["## Targets", "", targets_table(items), ""]
    if result.get("load_breakdown"):
        lines += ["## `rayload.load` wall time", "", _breakdown(result["load_breakdown"]), ""]
        if result["load_breakdown"].get("start_up"):
            lines += ["## Start-up", "", start_up_table(result["load_breakdown"]["start_up"]), ""]
    if chart:
        lines += [f"![wall time per case]({chart})", ""]
    return "\n".join(lines)


def expert_table(
    summaries: Sequence[CaseSummary], layouts: Sequence[dict[str, Any]], caches: Sequence[str]
) -> str:
    """The mixture-of-experts comparison (``MOE_CASES`` side by side: what each rank
    holds by the plan and what it read), or "" when no case of an expert layout ran."""
    rows = [s for s in summaries if s.case in MOE_CASES and s.runs]
    if not any(CASES[s.case].layout != TP for s in rows):
        return ""
    plans = {(p["layout"], p["tp_size"]): p for p in layouts}
    head = [
        "case",
        "layout",
        "tp",
        "cache",
        "wall s (median)",
        "min-max",
        "x limit",
        "rank MB read",
        "shard MB (plan)",
        "expert MB/rank (plan)",
        "read / shard",
    ]
    out = [head, ["---"] * len(head)]
    for cache in caches:
        for s in sorted(
            (s for s in rows if s.cache == cache),
            key=lambda s: (s.tp_size, MOE_CASES.index(s.case)),
        ):
            plan = plans[(CASES[s.case].layout, s.tp_size)]
            out.append(
                [
                    s.case,
                    plan["layout"],
                    str(s.tp_size),
                    cache,
                    f"{s.wall_s:.3f}",
                    f"{s.wall_s_min:.2f}-{s.wall_s_max:.2f}",
                    _num(s.x_limit, "{:.2f}"),
                    f"{s.rank_bytes_read / MB:.0f}",
                    f"{max(plan['rank_bytes']) / MB:.0f}",
                    f"{max(plan['expert_bytes']) / MB:.0f}",
                    f"{s.rank_bytes_read / max(plan['rank_bytes']):.3f}",
                ]
            )
    all_experts = next(iter(plans.values()))["all_expert_bytes"]
    lines = [
        f"All experts' tensors: {all_experts / MB:.0f} MB. `rank MB read`: the most any rank "
        "read (rchar); `read / shard`: that over the plan's shard for the rank."
    ]
    lines.append("\n".join("| " + " | ".join(r) + " |" for r in out))
    return "\n\n".join(lines)


def _amplification(rows: Sequence[dict[str, Any]]) -> str:
    out = [["kind", "case", "tp", "tensors", "MB needed/rank", "amplification"], ["---"] * 6]
    for r in rows:
        value = "FAILED" if r["amplification"] is None else f"{r['amplification']:.3f}"
        out.append(
            [
                r["kind"],
                r["case"],
                str(r["tp_size"]),
                str(r["tensors"]),
                f"{max(r['plan_bytes']) / MB:.1f}",
                value,
            ]
        )
    return "\n".join("| " + " | ".join(row) + " |" for row in out)


def _breakdown(b: dict[str, Any]) -> str:
    off, on = b["without_trace_files"], b["with_trace_files"]
    rows = [
        ["part (median, s)", "without trace files", "with trace files"],
        ["---", "---", "---"],
        ["Ray start (`ray.init`, once)", f"{b['ray_start_s']:.2f}", ""],
    ]
    for key, label in (
        (metrics.PLACEMENT, "placement group"),
        (metrics.ACTOR_STARTUP, "actor start (slowest rank)"),
        (metrics.PREPARATION, "rank: resolve + plan (slowest)"),
        (metrics.POPULATION, "rank: weight load (slowest)"),
        (metrics.TOTAL, "rank: total model loading (slowest)"),
        ("other_s", "driver: validate, clock sync, trace, metrics"),
        ("wall_s", "whole `rayload.load` call"),
    ):
        rows.append([label, f"{off[key]:.3f}", f"{on[key]:.3f}"])
    lines = [f"TP={b['tp_size']}, method {b['method']}, warm page cache."]
    lines.append("\n".join("| " + " | ".join(r) + " |" for r in rows))
    if "tracing" in b:
        lines.append(_tracing(b["tracing"]))
    return "\n\n".join(lines)


def _tracing(t: dict[str, Any]) -> str:
    """The timed tracing work (rayload.benchmark.tracecost), median over every load."""
    rows = [["tracing step (median, ms)", "time"], ["---", "---"]]
    for key, label in (
        ("rank_payload_s", "rank: spans -> OTLP bytes (one rank)"),
        ("rank_payload_max_s", "rank: spans -> OTLP bytes (slowest rank)"),
        ("merge_s", "driver: trace, decode + clock-correct rank spans, finish"),
        ("files_s", "driver: write the 4 trace files"),
        ("otlp_encode_s", "driver: OTLP protobuf for an exporter"),
        ("critical_path_s", "critical path (slowest rank + driver steps)"),
    ):
        rows.append([label, f"{1000 * t[key]:.1f}"])
    table = "\n".join("| " + " | ".join(r) + " |" for r in rows)
    return (
        f"Tracing work, replayed on each load's rank reports ({t['spans']:.0f} spans): "
        f"{t['pct_of_load']:.2f}% of the whole `rayload.load`, "
        f"{t['pct_of_model_loading']:.1f}% of the ranks' model loading.\n\n{table}"
    )


_SPAWN_PART_LABELS = {
    schema.SPAWN_WORKER_WAIT_SPAN: "worker_wait",
    schema.SPAWN_PROCESS_START_SPAN: "process_start",
    schema.SPAWN_IMPORTS_SPAN: "imports",
    schema.SPAWN_ACTOR_INIT_SPAN: "actor_init",
}


def start_up_table(su: dict[str, Any]) -> str:
    """The start-up floor beside rayload's spawn, and reload beside fresh loads
    (:mod:`rayload.benchmark.startfloor`)."""
    tp, runs, m = su["tp_size"], su["runs"], su["medians"]

    def row(label: str, key: str) -> list[str]:
        values = [r[key] for r in runs]
        return [label, f"{m[key]:.3f}", f"{min(values):.3f}-{max(values):.3f}"]

    lo, hi = su["rayload_spawn_range"]
    rows = [
        [f"start-up figure (tp={tp}, median of {len(runs)} repetitions)", "s", "min-max"],
        ["---"] * 3,
        row(
            f"**Ray's floor**: {tp} Ray actors importing torch + rayload, in a placement "
            "group, until ready",
            "ray_floor_s",
        ),
        [
            f"**rayload spawn** (slowest rank's `rayload.spawn`, {su['rayload_spawns']} loads)",
            f"{su['rayload_spawn_s']:.3f}",
            f"{lo:.3f}-{hi:.3f}",
        ],
    ]
    parts = su.get("spawn_parts", {})
    if schema.SPAWN_SPAN in parts:
        rows.append(
            [
                "rayload spawn, first fresh load of each repetition",
                f"{parts[schema.SPAWN_SPAN]:.3f}",
                "",
            ]
        )
    for key, label in _SPAWN_PART_LABELS.items():
        if key in parts:
            rows.append(
                [
                    f"of which `{label}`",
                    f"{parts[key]:.3f}",
                    "",
                ]
            )
    rows += [
        row("fresh `rayload.load` (wall)", "fresh_wall_s"),
        row("fresh load: weight population (slowest rank)", "fresh_population_s"),
        row("**`result.reload()`** of the same checkpoint (wall)", "reload_wall_s"),
        row("reload: weight population (slowest rank)", "reload_population_s"),
        row("**close + fresh `rayload.load`** (wall)", "close_and_fresh_s"),
    ]
    lines = [
        f"Method {su['method']}, warm page cache, on the Ray of the loads above; each "
        "repetition measures Ray's floor, then a fresh load, its reload, then close and a "
        "fresh load again."
    ]
    if not su["ray_floor_imported_torch"]:
        lines.append("**Warning:** a floor actor had no torch imported: its time is too low.")
    lines.append("\n".join("| " + " | ".join(r) + " |" for r in rows))
    return "\n\n".join(lines)


def chart(summaries: Sequence[CaseSummary], caches: Sequence[str], path: Path) -> bool:
    """A bar chart of median wall time, one panel per cache state, one group per TP size.
    Returns False (and logs why) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no chart (pip install 'rayload[bench]')")
        return False
    cases = list(dict.fromkeys(s.case for s in summaries if s.kind != "limit"))
    tps = sorted({s.tp_size for s in summaries if s.kind != "limit"})
    by = {(s.case, s.tp_size, s.cache): s for s in summaries if s.runs}
    fig, axes = plt.subplots(1, len(caches), figsize=(6 * len(caches), 4.5), squeeze=False)
    width = 0.8 / max(1, len(cases))
    for ax, cache in zip(axes[0], caches, strict=True):
        for i, case in enumerate(cases):
            xs = [t + (i - (len(cases) - 1) / 2) * width for t in range(len(tps))]
            ys = [by[(case, tp, cache)].wall_s if (case, tp, cache) in by else 0 for tp in tps]
            ax.bar(xs, ys, width, label=case)
        for name, style, label in (
            ("limit", "--", "limit: sequential read, reused buffer"),
            ("limit_alloc", ":", "limit_alloc: sequential read into new memory"),
            ("limit_parallel", "-.", "limit_parallel: a thread per CPU, reused buffers"),
        ):
            if (limit := by.get((name, 1, cache))) is not None:
                ax.axhline(limit.wall_s, color="black", linestyle=style, label=label)
        ax.set_xticks(range(len(tps)), [f"TP={tp}" for tp in tps])
        ax.set_ylabel("wall time, s (median; lower is better)")
        ax.set_title(_CACHE_TITLES.get(cache, cache))
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(
    result: dict[str, Any],
    summaries: Sequence[CaseSummary],
    items: Sequence[Target],
    out_dir: Path,
    stem: str,
) -> dict[str, Path]:
    """Write ``stem``.json, ``stem``.md and ``stem``.png into ``out_dir``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    png = out_dir / f"{stem}.png"
    if chart(summaries, result["config"]["caches"], png):
        paths["png"] = png
    paths["json"].write_text(json.dumps(result, indent=1, default=str) + "\n")
    paths["md"].write_text(
        markdown(result, summaries, items, png.name if "png" in paths else None) + "\n"
    )
    return paths
