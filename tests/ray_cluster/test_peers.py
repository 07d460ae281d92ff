"""The ``peer`` load method on a real Ray cluster: replicas that hold a checkpoint's shards
send them to new replicas over a two-rank gloo group, found through the peer directory.

Bytes are compared tensor by tensor (SHA-256 of each resident tensor's bytes, on the
ranks) against replicas that read storage; storage reads are the ranks' own ``rchar``
(``rayload.io.rchar`` of ``rank.load``), not the plan's numbers.
"""

from __future__ import annotations

import hashlib
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.util.state import list_actors

import rayload
from rayload.actors.directory import DIRECTORY_NAME, NAMESPACE, call, directory, stop_directory
from rayload.errors import MethodUnavailableError
from rayload.loading import load_rank, write_checkpoint
from rayload.loading.methods import LoadMethod
from rayload.tracing import schema

pytestmark = pytest.mark.usefixtures("ray_cluster")

# Ray's workers cannot import tests/: send this module's functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _digests(state: Any) -> dict[str, str]:
    """SHA-256 of every resident tensor's bytes on one rank."""
    return {
        name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in state.tensors.items()
    }


def _replica_digests(result: rayload.LoadResult) -> list[list[dict[str, str]]]:
    """Every rank's digests, by replica then rank."""
    digests = result.apply(_digests)
    tp = result.tp_size
    return [digests[i : i + tp] for i in range(0, len(digests), tp)]


def _storage_digests(path: Path, tp: int) -> list[dict[str, str]]:
    """The digests of each rank's shards read from storage in this process."""
    out = []
    for rank in range(tp):
        tensors, _ = load_rank(path, rank, tp, "scratch", "cpu")
        out.append(
            {
                name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for name, t in tensors.items()
            }
        )
    return out


def _rank_rchar(trace_dir: Path, reader: Callable[[Path], list[Any]]) -> dict[tuple[int, int], int]:
    """``(replica, rank) -> rayload.io.rchar`` of every ``rank.load`` in the trace."""
    return {
        (int(span.resource.get(schema.REPLICA, 0)), int(span.rank)): int(
            span.attributes["rayload.io.rchar"]
        )
        for span in reader(trace_dir)
        if span.name == schema.RANK_SPAN
    }


@pytest.fixture(scope="module")
def medium_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 64 MB checkpoint: large enough that a rank's fixed reads (headers, lazy imports,
    ~0.4 MB) are small beside its shard."""
    return write_checkpoint(tmp_path_factory.mktemp("medium") / "ckpt", size_gb=0.064, seed=7)


@pytest.fixture(scope="module")
def medium_llama_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shapes as ``medium_llama`` with other values: the next checkpoint of a run."""
    return write_checkpoint(tmp_path_factory.mktemp("medium-next") / "ckpt", size_gb=0.064, seed=8)


@pytest.fixture
def entries() -> Iterator[Callable[[], list[Any]]]:
    """The directory's entries, read now."""
    yield lambda: call(directory().entries)


def test_second_load_receives_every_tensor_bit_identical_and_reads_no_tensor_bytes(
    tiny_llama: Path, no_leaks: Any, tmp_path: Path, trace_reader: Any
) -> None:
    with (
        rayload.load(tiny_llama, 2, device="cpu") as first,
        rayload.load(tiny_llama, 2, device="cpu", trace_dir=tmp_path) as second,
    ):
        assert [r.method.effective for r in second.ranks] == [LoadMethod.PEER] * 2
        assert [r.method.selected for r in second.ranks] == [LoadMethod.PEER] * 2
        assert all(r.method.fallback_reason is None for r in second.ranks)
        for report, rank_plan in zip(second.ranks, second.plan.ranks, strict=True):
            assert report.bytes_from_storage == 0
            assert report.bytes_from_peers == rank_plan.nbytes
            assert report.source.startswith(f"peer replica={first.replica_ids[0]} ")
        assert _replica_digests(second) == _replica_digests(first)
        assert _replica_digests(second)[0] == _storage_digests(tiny_llama, 2)
        agg = second.startup_metrics["aggregate"]
        assert agg["bytes_from_peers"]["total"] == sum(r.nbytes for r in second.plan.ranks)
        spans = trace_reader(tmp_path)
        reads = [s for s in spans if s.name == "rank.read"]
        assert {s.attributes["rayload.source"].split()[0] for s in reads} == {"peer"}
        assert {s.attributes["rayload.peer.via"] for s in reads} == {"gloo"}
        prefaulted = re.compile(r"\d+ bytes mapped ahead|off: this kernel has no madvise")
        assert all(prefaulted.fullmatch(s.attributes["rayload.peer.prefault"]) for s in reads)
        # Only headers (and Ray's small messages) were read: far below the shards.
        rchar = _rank_rchar(tmp_path, trace_reader)
        assert len(rchar) == 2 and max(rchar.values()) < second.plan.ranks[0].nbytes / 2


