"""Shard planning: which exact byte ranges each TP rank reads.

A plan is pure data computed from headers and sharding rules; backends execute it.

Byte layout of a shard, for a row-major tensor of shape ``(d0, d1, *rest)`` cut ``tp`` ways:

* split 0: rank ``r`` holds rows ``[r*d0/tp, (r+1)*d0/tp)``, one contiguous range;
* split 1: every row ``i`` of the ``d0 x (d1 * rest)`` view contributes the contiguous block
  of columns ``[r*d1/tp, (r+1)*d1/tp)`` (with all of ``rest``): ``d0`` ranges of
  ``d1/tp * prod(rest) * itemsize`` bytes, one row stride apart (one range when tp is 1);
* replicated: the whole tensor.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

from rayload.errors import ConfigError, ShardingError
from rayload.loading.checkpoint import (
    Checkpoint,
    TensorInfo,
    check_converted_tp,
    open_checkpoint,
    shard_shape,
)
from rayload.loading.dtypes import ITEMSIZE
from rayload.loading.rules import RulesArg, RuleSet, resolve_rules, unused_rule_message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ByteRange:
    """``length`` bytes at absolute ``offset`` of ``file``."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True, eq=False)
class RowRanges(Sequence[ByteRange]):
    """``rows`` ranges of ``length`` bytes, ``stride`` bytes apart from ``offset`` in
    ``file``: the rows of a split-1 shard.

    A sequence of :class:`ByteRange` that stores five numbers instead of one object per
    row, so a plan stays small and quick to build and pickle whatever the row count
    (a 70B model has millions of split-1 rows per rank). It compares equal to any sequence
    of the same ranges; readers that want the rows as one strided read use the fields.
    """

    file: str
    offset: int
    length: int
    stride: int
    rows: int

    def __len__(self) -> int:
        return self.rows

    @overload
    def __getitem__(self, index: int) -> ByteRange: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[ByteRange, ...]: ...
    def __getitem__(self, index: int | slice) -> ByteRange | tuple[ByteRange, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self.rows)))
        if index < 0:
            index += self.rows
        if not 0 <= index < self.rows:
            raise IndexError(f"row {index} of {self.rows}")
        return ByteRange(self.file, self.offset + index * self.stride, self.length)

    def __iter__(self) -> Iterator[ByteRange]:
        for i in range(self.rows):
            yield ByteRange(self.file, self.offset + i * self.stride, self.length)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RowRanges):
            return _fields(self) == _fields(other)
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == self.rows and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    @property
    def nbytes(self) -> int:
        return self.length * self.rows


def _fields(r: RowRanges) -> tuple[str, int, int, int, int]:
    return (r.file, r.offset, r.length, r.stride, r.rows)


@dataclass(frozen=True)
class TensorShard:
    """One tensor as one rank sees it.

    ``split`` is the dimension cut across ranks (0 or 1) or None when replicated.
    ``ranges`` list the file bytes that hold this rank's shard, in the order they appear in
    the shard's row-major layout (a split-1 tensor has one range per row, coalesced where
    rows touch; :func:`plan_shards` gives those as a compact :class:`RowRanges`). The
    concatenation of the ranges is exactly the shard's bytes.
    """

    name: str
    dtype: str
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    split: int | None
    ranges: Sequence[ByteRange]

    @property
    def nbytes(self) -> int:
        if isinstance(self.ranges, RowRanges):
            return self.ranges.nbytes
        return sum(r.length for r in self.ranges)

    @property
    def files(self) -> tuple[str, ...]:
        """The files the shard's bytes are in (one, for every plan rayload makes)."""
        if isinstance(self.ranges, RowRanges):
            return (self.ranges.file,)
        return tuple(dict.fromkeys(r.file for r in self.ranges))


@dataclass(frozen=True)
class RankPlan:
    """Everything rank ``rank`` of ``tp_size`` reads, tensors in file order."""

    rank: int
    tp_size: int
    shards: tuple[TensorShard, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f for s in self.shards for f in s.files))


@dataclass(frozen=True)
class ShardPlan:
    """The plan of every rank, plus what sharding costs.

    ``unmatched`` names the tensors replicated only because no rule matched them;
    ``unused_rules`` the patterns of the user's rules that matched no tensor;
    ``rules_source`` says which rules were used (``preset:<arch>``, a file path,
    ``manifest`` for a converted checkpoint, or ``none``).
    """

    tp_size: int
    ranks: tuple[RankPlan, ...]
    splits: Mapping[str, int | None]
    checkpoint_bytes: int  # tensor bytes of the unsharded model (headers excluded)
    unmatched: tuple[str, ...] = ()
    rules_source: str = ""
    layout: str = ""
    unused_rules: tuple[str, ...] = ()  # patterns of the user's rules that matched nothing

    def split_dim(self, name: str) -> int | None:
        """0, 1 or None (replicated) for tensor ``name``; KeyError if unknown."""
        return self.splits[name]

    @property
    def rank_bytes(self) -> tuple[int, ...]:
        """Bytes each rank reads, by rank."""
        return tuple(rank.nbytes for rank in self.ranks)

    @property
    def replicated_bytes(self) -> int:
        """Bytes every rank reads in full (counted once)."""
        return sum(s.nbytes for s in self.ranks[0].shards if s.split is None)

    @property
    def unmatched_bytes(self) -> int:
        """Bytes of the tensors replicated because no rule matched (counted once)."""
        names = set(self.unmatched)
        return sum(s.nbytes for s in self.ranks[0].shards if s.name in names)

    @property
    def read_amplification(self) -> float:
        """Bytes read by all ranks together / checkpoint bytes (1.0 for tp 1, or when
        nothing is replicated)."""
        if self.checkpoint_bytes == 0:
            return 1.0
        return sum(self.rank_bytes) / self.checkpoint_bytes


