"""Shard planning: which exact byte ranges each TP rank reads.

A plan is pure data computed from headers and sharding rules; backends execute it.

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

import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

from rayload.errors import CheckpointError, ConfigError, ShardingError
from rayload.loading.checkpoint import Checkpoint, TensorInfo, open_checkpoint
from rayload.loading.dtypes import ITEMSIZE
from rayload.loading.experts import expert_layout
from rayload.loading.heads import HeadError, HeadLayout, Piece, kv_replicas, rank_pieces
from rayload.loading.manifest import MANIFEST_NAME, Manifest
from rayload.loading.rules import Rule, RulesArg, RuleSet, resolve_rules, unused_rule_message
from rayload.loading.scales import block_size, is_scale, scale_pieces, scaled_weight
from rayload.options import check_tp_size

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
    check_tp_size(tp_size)
    checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    if checkpoint.layout == "converted":
        return _plan_converted(checkpoint, tp_size, rules, expert_parallel)
    ruleset = resolve_rules(rules, checkpoint.architecture)
    return _plan_hf(checkpoint, tp_size, ruleset, expert_parallel)


@dataclass
class _Cut:
    """How one tensor is cut: its split, every rank's pieces (None when whole), and the
    rank that owns it alone (an expert's tensor under expert parallel)."""

    split: int | None
    pieces: list[tuple[Piece, ...]] | None = None
    owner: int | None = None


def _plan_hf(
    checkpoint: Checkpoint, tp_size: int, ruleset: RuleSet, expert_parallel: bool
) -> ShardPlan:
    tensors = _in_file_order(checkpoint.files, checkpoint.tensors.values())
    by_name = {t.name: t for t in tensors}
    heads = HeadLayout.from_config(checkpoint.config)
    rules = {t.name: ruleset.match(t.name) for t in tensors}
    followers = {
        t.name: weight
        for t in tensors
        if rules[t.name] is None and (weight := scaled_weight(t.name, by_name))
    }
    experts = None
    if expert_parallel:
        ids = {n: e for n, rule in rules.items() if rule and (e := rule.expert_id(n)) is not None}
        experts = expert_layout(checkpoint.config, ids.values(), tp_size, root=checkpoint.root)
    cuts: dict[str, _Cut] = {}
    unmatched: list[str] = []
    headless: list[str] = []
    for info in tensors:
        rule = rules[info.name]
        if info.name in followers:
            continue
        if rule is None:
            if not (is_scale(info.name) and math.prod(info.shape) <= 1):
                unmatched.append(info.name)  # per-tensor scales are replicated by design
            cuts[info.name] = _Cut(None)
        elif experts is not None and (expert := rule.expert_id(info.name)) is not None:
            cuts[info.name] = _Cut(None, owner=experts.owner(expert))
        elif rule.split is None:
            cuts[info.name] = _Cut(None)
        else:
            cuts[info.name] = _Cut(rule.split, _rank_pieces(info, rule, heads, tp_size))
            if heads is None and {"q", "kv", "heads"} & set(rule.parts):
                headless.append(info.name)
    block = block_size(checkpoint.config)
    for name, weight in followers.items():
        cuts[name] = _following_cut(by_name[name], by_name[weight], cuts[weight], block)
    if headless and tp_size > 1:
        log.warning(
            "%s: config.json declares no attention heads, so %d head-split tensors (e.g. "
            "%s) are cut evenly, which may cut a head; add num_attention_heads to config.json",
            checkpoint.root,
            len(headless),
            headless[0],
        )
    ranks = tuple(
        RankPlan(
            rank,
            tp_size,
            tuple(
                _shard(t, cut.split, cut.pieces[rank] if cut.pieces else ())
                for t in tensors
                if (cut := cuts[t.name]).owner in (None, rank)
            ),
        )
        for rank in range(tp_size)
    )
    splits = {name: cut.split for name, cut in cuts.items()}
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
        heads=heads,
        kv_replicas=kv_replicas(heads, tp_size) if _has_kv_rule(ruleset, splits) else 1,
        owners={n: cut.owner for n, cut in cuts.items() if cut.owner is not None},
        experts=tuple(experts.of_rank(r) for r in range(tp_size)) if experts else (),
        block_size=block,
    )