def test_receiver_on_the_holders_node_copies_its_shared_copy_bit_identical(
    tiny_llama: Path, no_leaks: Any, tmp_path: Path, trace_reader: Any
) -> None:
    with rayload.load(tiny_llama, 2, device="cpu", shared_copy=True) as first:
        want = [{s.name: s.nbytes for s in r.shards} for r in first.plan.ranks]
        deadline = time.monotonic() + 60
        while not all(
            ray.get(a.shared_copy.remote(w)) for a, w in zip(first.actors, want, strict=True)
        ):  # the copy is put in the background once the load has returned
            assert time.monotonic() < deadline, "no shared copy"
            time.sleep(0.05)
        with rayload.load(tiny_llama, 2, device="cpu", trace_dir=tmp_path) as second:
            assert [r.bytes_from_storage for r in second.ranks] == [0, 0]
            assert _replica_digests(second) == _replica_digests(first)
        reads = [s for s in trace_reader(tmp_path) if s.name == "rank.read"]
        assert [s.attributes["rayload.peer.via"] for s in reads] == ["object_store"] * 2


def test_replicas_started_together_read_each_byte_from_storage_once(
    medium_llama: Path, medium_llama_next: Path, no_leaks: Any, tmp_path: Path, trace_reader: Any
) -> None:
    with rayload.load(medium_llama, 2, device="cpu", replicas=3, trace_dir=tmp_path) as result:
        assert result.replicas == 3 and len(result.ranks) == 6 and len(result.actors) == 6
        storage = [r for r in result.ranks if r.bytes_from_storage > 0]
        assert [r.rank for r in storage] == [0, 1]  # one reader per rank in the cluster
        assert all(r.method.effective is LoadMethod.PEER for r in result.ranks[2:])
        digests = _replica_digests(result)
        assert digests[1] == digests[0] and digests[2] == digests[0]
        # The readers read their shards; the receivers only headers and lazy imports.
        rchar = _rank_rchar(tmp_path, trace_reader)
        shard = result.plan.ranks[0].nbytes
        assert all(rchar[0, r] >= result.ranks[r].bytes_from_storage for r in (0, 1))
        assert all(rchar[i, r] < shard / 20 for i in (1, 2) for r in (0, 1))
        # In all, the cluster read what one replica reads (its reader's own amplification
        # of closely strided split-1 rows included: docs/ray.md "Peer loading").
        assert sum(rchar.values()) < 1.05 * (rchar[0, 0] + rchar[0, 1])
        lanes = {
            (s.resource.get(schema.REPLICA), s.resource.get(schema.RANK))
            for s in trace_reader(tmp_path)
            if s.name == schema.RANK_SPAN
        }
        assert lanes == {(i, r) for i in range(3) for r in range(2)}

        # The next checkpoint: replica 0 reloads it from storage, the others from replica 0.
        reloaded = result.reload(medium_llama_next)
        assert [r.bytes_from_storage > 0 for r in reloaded.ranks] == [True] * 2 + [False] * 4
        for report in reloaded.ranks[2:]:
            assert report.method.effective is LoadMethod.PEER
            assert report.bytes_from_peers == result.plan.ranks[report.rank].nbytes
            assert report.source.startswith(f"peer replica={result.replica_ids[0]} ")
        new = _replica_digests(result)
        assert new[0] == _storage_digests(medium_llama_next, 2) != digests[0]
        assert new[1] == new[0] and new[2] == new[0]
        rchar = _rank_rchar(tmp_path / "reload-1", trace_reader)
        assert all(rchar[i, r] < shard / 20 for i in (1, 2) for r in (0, 1))


def test_holder_killed_mid_transfer_receiver_completes_from_storage(
    tiny_llama: Path, no_leaks: Any, set_test_hooks: Callable[..., None]
) -> None:
    # The holder packs a tiny checkpoint into several buckets, pausing after the first.
    set_test_hooks(peer_pause_s={"0": 4}, peer_bucket_bytes=1 << 16)
    holder = rayload.load(tiny_llama, 1, device="cpu")
    set_test_hooks()
    outcome: dict[str, Any] = {}

    def receive() -> None:
        with rayload.load(tiny_llama, 1, device="cpu") as receiver:
            outcome["report"] = receiver.ranks[0]
            outcome["digests"] = _replica_digests(receiver)
            outcome["shard"] = receiver.plan.ranks[0].nbytes

    thread = threading.Thread(target=receive)
    thread.start()
    deadline = time.monotonic() + 60
    while ray.get(holder.actors[0].peer_ping.remote()) == 0:  # no bucket sent yet
        assert time.monotonic() < deadline, "the holder never began sending"
        time.sleep(0.05)
    ray.kill(holder.actors[0], no_restart=True)  # mid-transfer: during the pause
    thread.join(timeout=120)
    assert not thread.is_alive(), "the receiver did not finish"
    holder.close()
    report = outcome["report"]
    assert report.method.selected is LoadMethod.PEER
    assert report.method.effective is LoadMethod.SCRATCH
    assert "failed mid-transfer" in (report.method.fallback_reason or "")
    # The first piece (the start of the first tensor) is kept: storage reads the rest.
    assert 0 < report.bytes_from_peers < outcome["shard"]
    assert report.bytes_from_peers + report.bytes_from_storage == outcome["shard"]
    assert outcome["digests"][0] == _storage_digests(tiny_llama, 1)


