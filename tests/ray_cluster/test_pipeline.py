"""The pipelined fan-out of peer loads on a real Ray cluster, from a real S3-protocol
server (moto behind the counting proxy of tests/support/s3.py, its link slowed so that a
load lasts seconds): replicas that start together receive from a replica still loading,
each piece as it lands there, and the server serves the checkpoint once.

* three replicas in a chain (``peer_fanout=1``): bit-identical shards, the server's count
  one replica's, the third's first pieces in before the first has read its last;
* a replica in the middle of a pipeline killed: the one downstream of it keeps what had
  arrived and reads only the rest from storage, its report naming the switch, and goes
  on forwarding to its own downstream, which never sees the switch.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import rayload
from rayload.actors.channel import pieces
from rayload.actors.directory import call, directory
from rayload.errors import RayloadError
from rayload.loading import load_rank, plan_shards, write_checkpoint
from rayload.loading.backends.peer import PIECES
from rayload.loading.methods import LoadMethod
from rayload.tracing import schema
from support.s3 import S3Server, s3_server

pytestmark = pytest.mark.usefixtures("ray_cluster")

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PIECE_BYTES = 256 << 10
"""The peers' piece size in these tests (``peer_bucket_bytes``): many pieces per tensor."""


@pytest.fixture(scope="module")
def s3() -> S3Server:
    return s3_server()


