"""The cross-case check: every case must hand each rank the tensors of its own layout.

After timing, the driver reads the reference of each layout that ran, once per TP size
and rank: every tensor of the rank's plan (rayload's ``plan_shards`` under the layout's
options, :mod:`rayload.benchmark.layouts`) read with safetensors ``safe_open`` +
``get_slice``, one slice per piece of the split dimension, concatenated. Each case's
digest (:func:`rayload.benchmark.worker.digest`: names, dtypes, shapes and bytes) is
compared with the reference of its own layout, never with a case of another layout: an
expert-parallel rank holds other tensors than a TP rank, by design.

From an ``s3://`` checkpoint, which safetensors cannot open, each tensor of the plan is
fetched whole with one ranged GET of its header's offsets and sliced the same way: no
file is copied to this machine, and rayload's read plan is not involved.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from rayload.benchmark.cases import CASES
from rayload.benchmark.layouts import plan_layout
from rayload.benchmark.runner import CaseSample, Prepared
from rayload.benchmark.worker import digest
from rayload.loading.checkpoint import open_checkpoint
from rayload.loading.header import TensorInfo
from rayload.loading.plan import RankPlan
from rayload.loading.storage import is_remote, storage_for


@dataclass(frozen=True)
class Outcome:
    """What one rank was handed: the digest of its tensors, how many, how many bytes."""

    digest: str | None
    tensors: int
    shard_bytes: int

    def describe(self) -> str:
        return f"{self.tensors} tensors, {self.shard_bytes} bytes, digest {self.digest}"


RefKey = tuple[str, int, int]
"""(layout, tp size, rank)."""


class _RemoteFile:
    """The two calls of safetensors' ``safe_open`` handle :func:`reference_tensors` makes,
    for an object in storage: each tensor fetched whole by the offsets of its header."""

    def __init__(self, tensors: Mapping[str, TensorInfo]) -> None:
        self._tensors = tensors

    def get_tensor(self, name: str) -> torch.Tensor:
        from rayload.loading.dtypes import torch_dtype

        info = self._tensors[name]
        data = bytearray(storage_for(info.file).read(info.file, info.start, info.nbytes))
        flat = (
            torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(torch_dtype(info.dtype)).reshape(info.shape)

    get_slice = get_tensor  # a whole tensor takes the same index as safetensors' slice


def reference_tensors(
    rank: RankPlan, tensors: Mapping[str, TensorInfo] | None = None
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors as its plan describes them, read with safetensors (from
    object storage: by ranged GETs of ``tensors``, the checkpoint's, see the module doc)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[str, Any] = {}
        for shard in rank.shards:
            (path,) = shard.files
            if path not in handles:
                handles[path] = (
                    _RemoteFile(tensors or {})
                    if is_remote(path)
                    else stack.enter_context(safe_open(path, framework="pt"))
                )
            f = handles[path]
            if shard.split is None or not shard.pieces:
                out[shard.name] = f.get_tensor(shard.name).clone()
                continue
            view = f.get_slice(shard.name)
            parts = []
            for start, length in shard.pieces:
                index = [slice(None)] * len(shard.full_shape)
                index[shard.split] = slice(start, start + length)
                parts.append(view[tuple(index)])
            out[shard.name] = torch.cat(parts, dim=shard.split).contiguous()
    return out


def references(
    prep: Prepared, layouts: Iterable[str], tp_sizes: Sequence[int]
) -> dict[RefKey, Outcome]:
    """The reference outcome of every rank of every layout in ``layouts`` and TP size."""
    checkpoint = open_checkpoint(prep.checkpoint)
    out: dict[RefKey, Outcome] = {}
    for layout in layouts:
        for tp in tp_sizes:
            plan = plan_layout(checkpoint, tp, prep.options[layout])
            for rank in plan.ranks:
                tensors = reference_tensors(rank, checkpoint.tensors)
                out[(layout, tp, rank.rank)] = Outcome(
                    digest(tensors), len(tensors), sum(t.nbytes for t in tensors.values())
                )
                del tensors
    return out


def references_jsonable(refs: Mapping[RefKey, Outcome]) -> list[dict[str, Any]]:
    return [
        {"layout": layout, "tp_size": tp, "rank": rank, **o.__dict__}
        for (layout, tp, rank), o in sorted(refs.items())
    ]


def consistency(samples: Iterable[CaseSample], refs: Mapping[RefKey, Outcome]) -> list[str]:
    """Problems found comparing each case with the reference of its layout: every rank of
    every repetition must get the reference's digest, tensor count and bytes. Empty when
    all agree. A rank without a reference to compare with is a problem too."""
    differing: dict[RefKey, dict[Outcome, set[str]]] = defaultdict(lambda: defaultdict(set))
    for s in samples:
        case = CASES[s.case]
        if s.error or case.kind == "limit":
            continue
        for r in s.ranks:
            key = (case.layout, s.tp_size, r.rank)
            got = Outcome(r.digest, r.tensors, r.shard_bytes)
            if refs.get(key) != got:
                differing[key][got].add(f"{s.case}#{s.repetition}/{s.cache}")
    problems = []
    for (layout, tp, rank), outcomes in sorted(differing.items()):
        ref = refs.get((layout, tp, rank))
        want = ref.describe() if ref else "no reference"
        detail = "; ".join(
            f"{', '.join(sorted(who))} -> {got.describe()}" for got, who in outcomes.items()
        )
        problems.append(f"tp={tp} rank {rank} ({layout} layout): reference {want}, but {detail}")
    return problems