def test_holder_killed_mid_transfer_is_an_error_under_strict(
    tiny_llama: Path, no_leaks: Any, set_test_hooks: Callable[..., None]
) -> None:
    # The holder packs a tiny checkpoint into several buckets, pausing after the first.
    set_test_hooks(peer_pause_s={"0": 4}, peer_bucket_bytes=1 << 16)
    holder = rayload.load(tiny_llama, 1, device="cpu")
    set_test_hooks()
    raised: list[BaseException] = []

    def receive() -> None:
        try:
            rayload.load(tiny_llama, 1, method="peer", device="cpu", strict=True).close()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    deadline = time.monotonic() + 60
    while ray.get(holder.actors[0].peer_ping.remote()) == 0:
        assert time.monotonic() < deadline, "the holder never began sending"
        time.sleep(0.05)
    ray.kill(holder.actors[0], no_restart=True)
    thread.join(timeout=120)
    assert not thread.is_alive(), "the receiver did not finish"
    holder.close()
    assert len(raised) == 1 and isinstance(raised[0], MethodUnavailableError)
    assert "failed mid-transfer" in str(raised[0]) and "rank 0" in str(raised[0])


def test_dead_holder_is_dropped_and_never_used(
    tiny_llama: Path, no_leaks: Any, entries: Callable[[], list[Any]]
) -> None:
    crashed = rayload.load(tiny_llama, 2, device="cpu")
    for actor in crashed.actors:  # as if its driver died without closing
        ray.kill(actor, no_restart=True)
    with rayload.load(tiny_llama, 2, device="cpu") as fresh:
        assert [r.method.effective for r in fresh.ranks] == [LoadMethod.SCRATCH] * 2
        assert all(r.method.fallback_reason is None for r in fresh.ranks)
        known = {e.replica for e in entries()}
        assert crashed.replica_ids[0] not in known and fresh.replica_ids[0] in known
    crashed.close()


def test_peer_requested_without_holder_reads_storage_as_a_reported_fallback(
    tiny_llama: Path, no_leaks: Any
) -> None:
    with rayload.load(tiny_llama, 2, method="peer", device="cpu") as result:
        for report in result.ranks:
            assert report.method.requested is LoadMethod.PEER
            assert report.method.effective is LoadMethod.SCRATCH
            assert "no replica" in (report.method.fallback_reason or "")
        assert any("fell back" in w for w in result.warnings)


def test_directory_killed_loads_read_storage_with_a_warning(
    tiny_llama: Path, no_leaks: Any
) -> None:
    with rayload.load(tiny_llama, 2, device="cpu") as holder:
        ray.kill(ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE), no_restart=True)
        with rayload.load(tiny_llama, 2, device="cpu") as after:
            assert [r.method.effective for r in after.ranks] == [LoadMethod.SCRATCH] * 2
            assert any("peer directory" in w for w in after.warnings), after.warnings
        assert holder.ranks[0].bytes_from_storage > 0


def test_only_the_directory_outlives_closed_loads_and_stop_removes_it(
    tiny_llama: Path, ray_cluster: Any
) -> None:
    with rayload.load(tiny_llama, 2, device="cpu", replicas=2):
        pass
    alive = list_actors(
        address=ray_cluster.state_address,
        filters=[("state", "=", "ALIVE")],
        raise_on_missing_output=False,
    )
    assert not [a for a in alive if a.class_name == "RankActor"]
    assert DIRECTORY_NAME in {a.name for a in alive}
    assert call(directory().entries) == []
    assert stop_directory()
    deadline = time.monotonic() + 10
    while any(
        a.name == DIRECTORY_NAME
        for a in list_actors(
            address=ray_cluster.state_address,
            filters=[("state", "=", "ALIVE")],
            raise_on_missing_output=False,
        )
    ):
        assert time.monotonic() < deadline, "the directory is still alive"
        time.sleep(0.2)
