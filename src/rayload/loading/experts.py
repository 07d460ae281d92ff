"""Expert parallel: which rank holds which experts of a mixture-of-experts model.

With expert parallel (vLLM's ``--enable-expert-parallel``) an expert is not split across
the ranks: each rank holds whole experts, a contiguous block of them, and reads no byte of
another rank's experts. Rank ``r`` of ``tp`` holds experts ``r*E/tp .. (r+1)*E/tp - 1``.
Attention, routers and shared experts follow their rules as without it. Pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rayload.errors import ConfigError, ShardingError

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""config.json keys that give the routed experts per layer (Mixtral, Qwen-MoE, DeepSeek)."""


@dataclass(frozen=True)
class ExpertLayout:
    """``num_experts`` experts per layer over ``tp_size`` ranks, in contiguous blocks."""

    num_experts: int
    tp_size: int

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.tp_size

    def owner(self, expert: int) -> int:
        """The rank that holds ``expert``."""
        return expert // self.per_rank

    def of_rank(self, rank: int) -> tuple[int, ...]:
        """The experts rank ``rank`` holds."""
        return tuple(range(rank * self.per_rank, (rank + 1) * self.per_rank))


def expert_layout(
    config: Mapping[str, Any] | None, expert_ids: Iterable[int], tp_size: int, *, root: str
) -> ExpertLayout:
    """The layout of the experts named ``expert_ids`` (those of the checkpoint's tensors)
    over ``tp_size`` ranks; the count comes from config.json, else from the names.

    ConfigError when the checkpoint has no expert tensors; ShardingError naming the counts
    when the experts cannot be divided among the ranks whole."""
    ids = set(expert_ids)
    if not ids:
        raise ConfigError(
            f"{root}: expert parallel asked for, but no tensor is an expert's (no sharding "
            "rule with an expert group matches); drop --expert-parallel for a dense model"
        )
    count = next(
        (v for k in EXPERT_COUNT_KEYS if isinstance(v := (config or {}).get(k), int) and v > 0),
        max(ids) + 1,
    )
    if max(ids) >= count:
        raise ShardingError(
            f"{root}: tensors name expert {max(ids)}, but config.json says {count} experts; "
            "the checkpoint and its config do not match"
        )
    if count % tp_size:
        valid = ", ".join(str(t) for t in range(1, count + 1) if count % t == 0)
        raise ShardingError(
            f"{root}: {count} experts per layer cannot be divided among tp={tp_size} ranks "
            f"in whole experts; valid tp sizes with expert parallel: {valid}"
        )
    return ExpertLayout(count, tp_size)
