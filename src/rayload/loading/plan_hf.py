"""The plan of a Hugging Face checkpoint: each tensor cut by the sharding rule that matches
it (whole heads, fused components, experts owned by one rank, scales following their
weight), then each rank's byte ranges (module docstring of :mod:`rayload.loading.plan`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rayload.errors import ShardingError
from rayload.loading.checkpoint import Checkpoint, TensorInfo
from rayload.loading.dtypes import ITEMSIZE
from rayload.loading.experts import expert_layout
from rayload.loading.heads import HeadError, HeadLayout, Piece, kv_replicas, rank_pieces
from rayload.loading.plan import (
    ByteRange,
    RankPlan,
    RowRanges,
    ShardPlan,
    TensorShard,
    in_file_order,
)
from rayload.loading.rules import Rule, RuleSet, unused_rule_message
from rayload.loading.scales import block_size, is_scale, scale_pieces, scaled_weight

log = logging.getLogger(__name__)


@dataclass
class _Cut:
    """How one tensor is cut: its split, every rank's pieces (None when whole), and the
    rank that owns it alone (an expert's tensor under expert parallel)."""

    split: int | None
    pieces: list[tuple[Piece, ...]] | None = None
    owner: int | None = None


def plan_hf(
    checkpoint: Checkpoint, tp_size: int, ruleset: RuleSet, expert_parallel: bool
) -> ShardPlan:
    """Plan every rank of ``tp_size`` by ``ruleset``; ShardingError naming the tensor that
    cannot be cut ``tp_size`` ways."""
    tensors = in_file_order(checkpoint.files, checkpoint.tensors.values())
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
