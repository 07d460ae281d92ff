"""Shard planning: which exact byte ranges each TP rank reads.

A plan is pure data computed from headers and sharding rules; backends execute it. This
module holds the plan's types and :func:`plan_shards`, which hands a checkpoint to its
planner: :mod:`rayload.loading.plan_hf` cuts a Hugging Face checkpoint by its rules,
:mod:`rayload.loading.plan_converted` reads the shards a converted one already holds.

Byte layout of a shard, for a row-major tensor of shape ``(d0, d1, *rest)`` cut ``tp`` ways:

* split 0: rank ``r`` holds rows ``[r*d0/tp, (r+1)*d0/tp)``, one contiguous range;
* split 1: every row ``i`` of the ``d0 x (d1 * rest)`` view contributes the contiguous block
  of columns ``[r*d1/tp, (r+1)*d1/tp)`` (with all of ``rest``): ``d0`` ranges of
  ``d1/tp * prod(rest) * itemsize`` bytes, one row stride apart (one range when tp is 1);
* replicated: the whole tensor.

A rule with ``parts`` (:mod:`rayload.loading.heads`) cuts the split dimension in whole
attention heads, or per fused component: a rank's shard is then the concatenation of its
pieces of that dimension, one byte range per piece for split 0 (per row and piece for
split 1), still only the rank's bytes. With fewer KV heads than ranks, the ranks that
share a KV head each read it (the plan counts those bytes, ``replicated_head_bytes``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

from rayload.loading.checkpoint import Checkpoint, TensorInfo, open_checkpoint
from rayload.loading.dtypes import ITEMSIZE
from rayload.loading.heads import HeadLayout, Piece
from rayload.loading.rules import RulesArg, resolve_rules
from rayload.options import check_tp_size


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

    ``split`` is the dimension cut across ranks (0 or 1) or None when replicated;
    ``pieces`` the ``(start, length)`` runs of that dimension the shard holds, in order
    (one for a plain split, one per fused component, empty when replicated or when the
    tensor is already a shard, as in a converted checkpoint). ``ranges`` list the file
    bytes that hold this rank's shard, in the order they appear in the shard's row-major
    layout (a split-1 tensor has one range per row, coalesced where
    rows touch; :func:`plan_shards` gives those as a compact :class:`RowRanges`). The
    concatenation of the ranges is exactly the shard's bytes.
    """

    name: str
    dtype: str
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    split: int | None
    ranges: Sequence[ByteRange]
    pieces: tuple[Piece, ...] = ()

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
    ``manifest`` for a converted checkpoint, or ``none``); ``heads`` the attention heads
    config.json declares (None when it declares none) and ``kv_replicas`` how many ranks
    hold each KV head (1 unless there are fewer KV heads than ranks). With expert parallel,
    ``experts[r]`` are the experts rank ``r`` holds and ``owners`` maps each of their
    tensors to it (those tensors are in that rank's plan only); ``block_size`` is the
    quantization block size of config.json, when it gives one.
    """

    tp_size: int
    ranks: tuple[RankPlan, ...]
    splits: Mapping[str, int | None]
    checkpoint_bytes: int  # tensor bytes of the unsharded model (headers excluded)
    unmatched: tuple[str, ...] = ()
    rules_source: str = ""
    layout: str = ""
    unused_rules: tuple[str, ...] = ()  # patterns of the user's rules that matched nothing
    heads: HeadLayout | None = None
    kv_replicas: int = 1
    owners: Mapping[str, int] = field(default_factory=dict)
    experts: tuple[tuple[int, ...], ...] = ()
    block_size: tuple[int, ...] | None = None

    @property
    def expert_parallel(self) -> bool:
        """Whether the experts are divided among the ranks (``experts[r]``: rank r's)."""
        return bool(self.experts)

    def expert_bytes(self, rank: int) -> int:
        """Bytes of the experts' tensors rank ``rank`` holds alone (expert parallel)."""
        return sum(s.nbytes for s in self.ranks[rank].shards if s.name in self.owners)

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
        return sum(
            s.nbytes for s in self.ranks[0].shards if s.split is None and s.name not in self.owners
        )

    @property
    def replicated_head_bytes(self) -> int:
        """Bytes of split tensors read by more than one rank, beyond the first copy: the
        KV heads that ranks share when there are fewer KV heads than ranks."""
        split = [s for rank in self.ranks for s in rank.shards if s.split is not None]
        full = sum(
            math.prod(s.full_shape) * ITEMSIZE[s.dtype]
            for s in self.ranks[0].shards
            if s.split is not None
        )
        return sum(s.nbytes for s in split) - full if self.layout != "converted" else 0

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
    path: str | os.PathLike[str] | Checkpoint,
    tp_size: int,
    *,
    rules: RulesArg = None,
    expert_parallel: bool = False,
) -> ShardPlan:
    """Plan every rank of ``tp_size`` for the checkpoint at ``path`` (a path or a
    :class:`~rayload.loading.checkpoint.Checkpoint`). ``rules`` is a rules file path, a
    rules object, or None for the preset matching config.json ``architectures``.
    ``expert_parallel`` divides the experts among the ranks, whole, instead of splitting
    each one (:mod:`rayload.loading.experts`).

    Raises ConfigError for a bad ``tp_size`` or rules, ShardingError for a tensor the
    rules cannot split ``tp_size`` ways, CheckpointError for a bad checkpoint or one
    converted for another tp size.
    """
    # The planners build this module's types, so they are imported here, not above.
    from rayload.loading.plan_converted import plan_converted
    from rayload.loading.plan_hf import plan_hf

    check_tp_size(tp_size)
    checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    if checkpoint.layout == "converted":
        return plan_converted(checkpoint, tp_size, rules, expert_parallel)
    return plan_hf(
        checkpoint, tp_size, resolve_rules(rules, checkpoint.architecture), expert_parallel
    )


def same_plan_problem(loaded: ShardPlan, new: ShardPlan) -> tuple[str, str] | None:
    """Why ``new`` cannot be read into the tensors ``loaded`` made, as ``(tensor,
    message)``, or None when every rank has the same tensors, in the same order, with the
    same shapes and dtypes. The message names the first tensor that differs."""
    if loaded.tp_size != new.tp_size:
        return (
            "",
            f"the checkpoint is planned for tp_size {new.tp_size}, the load has {loaded.tp_size}",
        )
    for old_rank, new_rank in zip(loaded.ranks, new.ranks, strict=True):
        old_shards = {s.name: s for s in old_rank.shards}
        new_shards = {s.name: s for s in new_rank.shards}
        for name, shard in new_shards.items():
            old = old_shards.get(name)
            if old is None:
                return (
                    name,
                    f"rank {new_rank.rank}: tensor {name!r} is new (the load has no such tensor)",
                )
            if (old.shape, old.dtype) != (shard.shape, shard.dtype):
                return name, (
                    f"rank {new_rank.rank}: tensor {name!r} is {shard.dtype} "
                    f"{list(shard.shape)}, the loaded one is {old.dtype} {list(old.shape)}"
                )
        for name in old_shards:
            if name not in new_shards:
                return name, f"rank {new_rank.rank}: tensor {name!r} is missing"
    return None


def in_file_order(files: tuple[str, ...], tensors: Iterable[TensorInfo]) -> list[TensorInfo]:
    """``tensors`` in the order their bytes lie in ``files``: the order a plan lists them."""
    order = {f: i for i, f in enumerate(files)}
    return sorted(tensors, key=lambda t: (order[t.file], t.start))
