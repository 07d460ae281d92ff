"""Where each rank of a new replica gets its shards (``choose_sources``), without Ray: the
tree of replicas loading together, its parent, and the alternates a rank turns to when its
source fails part way."""

from __future__ import annotations

import pytest

from rayload.actors.directory import ReplicaEntry
from rayload.actors.sharing import MAX_ALTERNATES, choose_sources


def _entry(name: str, state: str = "loading", tp: int = 2) -> ReplicaEntry:
    return ReplicaEntry(
        replica=name,
        key="k",
        path="/ckpt",
        tp_size=tp,
        actors=tuple(f"{name}/{r}" for r in range(tp)),
        nodes=tuple(f"node-{name}-{r}" for r in range(tp)),
        state=state,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("fanout", "loading", "parent", "above"),
    [
        (1, 4, 3, [2, 1, 0]),  # a chain: the last one's parent, then up to the root
        (2, 6, 2, [0]),  # position 6 in a binary tree: parent 2, whose parent is 0
        (2, 7, 3, [1, 0]),
        (3, 3, 0, []),  # a child of the root: no alternate but storage
        (0, 3, 0, []),  # no pipeline: the oldest, once it has finished
    ],
)
def test_a_replica_in_the_tree_receives_from_its_parent_its_alternates_the_ancestors(
    fanout: int, loading: int, parent: int, above: list[int]
) -> None:
    holders = [_entry(f"r{i}") for i in range(loading)]
    sources = choose_sources(holders, _entry("new"), fanout=fanout)
    for rank, source in enumerate(sources):
        assert source is not None
        assert (source.replica, source.rank, source.actor) == (
            f"r{parent}",
            rank,
            f"r{parent}/{rank}",
        )
        assert source.stream is (fanout > 0) and source.loading
        assert [a.replica for a in source.alternates] == [f"r{i}" for i in above]
        assert all(a.rank == rank and a.actor == f"{a.replica}/{rank}" for a in source.alternates)
        assert all(a.alternates == () for a in source.alternates)
        # Hops from the replica reading storage: a stall is taken as one only right below it.
        depths = [source.depth, *(a.depth for a in source.alternates)]
        assert depths == list(range(len(depths), 0, -1))


def test_finished_holders_are_preferred_their_alternates_other_finished_ones() -> None:
    holders = [_entry("busy"), *(_entry(f"done{i}", "loaded") for i in range(MAX_ALTERNATES + 3))]
    sources = choose_sources(holders, _entry("new"), fanout=2)
    for source in sources:
        assert source is not None and source.replica.startswith("done") and not source.loading
        alternates = [a.replica for a in source.alternates]
        assert len(alternates) == MAX_ALTERNATES
        assert source.replica not in alternates and "busy" not in alternates
        assert all(name.startswith("done") for name in alternates)
        assert source.depth == 1 and all(a.depth == 1 for a in source.alternates)


def test_no_holder_means_storage() -> None:
    assert choose_sources([], _entry("new")) == ()
