"""``rayload convert``: write a checkpoint pre-sharded for one tp size.

Each rank gets ``model-rank-{rank}-part-{part}.safetensors`` files (vLLM's sharded_state
naming) holding its shards contiguously, so the ``converted`` method reads each rank's
files front to back with large sequential reads instead of one small read per row of
every split-1 tensor. ``rayload-manifest.json`` (see :mod:`rayload.loading.manifest`)
records the tp size, the rules, each rank's files and each file's size and CRC-32.

Shards are read with rayload's own reader (only the rank's byte ranges) in batches of
bounded size, so memory stays bounded whatever the model size. The manifest is written
last: a directory without one is not a converted checkpoint, and a failed conversion
removes what it wrote.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from rayload.errors import CheckpointError, ConfigError
from rayload.loading.checkpoint import INDEX_NAME, Checkpoint, open_checkpoint
from rayload.loading.dtypes import DTYPES
from rayload.loading.manifest import (
    FORMAT_VERSION,
    Crc32,
    FileEntry,
    Manifest,
    rank_file_name,
    write_manifest,
)
from rayload.loading.output import writing_to
from rayload.loading.plan import RankPlan, ShardPlan, TensorShard, plan_shards
from rayload.loading.reader import ReaderOptions
from rayload.loading.reader.readplan import shard_segments
from rayload.loading.reader.reads import read_segments
from rayload.loading.reader.sinks import host_view
from rayload.loading.rules import RulesArg, RuleSet, resolve_rules
from rayload.loading.storage import storage_for

log = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 2 << 30
"""Largest rank file ``convert_checkpoint`` writes (a bigger single tensor gets its own)."""

_BATCH_BYTES = 256 << 20
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges.txt",
)
"""Files next to the weights that an engine needs and ``convert`` copies as they are."""


def convert_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    tp_size: int,
    *,
    rules: RulesArg = None,
    part_bytes: int = DEFAULT_PART_BYTES,
    reader_options: ReaderOptions | None = None,
    expert_parallel: bool = False,
) -> Path:
    """Convert the Hugging Face checkpoint at ``src`` into a ``tp_size``-way pre-sharded
    checkpoint in ``out`` (created; it must not exist or be empty). Returns ``out``.

    ``rules`` and ``expert_parallel`` as for :func:`~rayload.loading.plan.plan_shards`
    (with expert parallel each rank's files hold only its experts). Raises ConfigError for a
    non-empty ``out`` or an already converted ``src``, and the planner's errors for a bad
    checkpoint or rules.
    """
    out_dir = Path(out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(
            f"{out_dir}: output exists and is not an empty directory; choose a new "
            "directory or empty this one"
        )
    if part_bytes < 1:
        raise ConfigError(f"part_bytes must be positive, got {part_bytes}")
    checkpoint = open_checkpoint(src)
    if checkpoint.layout == "converted":
        raise ConfigError(
            f"{checkpoint.root} is already a converted checkpoint (tp_size="
            f"{checkpoint.tp_size}); convert the original Hugging Face checkpoint instead"
        )
    ruleset = resolve_rules(rules, checkpoint.architecture)
    plan = plan_shards(checkpoint, tp_size, rules=ruleset, expert_parallel=expert_parallel)
    options = reader_options or ReaderOptions()

    created = not out_dir.exists()
    with writing_to(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with writing_to(out_dir):
            _write_converted(checkpoint, plan, ruleset, out_dir, part_bytes, options)
    except BaseException:
        _remove_partial(out_dir, created)
        raise
    return out_dir


def _write_converted(
    checkpoint: Checkpoint,
    plan: ShardPlan,
    ruleset: RuleSet,
    out_dir: Path,
    part_bytes: int,
    options: ReaderOptions,
) -> None:
    """Write the rank files, the side files and the manifest into ``out_dir``."""
    ranks: dict[int, list[str]] = {}
    files: dict[str, FileEntry] = {}
    for rank_plan in plan.ranks:
        ranks[rank_plan.rank] = []
        for part, shards in enumerate(_parts(rank_plan, part_bytes)):
            name = rank_file_name(rank_plan.rank, part)
            files[name] = _write_rank_file(out_dir / name, shards, rank_plan, options)
            ranks[rank_plan.rank].append(name)
            log.info("wrote %s (%d tensors)", name, len(shards))
    every = {s.name: s for rank_plan in plan.ranks for s in rank_plan.shards}.values()
    manifest = Manifest.model_validate(
        {
            "format_version": FORMAT_VERSION,
            "tp_size": plan.tp_size,
            "architecture": checkpoint.architecture,
            "rules": [rule.to_spec() for rule in ruleset.rules],
            "ranks": ranks,
            "files": files,
            "splits": dict(plan.splits),
            "full_shapes": {s.name: list(s.full_shape) for s in every},
            "shard_shapes": {s.name: list(s.shape) for s in every},
            "expert_parallel": plan.expert_parallel,
            "experts": dict(enumerate(map(list, plan.experts))) if plan.experts else None,
            "owners": dict(plan.owners) or None,
            "block_size": list(plan.block_size) if plan.block_size else None,
        }
    )
    _copy_side_files(checkpoint.root, out_dir)
    write_manifest(manifest, out_dir)


def _parts(plan: RankPlan, part_bytes: int) -> Iterator[list[TensorShard]]:
    """The rank's shards cut into consecutive groups of at most ``part_bytes`` (a bigger
    shard is a part of its own). A rank with no tensors still gets one (empty) file."""
    part: list[TensorShard] = []
    size = 0
    for shard in plan.shards:
        if part and size + shard.nbytes > part_bytes:
            yield part
            part, size = [], 0
        part.append(shard)
        size += shard.nbytes
    yield part


def _write_rank_file(
    path: Path, shards: Sequence[TensorShard], plan: RankPlan, options: ReaderOptions
) -> FileEntry:
    """Write ``shards`` as one safetensors file; returns its size and CRC-32.

    Tensors are stored by element size, largest first, after a header padded to 8 bytes,
    so every tensor starts at a multiple of its element size (zero-copy views work).
    """
    ordered = sorted(shards, key=lambda s: -DTYPES[s.dtype][1])
    header: dict[str, object] = {
        "__metadata__": {
            "format": "pt",
            "rayload.rank": str(plan.rank),
            "rayload.tp_size": str(plan.tp_size),
        }
    }
    offset = 0
    for shard in ordered:
        header[shard.name] = {
            "dtype": shard.dtype,
            "shape": list(shard.shape),
            "data_offsets": [offset, offset + shard.nbytes],
        }
        offset += shard.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    crc = Crc32()
    size = 0
    with open(path, "wb") as f:
        for chunk in (len(raw).to_bytes(8, "little"), raw):
            size += _write(f, memoryview(chunk), crc)
        for batch in _batches(ordered):
            for buffer in _read_batch(batch, options):
                size += _write(f, host_view(buffer), crc)
    return FileEntry(size=size, crc32=crc.hexdigest())


def _read_batch(batch: Sequence[TensorShard], options: ReaderOptions) -> list[torch.Tensor]:
    """The source bytes of ``batch``, one CPU buffer per shard. A failed read is the
    source checkpoint's problem (CheckpointError), not the output's."""
    segments = shard_segments(batch)
    try:
        buffers, _, _ = read_segments(
            segments, [s.nbytes for s in batch], torch.device("cpu"), options
        )
    except OSError as exc:
        file = segments[0].file if segments else "?"
        raise CheckpointError(
            f"{file}: cannot read tensor data ({exc.strerror or exc}); check the source "
            "checkpoint's storage",
            file=file,
        ) from exc
    return buffers


def _batches(shards: Sequence[TensorShard]) -> Iterator[list[TensorShard]]:
    """Consecutive groups of about ``_BATCH_BYTES``: read in parallel, then written."""
    batch: list[TensorShard] = []
    size = 0
    for shard in shards:
        if batch and size + shard.nbytes > _BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(shard)
        size += shard.nbytes
    if batch:
        yield batch


def _write(f: BinaryIO, data: memoryview, crc: Crc32) -> int:
    crc.update(data)
    f.write(data)
    return len(data)


def _copy_side_files(src_root: str, out_dir: Path) -> None:
    """Copy the side files (:data:`_SIDE_FILES`) of ``src_root``, a local directory or an
    ``s3://`` prefix, into ``out_dir``."""
    storage = storage_for(src_root)
    if not storage.is_dir(src_root):
        return
    for name in storage.listdir(src_root):
        path = storage.join(src_root, name)
        side = any(fnmatch.fnmatch(name, pattern) for pattern in _SIDE_FILES)
        if not side or name == INDEX_NAME or not storage.is_file(path):
            continue
        if storage.kind == "file":
            shutil.copy2(path, out_dir / name)
        else:
            (out_dir / name).write_bytes(storage.read_all(path))


def _remove_partial(out_dir: Path, created: bool) -> None:
    """Undo a failed conversion: ``out_dir`` was empty or absent before."""
    targets = [out_dir] if created else list(out_dir.iterdir())
    for target in targets:
        try:
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove %s after the failed conversion: %s", target, exc)
