"""The pipelined fan-out of peer loads on a real Ray cluster, from a real S3-protocol
server (moto behind the counting proxy of tests/support/s3.py, its link slowed so that a
load lasts seconds): replicas that start together receive from a replica still loading,
each piece as it lands there, and the server serves the checkpoint once.

* three replicas in a chain (``peer_fanout=1``): bit-identical shards, the server's count
  one replica's, the third's first pieces in before the first has read its last;
* a replica in the middle of a chain killed: the one below it keeps what had arrived
  and gets the rest from the one above (its alternate), its report naming the switch,
  and goes on forwarding to its own downstream, which never sees the switch; the server
  still serves the checkpoint once;
* the replica reading storage frozen: the one right below takes it as stalled, reads
  only the rest from storage and forwards it as it lands; the one two hops down never
  takes its holder for stalled.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.util.state import get_actor

import rayload
from rayload.actors.directory import call, directory
from rayload.actors.peer_receiver import RayPeerSource
from rayload.actors.peers import PeerRef
from rayload.errors import RayloadError
from rayload.loading import load_rank, plan_shards, write_checkpoint
from rayload.loading.methods import LoadMethod
from rayload.loading.peer import PIECES, PeerUnavailable
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


class _Chain:
    """Loads started one after another in threads, each one replica, so that with
    ``peer_fanout=1`` each receives from the one before it; what each returned, and the
    replicas the directory has for ``url``."""

    def __init__(self, url: str, timeout_s: float = 120) -> None:
        self.url = url
        self.deadline = time.monotonic() + timeout_s
        self.outcome: dict[str, tuple[Any, dict[str, str]]] = {}
        self.failures: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def start(self, replicas: int = 1, hold: threading.Barrier | None = None) -> None:
        """One more load of ``replicas``; ``hold``: it stays open until the barrier."""

        def run() -> None:
            try:
                with rayload.load(
                    self.url, 1, device="cpu", replicas=replicas, peer_fanout=1, timeout=300
                ) as result:
                    digests = result.apply(_digests)
                    for i, replica in enumerate(result.replica_ids):
                        self.outcome[replica] = (result.ranks[i], digests[i])
                    if hold is not None:
                        hold.wait()
            except BaseException as exc:
                self.failures.append(exc)
                if hold is not None:
                    hold.abort()

        self.threads.append(threading.Thread(target=run))
        self.threads[-1].start()

    def registered(self, count: int) -> list[Any]:
        while len(found := [e for e in call(directory().entries) if e.path == self.url]) < count:
            assert not self.failures, self.failures
            assert time.monotonic() < self.deadline, f"fewer than {count} replicas registered"
            time.sleep(0.05)
        return found

    def forwarding(self, actor: Any, sends: int = 1) -> None:
        """Wait until ``actor`` has begun ``sends`` sends (their first piece out)."""
        while ray.get(actor.peer_ping.remote()) < sends:
            assert not self.failures, self.failures
            assert time.monotonic() < self.deadline, "a replica never forwarded a piece"
            time.sleep(0.05)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=180)
        assert not any(t.is_alive() for t in self.threads), "a load did not finish"


def _pieces_during(report: Any, start_ns: int, end_ns: int) -> int:
    """How many of ``report``'s pieces from its peer came from ``start_ns`` to ``end_ns``
    (its one :data:`PIECES` span's arrival times; every piece's, for a small shard)."""
    [span] = [p for p in report.phases if p.name == PIECES]
    times = span.attributes["piece_ms"]
    assert len(times) == span.attributes["pieces"]
    return sum(start_ns <= span.start_ns + ms * 1e6 < end_ns for ms in times)


def test_a_replica_killed_mid_pipeline_its_downstream_gets_the_rest_from_the_one_above(
    s3: S3Server,
    pipeline_url: tuple[str, Path],
    slow_link: Callable[[float], None],
    set_test_hooks: Callable[..., None],
    no_leaks: Any,
) -> None:
    """A chain 0 -> 1 -> third -> fourth, each its own load; 1 is killed mid-transfer:
    the third keeps what had arrived and gets the rest from 0 (its alternate, still
    reading storage), and the fourth never sees the switch. The store is read once."""
    url, local = pipeline_url
    prefix = url.removeprefix("s3://") + "/"
    plan = plan_shards(local, 1).ranks[0]
    shard = plan.nbytes
    set_test_hooks(peer_bucket_bytes=PIECE_BYTES)
    slow_link(2e6)  # replica 0 reads for about 8 s: the kill lands while it reads
    s3.proxy.clear()
    chain = _Chain(url)
    held = threading.Barrier(3, timeout=180)  # 0, third and fourth close together
    chain.start(hold=held)
    chain.registered(1)  # the order they register in is the chain's
    chain.start()
    middle = chain.registered(2)[1].actors[0]
    chain.start(hold=held)
    chain.start(hold=held)
    entries = chain.registered(4)
    root, third, fourth = entries[0].replica, entries[2].replica, entries[3].replica
    chain.forwarding(middle)
    chain.forwarding(entries[2].actors[0])  # the fourth receives from the third
    time.sleep(0.3)  # a few pieces further
    ray.kill(middle, no_restart=True)
    chain.join()
    slow_link(0.0)
    # The middle's load fails, naming it; the three others finish.
    assert len(chain.failures) == 1 and isinstance(chain.failures[0], RayloadError)
    report, digests = chain.outcome[third]
    assert digests == _local_digests(local)
    # Peer to peer: no byte from storage, the switch named in the report.
    assert report.method.effective is LoadMethod.PEER, report.method.fallback_reason
    assert report.bytes_from_storage == 0 and report.bytes_from_peers == shard
    switch = report.peer_switch or ""
    assert switch.startswith(f"replica {entries[1].replica} rank 0 ")
    assert "failed mid-transfer: the channel broke after " in switch
    assert "had arrived and were kept" in switch
    assert f"came from replica {root} rank 0" in switch
    # From whom which bytes came: a pieces span per source, the middle's then the root's.
    spans = [p for p in report.phases if p.name == PIECES]
    assert [p.attributes["source"].split(" node=")[0] for p in spans] == [
        f"peer replica={entries[1].replica} rank=0",
        f"peer replica={root} rank=0",
    ]
    kept = spans[0].attributes["bytes"]
    assert 0 < kept < shard and kept + spans[1].attributes["bytes"] == shard  # each byte once
    gap = (spans[1].start_ns - spans[0].end_ns) / 1e9
    print(
        f"measured: the third's last piece from the killed middle to its first from 0: {gap:.3f} s"
    )
    # The fourth never saw the switch: all of it came from the third, which forwarded
    # the root's bytes as they landed (pieces came while they were still coming).
    onward, onward_digests = chain.outcome[fourth]
    assert onward.method.effective is LoadMethod.PEER, onward.method.fallback_reason
    assert onward.peer_switch is None
    assert onward.bytes_from_peers == shard and onward.source.startswith(f"peer replica={third} ")
    assert onward_digests == digests
    assert _pieces_during(onward, spans[1].start_ns, spans[1].end_ns) > 0
    # Each byte once per cluster, by the server's own count: 0 read it, nobody else.
    served = s3.proxy.served_bytes(prefix)
    assert shard <= served <= 1.02 * shard, served / shard


def test_a_replica_stalled_mid_pipeline_the_one_below_reads_the_rest_and_goes_on_forwarding(
    s3: S3Server,
    pipeline_url: tuple[str, Path],
    slow_link: Callable[[float], None],
    set_test_hooks: Callable[..., None],
    ray_cluster: Any,
    no_leaks: Any,
) -> None:
    """A chain 0 -> 1 -> 2 (0 and 1 one load, 2 another); 0 freezes (SIGSTOP) while it
    reads storage. 1, right below it, takes it as stalled after ``peer_stall_s`` and
    reads the rest from storage (0 has nobody above it); 2, two hops down, waits twice
    as long, so it never takes 1 for stalled: 1 forwards the storage read's bytes as they
    land and 2 gets everything from 1. Then 0 goes on and its load finishes too."""
    url, local = pipeline_url
    plan = plan_shards(local, 1).ranks[0]
    shard = plan.nbytes
    stall_s = 3.0
    set_test_hooks(peer_bucket_bytes=PIECE_BYTES, peer_stall_s=stall_s)
    slow_link(3e6)  # replica 0 reads for about 5 s: the freeze lands while it reads
    s3.proxy.clear()
    chain = _Chain(url)
    chain.start(replicas=2)
    entries = chain.registered(2)
    chain.start()  # at once: 0 must still be reading when 2 receives from 1
    below = chain.registered(3)[2].replica
    root, middle = entries[0].actors[0], entries[1].actors[0]
    actor = get_actor(root._actor_id.hex(), address=ray_cluster.state_address)
    assert actor is not None and actor.pid
    pid = actor.pid
    chain.forwarding(root)
    chain.forwarding(middle)
    time.sleep(0.3)  # a few pieces further
    os.kill(pid, signal.SIGSTOP)
    try:
        while below not in chain.outcome and not chain.failures:
            assert time.monotonic() < chain.deadline, "the replica below never finished"
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)
    chain.join()
    slow_link(0.0)
    assert not chain.failures, chain.failures
    report, digests = chain.outcome[entries[1].replica]
    assert digests == _local_digests(local) == chain.outcome[entries[0].replica][1]
    # 1 names the stall, kept what had come and read only the rest: not started over.
    reason = report.method.fallback_reason or ""
    assert report.method.selected is LoadMethod.PEER
    assert f"replica {entries[0].replica} rank 0" in reason and "failed mid-transfer" in reason
    assert f"the holder stalled: no piece came for {stall_s:g} s" in reason
    assert 0 < report.bytes_from_peers < shard
    assert report.bytes_from_peers + report.bytes_from_storage == shard
    # The server's count: 0's whole shard (it goes on once thawed) and what 1 lacked,
    # a cut tensor's rest included, nothing 1 had (headers and config beside).
    served = s3.proxy.served_bytes(url.removeprefix("s3://") + "/")
    assert shard + report.bytes_from_storage <= served <= 1.02 * shard + report.bytes_from_storage
    # 2 never took 1 for stalled: everything from 1, including the storage read's bytes,
    # a piece of which came before that read ended.
    onward, onward_digests = chain.outcome[below]
    assert onward.method.effective is LoadMethod.PEER, onward.method.fallback_reason
    assert onward.peer_switch is None
    assert onward.bytes_from_peers == shard
    assert onward.source.startswith(f"peer replica={entries[1].replica} ")
    assert onward_digests == digests
    [rest_read] = [
        p
        for p in report.phases
        if p.name == "rank.read" and p.attributes.get("source") == "storage"
    ]
    assert _pieces_during(onward, rest_read.start_ns, rest_read.end_ns) > 0
    [pieces_1] = [p for p in report.phases if p.name == PIECES]
    waited = (rest_read.start_ns - pieces_1.end_ns) / 1e9
    print(f"measured: 1's last piece from the frozen 0 to its storage read: {waited:.3f} s")


@ray.remote(num_cpus=0)
class _Holder:
    """Stands for a holder's rank actor (the methods a receiver calls); the test stops
    its process, as a frozen process or a lost node would be."""

    def pid(self) -> int:
        return os.getpid()

    def open_channel(self, *args: Any) -> None:
        time.sleep(3600)

    def peer_ping(self) -> int:
        return 0


def _given_up_on_frozen(
    source: RayPeerSource, plan: Any, holder: Any, pid: int, said: str, *, after_s: float = 0.0
) -> float:
    """Freeze ``holder`` (its process ``pid``), wait ``after_s``, then fetch ``plan`` from
    ``source``: the seconds until it raised PeerUnavailable saying ``said``. The holder
    is thawed and killed after."""
    destinations = [torch.empty(s.nbytes, dtype=torch.uint8) for s in plan.shards]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(after_s)
        start = time.monotonic()
        with pytest.raises(PeerUnavailable, match=f"no answer from the holder {said}"):
            list(source.fetch(plan, destinations))
        return time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
        ray.kill(holder)


@pytest.mark.parametrize("stream", [True, False], ids=["pipelined", "fanout-0"])
def test_a_holder_frozen_before_it_answers_is_given_up_within_a_stall_not_the_load_s_time(
    pipeline_url: tuple[str, Path], stream: bool
) -> None:
    # Pipelined, a holder answers once its load knows its tensors; with peer_fanout=0,
    # once its load has ended: either way the receiver pings it while it waits.
    _url, local = pipeline_url
    plan = plan_shards(local, 1).ranks[0]
    holder = _Holder.remote()  # type: ignore[attr-defined]
    pid = ray.get(holder.pid.remote())
    ref = PeerRef(replica="f0", rank=0, node_id=None, actor=holder, loading=True, stream=stream)
    source = RayPeerSource(ref, host="127.0.0.1", node_id=None, wait_s=300.0, stall_s=1.0)
    waited = _given_up_on_frozen(source, plan, holder, pid, "within 1 s")
    print(f"measured: a frozen holder given up after {waited:.2f} s (the load's wait: 300 s)")
    assert waited < 60, "it waited the load's time, not a stall's"


def test_an_alternate_asked_late_in_the_load_is_not_waited_for_past_the_load_s_end(
    pipeline_url: tuple[str, Path],
) -> None:
    # The load may wait 3.5 s in all (0.5 s for its holder and a stall of 3 s more for
    # its answer); its holder failed at the end of that (not modelled: the alternate is
    # asked then). The frozen alternate would get a stall (3 s) to answer; it gets what
    # is left of the load's time instead (nothing: the 1 s floor of any answer).
    _url, local = pipeline_url
    plan = plan_shards(local, 1).ranks[0]
    alternate = _Holder.remote()  # type: ignore[attr-defined]
    pid = ray.get(alternate.pid.remote())
    alt = PeerRef(replica="f1", rank=0, node_id=None, actor=alternate, loading=True)
    ref = PeerRef(replica="f0", rank=0, node_id=None, actor=None, alternates=(alt,))
    source = RayPeerSource(ref, host="127.0.0.1", node_id=None, wait_s=0.5, stall_s=3.0)
    [late] = source.alternates()
    waited = _given_up_on_frozen(late, plan, alternate, pid, "within 1 s", after_s=3.5)
    print(f"measured: a late alternate given up after {waited:.2f} s (a stall: 3 s)")
    assert waited < 2.5, "it was given a stall's time, past the load's end"


def test_a_holder_answers_a_ping_however_many_receivers_wait_for_its_channels() -> None:
    # A rank actor that has not loaded yet: each open_channel (peer_fanout=0: answered
    # once its load has ended) waits in the peer group, more of them than its threads;
    # the ping, in a group of its own, still answers, so no receiver takes it for frozen.
    from rayload.actors.peers import PEER_CONCURRENCY
    from rayload.actors.rank_group import _RemoteRankActor

    actor = _RemoteRankActor.options(num_cpus=0).remote(0)
    try:
        ray.get(actor.ready.remote(), timeout=60)
        waiting = [actor.open_channel.remote(20.0, {"w": 4}) for _ in range(PEER_CONCURRENCY + 2)]
        time.sleep(0.5)
        start = time.monotonic()
        assert ray.get(actor.peer_ping.remote(), timeout=5) == 0
        print(f"measured: ping answered in {time.monotonic() - start:.3f} s")
        assert not ray.wait(waiting, timeout=0)[0], "the channel calls are still waiting"
    finally:
        ray.kill(actor)


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


@pytest.fixture(scope="module")
def converted_url(s3: S3Server, pipeline_url: tuple[str, Path]) -> tuple[str, Path]:
    """The 16 MB checkpoint converted for TP 1 (``converted`` publishes only at its end:
    its files' checksums come after their bytes), in S3, and its local source."""
    from rayload.loading.convert import convert_checkpoint

    _, local = pipeline_url
    converted = convert_checkpoint(local, local.parent / "converted-tp1", 1)
    return s3.upload(converted, "ray-models", "pipeline-converted"), local


def test_a_root_that_publishes_at_its_end_outlasting_a_stall_two_hops_down_keeps_the_chain(
    s3: S3Server,
    converted_url: tuple[str, Path],
    slow_link: Callable[[float], None],
    set_test_hooks: Callable[..., None],
    no_leaks: Any,
) -> None:
    """A chain 0 -> 1 -> 2 whose root reads with ``converted``, which publishes only once
    its whole load is checked: for longer than 2's stall (its depth 2 times
    ``peer_stall_s``), no byte comes down the chain. 2 does not take that for a stall:
    1 offers 2 its channel only once 0 has answered 1 (at 0's end; until then 2's wait
    is one for a channel, watched by pings), so 2 gets everything from 1 and the server
    serves the checkpoint once."""
    url, local = converted_url
    prefix = url.removeprefix("s3://") + "/"
    stall_s = 1.0
    set_test_hooks(peer_bucket_bytes=PIECE_BYTES, peer_stall_s=stall_s)
    slow_link(4e6)  # about 4 s of reading, twice 2's stall
    s3.proxy.clear()
    with rayload.load(url, 1, device="cpu", replicas=3, peer_fanout=1, timeout=300) as result:
        served = s3.proxy.served_bytes(prefix)
        ranks, ids = result.ranks, result.replica_ids
        digests, shard = result.apply(_digests), result.plan.ranks[0].nbytes
    slow_link(0.0)
    assert digests[0] == digests[1] == digests[2] == _local_digests(local)
    root = ranks[0]
    assert root.method.effective is LoadMethod.CONVERTED
    read_s = root.phase_seconds("rank.read")
    assert read_s > 2 * stall_s, f"the root read for {read_s:.2f} s: not past 2's stall"
    for replica in (1, 2):
        report = ranks[replica]
        assert report.method.effective is LoadMethod.PEER, report.method.fallback_reason
        assert report.peer_switch is None
        assert report.bytes_from_storage == 0 and report.bytes_from_peers == shard
        assert report.source.startswith(f"peer replica={ids[replica - 1]} ")
    assert root.bytes_from_storage <= served <= 1.02 * root.bytes_from_storage, served