def _following_cut(
    scale: TensorInfo, weight: TensorInfo, cut: _Cut, block: tuple[int, ...] | None
) -> _Cut:
    """The cut of ``scale``, a quantization scale of ``weight``: the weight's owner, and
    its split in whole blocks (replicated when it is one number or the weight is whole)."""
    if cut.split is None or cut.pieces is None or math.prod(scale.shape) <= 1:
        return _Cut(None, owner=cut.owner)
    if len(scale.shape) != len(weight.shape):
        raise ShardingError(
            f"tensor {scale.name!r} in {scale.file}: a scale of shape {list(scale.shape)} for "
            f"the weight {weight.name!r} of shape {list(weight.shape)}, split on dimension "
            f"{cut.split}: rayload cannot tell which of its elements go with which rank; "
            "replicate it with a rules file",
            tensor=scale.name,
            file=scale.file,
        )
    try:
        pieces = [
            scale_pieces(scale.shape, weight.shape, cut.split, ranked, block)[0]
            for ranked in cut.pieces
        ]
    except HeadError as exc:
        tp = len(cut.pieces)
        raise ShardingError(
            f"tensor {scale.name!r} in {scale.file} (scales of {weight.name!r}, tp={tp}): {exc}",
            tensor=scale.name,
            file=scale.file,
        ) from exc
    return _Cut(cut.split, pieces, cut.owner)


def _has_kv_rule(ruleset: RuleSet, names: Iterable[str]) -> bool:
    return any("kv" in rule.parts for name in names if (rule := ruleset.match(name)))


def _plan_converted(
    checkpoint: Checkpoint, tp_size: int, rules: RulesArg, expert_parallel: bool
) -> ShardPlan:
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
        tensors = _in_file_order(
            checkpoint.rank_files[rank], checkpoint.rank_tensors(rank).values()
        )
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


def _in_file_order(files: tuple[str, ...], tensors: Iterable[TensorInfo]) -> list[TensorInfo]:
    order = {f: i for i, f in enumerate(files)}
    return sorted(tensors, key=lambda t: (order[t.file], t.start))


def _rank_pieces(
    info: TensorInfo, rule: Rule, heads: HeadLayout | None, tp_size: int
) -> list[tuple[Piece, ...]]:
    """Every rank's pieces of ``info``'s split dimension; ShardingError naming the tensor
    when the rule cannot split it ``tp_size`` ways."""
    split = rule.split
    assert split is not None
    where = f"tensor {info.name!r} in {info.file}"
    if split >= len(info.shape):
        raise ShardingError(
            f"{where} has shape {list(info.shape)}: it has no dimension {split} to split; "
            f"fix the sharding rule that matches it (split 0 or replicate)",
            tensor=info.name,
            file=info.file,
        )
    size = info.shape[split]
    if not rule.parts and size % tp_size:
        raise ShardingError(
            f"{where}: dimension {split} has size {size}, not divisible by tp={tp_size}; "
            f"choose a tp size that divides it, or replicate the tensor with a rules file",
            tensor=info.name,
            file=info.file,
        )
    try:
        return [
            rank_pieces(rule.parts, size, heads, rule.head_size, tp_size, rank)
            for rank in range(tp_size)
        ]
    except HeadError as exc:
        raise ShardingError(
            f"{where} (dimension {split}, parts {'/'.join(rule.parts) or 'even'}): {exc}",
            tensor=info.name,
            file=info.file,
        ) from exc


def tensor_shard(info: TensorInfo, split: int | None, pieces: tuple[Piece, ...]) -> TensorShard:
    """A rank's shard of ``info`` made of its ``pieces`` (``(start, length)`` runs) of
    dimension ``split`` (None: the whole tensor): how an engine with its own layout of a
    tensor (vLLM's padded vocabulary) re-plans it."""
    return _shard(info, split, pieces)


def _shard(info: TensorInfo, split: int | None, pieces: tuple[Piece, ...]) -> TensorShard:
    """A rank's shard of ``info``: its ``pieces`` of dimension ``split`` (checked)."""
    itemsize = ITEMSIZE[info.dtype]
    if split is None:
        ranges: Sequence[ByteRange] = (ByteRange(info.file, info.start, info.nbytes),)
        return TensorShard(info.name, info.dtype, info.shape, info.shape, None, ranges)
    shape = (*info.shape[:split], sum(n for _, n in pieces), *info.shape[split + 1 :])
    if split == 0:
        row = math.prod(info.shape[1:]) * itemsize
        ranges = tuple(ByteRange(info.file, info.start + s * row, n * row) for s, n in pieces)
    else:
        inner = math.prod(info.shape[2:]) * itemsize
        stride = info.shape[1] * inner
        rows = info.shape[0]
        if len(pieces) > 1:
            ranges = tuple(
                ByteRange(info.file, info.start + i * stride + s * inner, n * inner)
                for i in range(rows)
                for s, n in pieces
            )
        else:
            start, block = pieces[0][0] * inner, pieces[0][1] * inner
            if block == stride or rows == 1:
                ranges = (ByteRange(info.file, info.start + start, block * rows),)
            else:
                ranges = RowRanges(info.file, info.start + start, block, stride, rows)
    return TensorShard(info.name, info.dtype, info.shape, shape, split, ranges, pieces)
