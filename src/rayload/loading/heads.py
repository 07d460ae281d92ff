"""Attention heads and fused components: which rows (or columns) of a split dimension each
rank holds. Pure arithmetic, no I/O.

A rule's ``parts`` lay the split dimension out as consecutive components:

* ``q``: the query heads, ``num_attention_heads * head_dim`` wide, cut in whole heads;
* ``kv``: the key/value heads, ``num_key_value_heads * head_dim`` wide, cut in whole
  heads; with fewer KV heads than ranks each rank holds one whole KV head, head
  ``rank // (tp // kv_heads)``: every KV head is replicated over ``tp / kv_heads`` ranks;
* ``even``: an equal share of what the sized parts leave (gate and up of a fused
  ``gate_up_proj`` are two ``even`` parts), cut evenly;
* ``heads``: like ``even``, but the share holds ``num_attention_heads`` heads of whatever
  width it gives them, cut in whole heads: the projections of multi-head latent attention
  (DeepSeek's ``q_b_proj``, ``kv_b_proj``, ``o_proj``), whose per-head widths are not
  ``head_dim``.

A rank's shard is the concatenation of its piece of each part, in order: vLLM's layout of
``QKVParallelLinear`` (q, then k, then v) and ``MergedColumnParallelLinear`` (gate, then
up). A plain split is one ``even`` part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PARTS = ("q", "kv", "even", "heads")
_SIZED = ("q", "kv")

Piece = tuple[int, int]
"""``(start, length)`` along the split dimension."""


class HeadError(ValueError):
    """A split that would cut a head or a component; the planner names the tensor."""


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads of a model, from its ``config.json``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> HeadLayout | None:
        """The heads a Hugging Face config declares (Llama-style or GPT-2 names), or None
        when it declares none."""
        config = config or {}
        heads = _positive(config, "num_attention_heads", "n_head")
        if heads is None:
            return None
        kv = _positive(config, "num_key_value_heads") or heads
        head_dim = _positive(config, "head_dim")
        if head_dim is None:
            hidden = _positive(config, "hidden_size", "n_embd")
            if hidden is None or hidden % heads:
                return None
            head_dim = hidden // heads
        return cls(heads, kv, head_dim)

    def valid_tp_sizes(self, limit: int = 64) -> tuple[int, ...]:
        """The tp sizes (up to ``limit``) that split both head counts into whole heads."""
        return tuple(tp for tp in range(1, limit + 1) if _heads_ok(self, tp))

    def describe(self) -> str:
        return (
            f"{self.num_heads} query heads, {self.num_kv_heads} KV heads, head_dim {self.head_dim}"
        )


def kv_replicas(heads: HeadLayout | None, tp_size: int) -> int:
    """How many ranks hold each KV head (1 unless there are fewer KV heads than ranks)."""
    if heads is None or heads.num_kv_heads >= tp_size:
        return 1
    return tp_size // heads.num_kv_heads


def rank_pieces(
    parts: Sequence[str],
    size: int,
    heads: HeadLayout | None,
    head_size: int | None,
    tp_size: int,
    rank: int,
) -> tuple[Piece, ...]:
    """Rank ``rank``'s pieces of a split dimension of ``size`` laid out as ``parts``
    (empty: one even part), in shard order; adjacent pieces merged. HeadError when the
    dimension does not match the heads, or tp would cut a head or a part."""
    widths = _widths(parts or ("even",), size, heads, head_size)
    pieces: list[Piece] = []
    base = 0
    for part, width in zip(parts or ("even",), widths, strict=True):
        start, length = _piece(part, width, heads, head_size, tp_size, rank)
        if pieces and pieces[-1][0] + pieces[-1][1] == base + start:
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + length)
        else:
            pieces.append((base + start, length))
        base += width
    return tuple(pieces)


def _widths(
    parts: Sequence[str], size: int, heads: HeadLayout | None, head_size: int | None
) -> list[int]:
    sized = [p for p in parts if p in _SIZED]
    if (sized or "heads" in parts) and heads is None:
        if len(parts) == 1:
            return [size]  # cut evenly (in whole heads of head_size, when the rule has one)
        raise HeadError(
            f"parts {list(parts)} need the head counts: config.json has no "
            "num_attention_heads (or n_head); add them to config.json"
        )
    widths = {p: _heads_of(p, heads) * _head_dim(heads, head_size) for p in sized}
    fixed = sum(widths[p] for p in sized)
    evens = len(parts) - len(sized)
    if (evens == 0 and fixed != size) or (evens and ((size - fixed) % evens or size <= fixed)):
        layout = " + ".join(f"{p} {widths[p]}" if p in widths else p for p in parts)
        raise HeadError(
            f"its dimension has size {size}, which does not match its parts "
            f"({layout}) for {heads.describe() if heads else 'these heads'}"
        )
    share = (size - fixed) // evens if evens else 0
    return [widths.get(p, share) for p in parts]


def _piece(
    part: str, width: int, heads: HeadLayout | None, head_size: int | None, tp: int, rank: int
) -> Piece:
    if part == "even" or heads is None:
        if width % tp:
            raise HeadError(f"a part of size {width} is not divisible by tp={tp}")
        if part != "even" and (width // tp) % (head_size or 1):
            raise HeadError(f"{width // (head_size or 1)} heads cannot be split whole by tp={tp}")
        step = width // tp
        return rank * step, step
    count = _heads_of(part, heads)
    dim = _head_dim(heads, head_size)
    if part == "heads":
        if width % count:
            raise HeadError(f"its size {width} does not hold {count} heads of equal width")
        dim = width // count
    if count % tp == 0:
        per_rank = count // tp
        return rank * per_rank * dim, per_rank * dim
    if part == "kv" and tp % count == 0:
        return (rank // (tp // count)) * dim, dim
    what = "query" if part == "q" else "KV"
    raise HeadError(
        f"{count} {what} heads cannot be split whole across tp={tp} "
        f"({heads.describe()}; valid tp sizes: "
        f"{', '.join(map(str, heads.valid_tp_sizes(max(tp, heads.num_heads))))})"
    )


def _heads_of(part: str, heads: HeadLayout | None) -> int:
    assert heads is not None
    return heads.num_kv_heads if part == "kv" else heads.num_heads


def _head_dim(heads: HeadLayout | None, head_size: int | None) -> int:
    if head_size is not None:
        return head_size
    assert heads is not None
    return heads.head_dim


def _heads_ok(heads: HeadLayout, tp: int) -> bool:
    kv_ok = heads.num_kv_heads % tp == 0 or tp % heads.num_kv_heads == 0
    return heads.num_heads % tp == 0 and kv_ok


def _positive(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
