"""Quantization scales follow their weights.

FP8 checkpoints carry, beside a weight ``X.weight``, its scales:

* per-tensor scales (one element: ``X.weight_scale``, ``X.input_scale``, ``k_scale``,
  ``v_scale``...) are replicated: every rank needs the same number;
* block scales (``X.weight_scale_inv`` of DeepSeek-V3 and Qwen3-FP8: one scale per
  ``128 x 128`` block of the weight, the block size in ``config.json``
  ``quantization_config.weight_block_size``) and per-channel scales (``X.weight_scale``
  shaped like the weight's rows) are split along the weight's split dimension, in whole
  blocks: a rank's rows of the scale are exactly the blocks of its rows of the weight.

A shard whose part of the weight would cut a block is an error: the scale could not
follow. Pure arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from rayload.loading.heads import HeadError, Piece

_FOLLOWING_SUFFIXES = ("weight_scale_inv", "weight_scale")
_SCALE_SUFFIXES = ("_scale", "_scale_inv")


def is_scale(name: str) -> bool:
    """Whether ``name`` is a quantization scale by its name."""
    return name.endswith(_SCALE_SUFFIXES)


def scaled_weight(name: str, names: Collection[str]) -> str | None:
    """The weight whose scale ``name`` is (``X.weight_scale_inv`` -> ``X.weight``), when it
    is in ``names``; else None."""
    for suffix in _FOLLOWING_SUFFIXES:
        if name.endswith("." + suffix):
            weight = name[: -len(suffix)] + "weight"
            return weight if weight in names else None
    return None


def block_size(config: Mapping[str, Any] | None) -> tuple[int, ...] | None:
    """``quantization_config.weight_block_size`` of config.json, or None."""
    quant = (config or {}).get("quantization_config")
    size = quant.get("weight_block_size") if isinstance(quant, Mapping) else None
    if isinstance(size, list) and size and all(isinstance(v, int) and v > 0 for v in size):
        return tuple(size)
    return None


def scale_pieces(
    scale_shape: Sequence[int],
    weight_shape: Sequence[int],
    split: int,
    weight_pieces: Sequence[Piece],
    config_block: tuple[int, ...] | None,
) -> tuple[tuple[Piece, ...], int]:
    """The scale's pieces along ``split`` for a weight shard of ``weight_pieces``, and the
    block size along that dimension. HeadError when a piece would cut a block or the
    shapes do not fit the block size."""
    blocks, rows = scale_shape[split], weight_shape[split]
    block = (
        config_block[split]
        if config_block is not None and split < len(config_block)
        else math.ceil(rows / blocks)
    )
    if math.ceil(rows / block) != blocks:
        raise HeadError(
            f"it has {blocks} blocks along dimension {split}, but the weight's {rows} with a "
            f"block size of {block} need {math.ceil(rows / block)}"
        )
    pieces = []
    for start, length in weight_pieces:
        end = start + length
        if start % block or (end % block and end != rows):
            raise HeadError(
                f"its weight's shard, elements {start}-{end - 1} of dimension {split}, would "
                f"cut a block of {block}: choose a tp size that gives each rank whole blocks"
            )
        pieces.append((start // block, math.ceil(end / block) - start // block))
    return tuple(pieces), block
