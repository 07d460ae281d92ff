"""Fixtures of the reference-model tests: tiny transformers checkpoints with their
reference logits, and pools of rank processes (one per tp size, shared by the session)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from models.tp_processes import RankPool
from support.transformers_models import Reference, write_reference


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Reference]:
    """``reference(family)``: written and run through transformers on first use."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf-tiny")
    cache: dict[str, Reference] = {}

    def get(family: str) -> Reference:
        if family not in cache:
            cache[family] = write_reference(family, root / family)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[Callable[[int], RankPool]]:
    """``rank_pool(tp)``: ``tp`` gloo-connected rank processes, started on first use."""
    pools: dict[int, RankPool] = {}

    def get(tp: int) -> RankPool:
        return pools.setdefault(tp, RankPool(tp))

    yield get
    for pool in pools.values():
        pool.close()
