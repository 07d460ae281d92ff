"""Read amplification by kind of tensor: split 0 and replicated tensors versus split 1.

A rank's ``rchar`` covers every tensor it reads, so the whole-checkpoint cases cannot say
which kind of tensor costs extra bytes. Here the tensors of one kind (from the first
decoder layer, plus the final norm with the split-0 kind) are copied into a small
checkpoint of their own, with the same names and config.json so the same sharding rules
apply, and each rank's bytes read are compared with what the plan says it needs:
``amplification = bytes read / plan bytes``, worst rank (1.0 = not one byte too many;
a replicated tensor is needed in full by every rank, so it counts at 1.0, not tp).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rayload.benchmark.cases import CASES
from rayload.benchmark.runner import BenchConfig, Prepared, Progress, prepare_checkpoint, run_case

KINDS: dict[str, Callable[[int | None], bool]] = {
    "split 0 + replicated": lambda split: split != 1,
    "split 1": lambda split: split == 1,
}
CASES_PROBED = ("scratch", "converted", "fastsafetensors", "safe_open_slice")


def _picked(name: str) -> bool:
    return name.startswith("model.layers.0.") or name == "model.norm.weight"


def _subset_checkpoint(src: Prepared, names: list[str], out: Path) -> str:
    """A one-file checkpoint holding ``names`` from ``src``, plus its config.json."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (out / "model.safetensors").is_file():
        return str(out)
    tensors = {}
    for path in src.files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in names:
                    tensors[name] = f.get_tensor(name).clone()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(Path(src.checkpoint) / "config.json", out / "config.json")
    return str(out)


def split_amplification(
    config: BenchConfig, prep: Prepared, tp: int, progress: Progress
) -> list[dict[str, Any]]:
    """Per kind of tensor and per case: worst-rank bytes read / plan bytes, at ``tp``."""
    cases = [c for c in CASES_PROBED if c not in prep.skipped]
    rows = []
    for kind, keep in KINDS.items():
        names = [n for n, split in prep.splits[tp].items() if _picked(n) and keep(split)]
        if not names:
            continue
        slug = kind.replace(" ", "").replace("+", "-")
        out = Path(config.workdir) / f"{Path(prep.checkpoint).name}-{slug}"
        sub = prepare_checkpoint(
            _subset_checkpoint(prep, names, out),
            (tp,),
            config.workdir,
            progress,
            cases=cases,
        )
        for case in cases:
            sample = run_case(CASES[case], tp, "warm", 0, sub, config)
            rows.append(_row(kind, case, tp, len(names), sample.error, sub, sample.ranks))
            progress(f"amplification {kind:22} {case:16} {rows[-1]['amplification']}")
    return rows


def _row(
    kind: str,
    case: str,
    tp: int,
    count: int,
    error: str | None,
    sub: Prepared,
    ranks: Any,
) -> dict[str, Any]:
    plan: Mapping[int, tuple[int, ...]] = sub.plan_rank_bytes
    row: dict[str, Any] = {
        "kind": kind,
        "case": case,
        "tp_size": tp,
        "tensors": count,
        "plan_bytes": list(plan[tp]),
        "error": error,
    }
    if error is None:
        row["bytes_read"] = [r.bytes_read for r in ranks]
        row["amplification"] = round(
            max(r.bytes_read / need for r, need in zip(ranks, plan[tp], strict=True)), 4
        )
    else:
        row["amplification"] = None
    return row