def plan_shards(
    path: str | os.PathLike[str] | Checkpoint, tp_size: int, *, rules: RulesArg = None
) -> ShardPlan:
    """Plan every rank of ``tp_size`` for the checkpoint at ``path`` (a path or a
    :class:`~rayload.loading.checkpoint.Checkpoint`). ``rules`` is a rules file path, a
    rules object, or None for the preset matching config.json ``architectures``.

    Raises ConfigError for a bad ``tp_size`` or rules, ShardingError for a tensor the
    rules cannot split ``tp_size`` ways, CheckpointError for a bad checkpoint or one
    converted for another tp size.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
    checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    if checkpoint.layout == "converted":
        return _plan_converted(checkpoint, tp_size, rules)
    ruleset = resolve_rules(rules, checkpoint.architecture)
    return _plan_hf(checkpoint, tp_size, ruleset)


def _plan_hf(checkpoint: Checkpoint, tp_size: int, ruleset: RuleSet) -> ShardPlan:
    tensors = _in_file_order(checkpoint.files, checkpoint.tensors.values())
    splits: dict[str, int | None] = {}
    unmatched: list[str] = []
    for info in tensors:
        rule = ruleset.match(info.name)
        if rule is None:
            unmatched.append(info.name)
        splits[info.name] = rule.split if rule else None
        _check_splittable(info, splits[info.name], tp_size)
    ranks = tuple(
        RankPlan(rank, tp_size, tuple(_shard(t, splits[t.name], rank, tp_size) for t in tensors))
        for rank in range(tp_size)
    )
    unused = ruleset.unused_user_rules(splits)
    for rule in unused:
        log.warning(
            "%s (%s): %s", checkpoint.root, ruleset.source, unused_rule_message(rule.pattern)
        )
    return ShardPlan(
        tp_size=tp_size,
        ranks=ranks,
        splits=splits,
        checkpoint_bytes=sum(t.nbytes for t in tensors),
        unmatched=tuple(unmatched),
        rules_source=ruleset.source,
        layout=checkpoint.layout,
        unused_rules=tuple(rule.pattern for rule in unused),
    )


def _plan_converted(checkpoint: Checkpoint, tp_size: int, rules: RulesArg) -> ShardPlan:
    manifest = checkpoint.manifest
    assert manifest is not None and checkpoint.rank_files is not None
    check_converted_tp(checkpoint.root, manifest.tp_size, tp_size)
    if rules is not None:
        raise ConfigError(
            f"{checkpoint.root} is a converted checkpoint: its sharding rules were fixed by "
            f"`rayload convert`; drop the rules, or convert again with them"
        )
    ranks = []
    for rank in range(tp_size):
        tensors = _in_file_order(
            checkpoint.rank_files[rank], checkpoint.rank_tensors(rank).values()
        )
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
        math.prod(manifest.full_shapes[t.name]) * ITEMSIZE[t.dtype]
        for t in checkpoint.rank_tensors(0).values()
    )
    return ShardPlan(
        tp_size=tp_size,
        ranks=tuple(ranks),
        splits=dict(manifest.splits),
        checkpoint_bytes=full_bytes,
        rules_source="manifest",
        layout=checkpoint.layout,
    )


def _in_file_order(files: tuple[str, ...], tensors: Iterable[TensorInfo]) -> list[TensorInfo]:
    order = {f: i for i, f in enumerate(files)}
    return sorted(tensors, key=lambda t: (order[t.file], t.start))


def _check_splittable(info: TensorInfo, split: int | None, tp_size: int) -> None:
    if split is None:
        return
    where = f"tensor {info.name!r} in {info.file}"
    if split >= len(info.shape):
        raise ShardingError(
            f"{where} has shape {list(info.shape)}: it has no dimension {split} to split; "
            f"fix the sharding rule that matches it (split 0 or replicate)",
            tensor=info.name,
            file=info.file,
        )
    size = info.shape[split]
    if size % tp_size:
        raise ShardingError(
            f"{where}: dimension {split} has size {size}, not divisible by tp={tp_size}; "
            f"choose a tp size that divides it, or replicate the tensor with a rules file",
            tensor=info.name,
            file=info.file,
        )


def _shard(info: TensorInfo, split: int | None, rank: int, tp_size: int) -> TensorShard:
    """Rank ``rank``'s shard of ``info`` (splittability already checked)."""
    itemsize = ITEMSIZE[info.dtype]
    shape = shard_shape(info.shape, split, tp_size)
    if split is None:
        ranges: Sequence[ByteRange] = (ByteRange(info.file, info.start, info.nbytes),)
    elif split == 0:
        length = math.prod(shape) * itemsize
        ranges = (ByteRange(info.file, info.start + rank * length, length),)
    else:
        inner = math.prod(info.shape[2:]) * itemsize
        block = shape[1] * inner
        stride = info.shape[1] * inner
        rows = info.shape[0]
        if block == stride or rows == 1:
            ranges = (ByteRange(info.file, info.start + rank * block, block * rows),)
        else:
            ranges = RowRanges(info.file, info.start + rank * block, block, stride, rows)
    return TensorShard(info.name, info.dtype, info.shape, shape, split, ranges)
