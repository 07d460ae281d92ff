"""Checkpoints and shard plans as JSON-ready dicts and as human-readable text, for
``rayload inspect`` and ``rayload plan``."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from rayload.loading.checkpoint import Checkpoint, TensorInfo
from rayload.loading.plan import ShardPlan
from rayload.loading.rules import unused_rule_message
from rayload.loading.storage import storage_for

_UNMATCHED_SHOWN = 10


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def describe_checkpoint(ckpt: Checkpoint) -> dict[str, Any]:
    """What ``rayload inspect --json`` prints. Converted checkpoints list every rank's
    tensors, each with its ``rank``."""
    entries: list[tuple[int | None, TensorInfo]]
    if ckpt.by_rank is None:
        entries = [(None, t) for t in ckpt.tensors.values()]
    else:
        entries = [(rank, t) for rank, table in ckpt.by_rank.items() for t in table.values()]
    counts = Counter(t.file for _, t in entries)
    return {
        "root": ckpt.root,
        "layout": ckpt.layout,
        "architecture": ckpt.architecture,
        "tp_size": ckpt.tp_size,
        "files": [
            {"path": f, "bytes": storage_for(f).size(f), "tensors": counts[f]} for f in ckpt.files
        ],
        "tensors": [_tensor(t, rank) for rank, t in entries],
        "tensor_count": len(entries),
        "tensor_bytes": ckpt.tensor_bytes,
        "file_bytes": ckpt.total_bytes,
        "quantization": (ckpt.config or {}).get("quantization_config"),
    }


def _quantization_lines(quant: Any) -> list[str]:
    """config.json's ``quantization_config`` as one line (method, format, block size)."""
    if not isinstance(quant, dict):
        return []
    shown = ", ".join(f"{k}={quant[k]}" for k in sorted(quant) if not isinstance(quant[k], dict))
    return [f"quantized   {shown}"]


def _tensor(t: TensorInfo, rank: int | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": t.name,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "bytes": t.nbytes,
        "file": os.path.basename(t.file),
    }
    if rank is not None:
        entry["rank"] = rank
    return entry


def render_checkpoint(summary: dict[str, Any]) -> str:
    """``describe_checkpoint``'s dict as a header plus one table row per tensor."""
    arch = summary["architecture"] or "unknown architecture"
    tp = f", converted for tp={summary['tp_size']}" if summary["tp_size"] else ""
    lines = [
        f"checkpoint  {summary['root']} ({summary['layout']}, {arch}{tp})",
        f"files       {len(summary['files'])}, {human_bytes(summary['file_bytes'])}",
        f"tensors     {summary['tensor_count']}, {human_bytes(summary['tensor_bytes'])}",
        *_quantization_lines(summary.get("quantization")),
        "",
    ]
    ranked = summary["tp_size"] is not None
    header = ["name", "dtype", "shape", "bytes", "file"] + (["rank"] if ranked else [])
    rows = [
        [
            t["name"],
            t["dtype"],
            "x".join(map(str, t["shape"])) or "scalar",
            human_bytes(t["bytes"]),
            t["file"],
        ]
        + ([str(t["rank"])] if ranked else [])
        for t in summary["tensors"]
    ]
    return "\n".join(lines + _table(header, rows))


def describe_plan(plan: ShardPlan, root: str) -> dict[str, Any]:
    """What ``rayload plan --json`` prints."""
    return {
        "root": root,
        "layout": plan.layout,
        "tp_size": plan.tp_size,
        "rules": plan.rules_source,
        "checkpoint_bytes": plan.checkpoint_bytes,
        "replicated_bytes": plan.replicated_bytes,
        "replicated_tensors": sum(1 for s in plan.splits.values() if s is None),
        "heads": None
        if plan.heads is None
        else {
            "attention": plan.heads.num_heads,
            "kv": plan.heads.num_kv_heads,
            "head_dim": plan.heads.head_dim,
            "kv_replicas": plan.kv_replicas,
        },
        "replicated_head_bytes": plan.replicated_head_bytes,
        "read_amplification": plan.read_amplification,
        "unmatched": {
            "count": len(plan.unmatched),
            "bytes": plan.unmatched_bytes,
            "tensors": list(plan.unmatched),
        },
        "unused_rules": list(plan.unused_rules),
        "expert_parallel": plan.expert_parallel,
        "block_size": list(plan.block_size) if plan.block_size else None,
        "ranks": [
            {
                "rank": r.rank,
                "bytes": r.nbytes,
                "tensors": len(r.shards),
                "files": len(r.files),
                **(
                    {
                        "experts": list(plan.experts[r.rank]),
                        "expert_bytes": plan.expert_bytes(r.rank),
                    }
                    if plan.expert_parallel
                    else {}
                ),
            }
            for r in plan.ranks
        ],
        "splits": dict(plan.splits),
    }


def render_plan(summary: dict[str, Any]) -> str:
    """``describe_plan``'s dict as a few lines and a per-rank table."""
    unmatched = summary["unmatched"]
    lines = [
        f"plan        {summary['root']} ({summary['layout']}), tp={summary['tp_size']}, "
        f"rules: {summary['rules']}",
        f"checkpoint  {human_bytes(summary['checkpoint_bytes'])} of tensors",
        "",
    ]
    header = ["rank", "bytes", "tensors", "files"]
    rows = [
        [str(r["rank"]), human_bytes(r["bytes"]), str(r["tensors"]), str(r["files"])]
        for r in summary["ranks"]
    ]
    if summary["expert_parallel"]:
        header += ["experts", "expert bytes"]
        for row, r in zip(rows, summary["ranks"], strict=True):
            row += [_id_range(r["experts"]), human_bytes(r["expert_bytes"])]
    lines += _table(header, rows)
    lines += ["", *_heads_lines(summary)]
    lines += [
        f"replicated          {human_bytes(summary['replicated_bytes'])} in "
        f"{summary['replicated_tensors']} tensors, read in full by every rank",
        f"unmatched           {unmatched['count']} tensors ({human_bytes(unmatched['bytes'])}) "
        f"replicated because no rule matched",
        f"read amplification  {summary['read_amplification']:.4f}x "
        f"(bytes read by all ranks / checkpoint bytes)",
    ]
    shown = unmatched["tensors"][:_UNMATCHED_SHOWN]
    lines += [f"  unmatched: {name}" for name in shown]
    if unmatched["count"] > len(shown):
        lines.append(f"  ... and {unmatched['count'] - len(shown)} more (see --json)")
    lines += [f"warning: {unused_rule_message(p)}" for p in summary["unused_rules"]]
    return "\n".join(lines)


def _id_range(ids: list[int]) -> str:
    """``[4, 5, 6, 7]`` as ``4-7`` (expert blocks are contiguous)."""
    if not ids:
        return "-"
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def _heads_lines(summary: dict[str, Any]) -> list[str]:
    heads = summary["heads"]
    if heads is None:
        return ["heads               none declared in config.json"]
    lines = [
        f"heads               {heads['attention']} query, {heads['kv']} KV, head_dim "
        f"{heads['head_dim']}: cut in whole heads"
    ]
    if heads["kv_replicas"] > 1:
        lines.append(
            f"KV heads replicated each on {heads['kv_replicas']} ranks "
            f"({heads['kv']} KV heads < tp {summary['tp_size']}): "
            f"{human_bytes(summary['replicated_head_bytes'])} read more than once"
        )
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
