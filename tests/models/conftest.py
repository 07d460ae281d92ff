"""Fixtures of the reference-model tests: pools of rank processes (one per tp size, shared
by the session). The checkpoints and their logits are tests/conftest.py's ``reference``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from models.tp_processes import RankPool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[Callable[[int], RankPool]]:
    """``rank_pool(tp)``: ``tp`` gloo-connected rank processes, started on first use."""
    pools: dict[int, RankPool] = {}

    def get(tp: int) -> RankPool:
        return pools.setdefault(tp, RankPool(tp))

    yield get
    for pool in pools.values():
        pool.close()
