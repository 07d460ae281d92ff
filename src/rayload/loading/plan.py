"""Shard planning: which exact byte ranges each TP rank reads.

A plan is pure data computed from headers and sharding rules; backends execute it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ByteRange:
    """``length`` bytes at absolute ``offset`` of ``file``."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class TensorShard:
    """One tensor as one rank sees it.

    ``split`` is the dimension cut across ranks (0 or 1) or None when replicated.
    ``ranges`` list the file bytes that hold this rank's shard, in the order they appear in
    the shard's row-major layout (a split-1 tensor has one range per row, coalesced where
    rows touch). The concatenation of the ranges is exactly the shard's bytes.
    """

    name: str
    dtype: str
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    split: int | None
    ranges: tuple[ByteRange, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.length for r in self.ranges)


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
        return tuple(dict.fromkeys(r.file for s in self.shards for r in s.ranges))


@dataclass(frozen=True)
class ShardPlan:
    """The plan of every rank, plus what sharding costs."""

    tp_size: int
    ranks: tuple[RankPlan, ...]
    splits: Mapping[str, int | None]
    checkpoint_bytes: int  # tensor bytes in the checkpoint (headers excluded)

    def split_dim(self, name: str) -> int | None:
        """0, 1 or None (replicated) for tensor ``name``; KeyError if unknown."""
        return self.splits[name]

    @property
    def replicated_bytes(self) -> int:
        """Bytes every rank reads in full (counted once)."""
        raise NotImplementedError

    @property
    def read_amplification(self) -> float:
        """Bytes read by all ranks together / checkpoint bytes."""
        raise NotImplementedError


def plan_shards(path: object, tp_size: int, *, rules: object = None) -> ShardPlan:
    """Plan every rank of ``tp_size`` for the checkpoint at ``path`` (a path or a
    :class:`~rayload.loading.checkpoint.Checkpoint`). ``rules`` is a rules file path, a
    rules object, or None for the preset matching config.json ``architectures``."""
    raise NotImplementedError