@pytest.fixture(scope="module")
def pipeline_url(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A 16 MB checkpoint in S3, and its local copy."""
    path = write_checkpoint(tmp_path_factory.mktemp("s3-pipe") / "ckpt", size_gb=0.016, seed=11)
    return s3.upload(path, "ray-models", "pipeline"), path


@pytest.fixture
def slow_link(s3: S3Server) -> Any:
    """The proxy's link at ``rate`` bytes/s for this test (then as fast as it can)."""

    def slow(rate: float) -> None:
        s3.proxy.rate = rate

    yield slow
    s3.proxy.rate = 0.0


def _digests(state: Any) -> dict[str, str]:
    return {
        name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in state.tensors.items()
    }


def _local_digests(path: Path) -> dict[str, str]:
    tensors, _ = load_rank(path, 0, 1, "scratch", "cpu")
    return {
        n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in tensors.items()
    }


def test_three_replicas_in_a_chain_pipeline_the_store_s_bytes_served_once(
    s3: S3Server,
    pipeline_url: tuple[str, Path],
    slow_link: Callable[[float], None],
    set_test_hooks: Callable[..., None],
    trace_reader: Any,
    tmp_path: Path,
    no_leaks: Any,
) -> None:
    url, local = pipeline_url
    prefix = url.removeprefix("s3://") + "/"
    shard = plan_shards(local, 1).ranks[0].nbytes
    set_test_hooks(peer_bucket_bytes=PIECE_BYTES)
    slow_link(8e6)  # 16 MB at 8 MB/s: replica 0 reads for about 2 s
    s3.proxy.clear()
    with rayload.load(
        url, 1, device="cpu", replicas=3, peer_fanout=1, trace_dir=tmp_path, timeout=300
    ) as result:
        served = s3.proxy.served_bytes(prefix)
        ranks, ids = result.ranks, result.replica_ids
        digests = result.apply(_digests)
    slow_link(0.0)
    # Bit-identical to the checkpoint, every replica.
    assert digests[0] == digests[1] == digests[2] == _local_digests(local)
    # A chain: 1 from 0, 2 from 1, both straight from a replica still loading.
    assert ranks[0].bytes_from_storage == shard and ranks[0].bytes_from_peers == 0
    for replica in (1, 2):
        report = ranks[replica]
        assert report.method.effective is LoadMethod.PEER, report.method.fallback_reason
        assert report.bytes_from_storage == 0 and report.bytes_from_peers == shard
        assert report.source.startswith(f"peer replica={ids[replica - 1]} ")
    # Each byte once per cluster, by the server's own count (headers and config beside).
    assert shard <= served <= 1.02 * shard, served / shard
    # Pipelined, as the trace shows: replica 2 had its first pieces, over two hops, well
    # before replica 0 had read its last byte, and it received in many pieces, from 1.
    spans = trace_reader(tmp_path)

    def span(name: str, replica: int) -> Any:
        [found] = [s for s in spans if s.name == name and s.resource.get(schema.REPLICA) == replica]
        return found

    read_0, pieces_2 = span("rank.read", 0), span(PIECES, 2)
    assert pieces_2.start_ns < read_0.end_ns - 0.5e9, (read_0.end_ns - pieces_2.start_ns) / 1e9
    assert pieces_2.attributes["rayload.pieces"] >= shard // PIECE_BYTES
    assert pieces_2.attributes["rayload.bytes"] == shard
    assert pieces_2.attributes["rayload.source"].startswith(f"peer replica={ids[1]} ")


def test_a_replica_killed_mid_pipeline_its_downstream_keeps_what_arrived_and_reads_the_rest(
    s3: S3Server,
    pipeline_url: tuple[str, Path],
    slow_link: Callable[[float], None],
    set_test_hooks: Callable[..., None],
    no_leaks: Any,
) -> None:
    url, local = pipeline_url
    prefix = url.removeprefix("s3://") + "/"
    plan = plan_shards(local, 1).ranks[0]
    shard = plan.nbytes
    set_test_hooks(peer_bucket_bytes=PIECE_BYTES)
    slow_link(2e6)  # replica 0 of the first load reads for about 8 s
    s3.proxy.clear()
    failures: list[BaseException] = []
    outcome: dict[str, Any] = {}

    def first() -> None:  # replica 0 reads storage, replica 1 receives from it
        try:
            rayload.load(url, 1, device="cpu", replicas=2, peer_fanout=1, timeout=300).close()
        except BaseException as exc:
            failures.append(exc)

    both_loaded = threading.Barrier(2, timeout=180)  # neither closes while the other loads

    def downstream() -> None:  # a chain: the youngest replica still loading is the parent
        with rayload.load(url, 1, device="cpu", peer_fanout=1, timeout=300) as result:
            outcome[result.replica_ids[0]] = (result.ranks[0], result.apply(_digests)[0])
            both_loaded.wait()

    def registered(count: int) -> list[Any]:
        while len(entries := [e for e in call(directory().entries) if e.path == url]) < count:
            assert time.monotonic() < deadline, f"fewer than {count} replicas ever registered"
            time.sleep(0.05)
        return entries

    def forwarding(actor: Any) -> None:
        while ray.get(actor.peer_ping.remote()) == 0:
            assert time.monotonic() < deadline, "a replica in the chain never forwarded a piece"
            time.sleep(0.05)

    deadline = time.monotonic() + 120
    loads = threading.Thread(target=first)
    loads.start()
    middle = registered(2)[1].actors[0]
    # Two more loads, each a replica: 0 -> 1 -> third -> fourth.
    receivers = [threading.Thread(target=downstream) for _ in range(2)]
    for receiver in receivers:
        receiver.start()
    entries = registered(4)
    third, fourth = entries[2].replica, entries[3].replica
    forwarding(middle)
    forwarding(entries[2].actors[0])  # the fourth receives from the third
    time.sleep(0.3)  # a few pieces further
    ray.kill(middle, no_restart=True)
    loads.join(timeout=180)
    for receiver in receivers:
        receiver.join(timeout=180)
    slow_link(0.0)
    assert not loads.is_alive() and not any(r.is_alive() for r in receivers)
    # The first load fails, naming the replica that died; the two others finish.
    assert len(failures) == 1 and isinstance(failures[0], RayloadError), failures
    report, digests = outcome[third]
    reason = report.method.fallback_reason or ""
    assert report.method.selected is LoadMethod.PEER
    assert f"replica {entries[1].replica} rank 0" in reason and "failed mid-transfer" in reason
    assert "had arrived and were kept" in reason
    # Not started over: what had arrived came from the peer, only the rest from storage.
    assert 0 < report.bytes_from_peers < shard
    assert report.bytes_from_peers + report.bytes_from_storage == shard
    assert digests == _local_digests(local)
    # The fourth never saw the switch: all of it came from the third, which forwarded the
    # rest as its storage read landed (a piece of the rest came before that read ended).
    onward, onward_digests = outcome[fourth]
    assert onward.method.effective is LoadMethod.PEER, onward.method.fallback_reason
    assert onward.bytes_from_peers == shard and onward.source.startswith(f"peer replica={third} ")
    assert onward_digests == digests
    [rest_read] = [
        p
        for p in report.phases
        if p.name == "rank.read" and p.attributes.get("source") == "storage"
    ]
    [pieces_4] = [p for p in onward.phases if p.name == PIECES]
    times = pieces_4.attributes["piece_ms"]
    assert len(times) == pieces_4.attributes["pieces"]
    kept = next(
        k
        for k in range(len(plan.shards) + 1)
        if sum(s.nbytes for s in plan.shards[:k]) >= report.bytes_from_peers
    )
    ranges = [
        k for piece in pieces([s.nbytes for s in plan.shards], PIECE_BYTES) for k, _, _ in piece
    ]
    first_rest = pieces_4.start_ns + times[ranges.index(kept)] * 1e6
    assert first_rest < rest_read.end_ns, (first_rest - rest_read.end_ns) / 1e9
    assert s3.proxy.served_bytes(prefix) < 2 * shard  # the cluster never read it twice


def test_a_tp_group_sharing_its_split1_fetches_forwards_while_it_loads(
    s3: S3Server,
    pipeline_url: tuple[str, Path],
    slow_link: Callable[[float], None],
    set_test_hooks: Callable[..., None],
    trace_reader: Any,
    tmp_path: Path,
    no_leaks: Any,
) -> None:
    """TP 2: replica 0's ranks fetch each split-1 tensor once between them and scatter
    the columns (the TP group's sharing); what lands, read or scattered, goes on to
    replica 1's same rank at once."""
    url, _local = pipeline_url
    set_test_hooks(peer_bucket_bytes=PIECE_BYTES)
    slow_link(8e6)
    with rayload.load(url, 2, device="cpu", replicas=2, trace_dir=tmp_path, timeout=300) as r:
        ranks, digests = r.ranks, r.apply(_digests)
    slow_link(0.0)
    assert digests[2:] == digests[:2]
    assert [x.bytes_from_storage == 0 for x in ranks] == [False, False, True, True]
    assert ranks[0].phases and any(
        "group.shared_tensors" in p.attributes for p in ranks[0].phases if p.name == "rank.read"
    ), "replica 0's ranks shared their split-1 tensors"
    spans = trace_reader(tmp_path)
    for rank in (0, 1):

        def span(name: str, replica: int, rank: int = rank) -> Any:
            [found] = [
                s
                for s in spans
                if s.name == name and s.resource.get(schema.REPLICA) == replica and s.rank == rank
            ]
            return found

        read_0, pieces_1 = span("rank.read", 0), span(PIECES, 1)
        assert pieces_1.start_ns < read_0.end_ns - 0.3e9, (read_0.end_ns - pieces_1.start_ns) / 1e9
        assert pieces_1.attributes["rayload.bytes"] == r.plan.ranks[rank].nbytes
