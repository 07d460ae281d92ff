"""The plan of a converted checkpoint (``rayload convert``): each rank reads its own rank
files whole, checked against the manifest's tp size, shapes and expert layout.
"""

from __future__ import annotations

import math
import os

from rayload.errors import CheckpointError, ConfigError
from rayload.loading.checkpoint import Checkpoint, TensorInfo
from rayload.loading.dtypes import ITEMSIZE
from rayload.loading.manifest import MANIFEST_NAME, Manifest
from rayload.loading.plan import ByteRange, RankPlan, ShardPlan, TensorShard, in_file_order
from rayload.loading.rules import RulesArg


def plan_converted(
    checkpoint: Checkpoint, tp_size: int, rules: RulesArg, expert_parallel: bool
) -> ShardPlan:
    """Every rank's plan: its rank files' tensors, whole. ConfigError when ``rules`` or
    ``expert_parallel`` contradict the conversion, CheckpointError for another tp size or
    a shape the manifest does not give."""
    manifest = checkpoint.manifest
    assert manifest is not None and checkpoint.rank_files is not None
    check_converted_tp(checkpoint.root, manifest.tp_size, tp_size)
    if rules is not None:
        raise ConfigError(
            f"{checkpoint.root} is a converted checkpoint: its sharding rules were fixed by "
            f"`rayload convert`; drop the rules, or convert again with them"
        )
    if expert_parallel != manifest.expert_parallel:
        asked, made = ("with", "without") if expert_parallel else ("without", "with")
        raise ConfigError(
            f"{checkpoint.root} was converted {made} expert parallel; load it {made} "
            f"--expert-parallel, or convert the original again {asked} it"
        )
    ranks = []
    dtypes: dict[str, str] = {}
    for rank in range(tp_size):
        tensors = in_file_order(checkpoint.rank_files[rank], checkpoint.rank_tensors(rank).values())
        dtypes.update((t.name, t.dtype) for t in tensors)
        for t in tensors:
            _check_converted_shape(t, manifest, rank)
        shards = tuple(
            TensorShard(
                name=t.name,
                dtype=t.dtype,
                full_shape=tuple(manifest.full_shapes[t.name]),
                shape=t.shape,
                split=manifest.splits[t.name],
                ranges=(ByteRange(t.file, t.start, t.nbytes),),
            )
            for t in tensors
        )
        ranks.append(RankPlan(rank, tp_size, shards))
    full_bytes = sum(
        math.prod(manifest.full_shapes[name]) * ITEMSIZE[dtype] for name, dtype in dtypes.items()
    )
    return ShardPlan(
        tp_size=tp_size,
        ranks=tuple(ranks),
        splits=dict(manifest.splits),
        checkpoint_bytes=full_bytes,
        rules_source="manifest",
        layout=checkpoint.layout,
        owners=dict(manifest.owners or {}),
        experts=tuple(tuple(manifest.experts[r]) for r in range(tp_size))
        if manifest.experts
        else (),
        block_size=tuple(manifest.block_size) if manifest.block_size else None,
    )


def _check_converted_shape(info: TensorInfo, manifest: Manifest, rank: int) -> None:
    """CheckpointError naming the file and tensor when a converted rank file holds a tensor
    of another shape than its manifest says (its shard shape, or the full shape cut evenly
    on its split for manifests written before shard shapes were recorded)."""
    if manifest.shard_shapes is not None and info.name in manifest.shard_shapes:
        expected = tuple(manifest.shard_shapes[info.name])
    else:
        expected = shard_shape(
            tuple(manifest.full_shapes[info.name]), manifest.splits[info.name], manifest.tp_size
        )
    if info.shape != expected:
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} of rank {rank} has shape {list(info.shape)}, "
            f"but the manifest's full shape and split give {list(expected)}; "
            f"re-run `rayload convert`",
            file=info.file,
            tensor=info.name,
        )


def check_converted_tp(root: str, converted_tp: int | None, tp_size: int) -> None:
    """CheckpointError naming the manifest when the checkpoint at ``root`` was converted
    (``converted_tp`` is not None) for another tp size than ``tp_size``."""
    if converted_tp is not None and converted_tp != tp_size:
        manifest = os.path.join(root, MANIFEST_NAME)
        raise CheckpointError(
            f"{manifest}: checkpoint was converted for tp_size={converted_tp}, not "
            f"{tp_size}; load it with --tp {converted_tp} or convert the original "
            f"checkpoint again with `rayload convert SRC OUT --tp {tp_size}`",
            file=manifest,
        )


def shard_shape(full_shape: tuple[int, ...], split: int | None, tp_size: int) -> tuple[int, ...]:
    """The shape of one rank's shard of a ``full_shape`` tensor cut evenly on ``split``
    (divisibility is the caller's check)."""
    if split is None or split >= len(full_shape):
        return full_shape
    return (*full_shape[:split], full_shape[split] // tp_size, *full_shape[split + 1 :])
