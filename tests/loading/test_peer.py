"""The ``peer`` method without Ray: a rank receives its shards from an in-process source
(``support.peers.TensorPeer``, serving tensors a storage load produced), bit for bit, and
reads storage instead, reported as a fallback, whenever the source fails."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from rayload.errors import MethodUnavailableError
from rayload.loading import load_rank, plan_shards
from rayload.loading.arrivals import Arrivals
from rayload.loading.convert import convert_checkpoint
from rayload.loading.methods import LoadMethod
from rayload.loading.peer import PIECES, PeerUnavailable, Uploads, receive_shards, source_label
from rayload.loading.rank import reload_rank
from rayload.loading.reader.options import ReaderOptions
from rayload.loading.reader.readplan import shard_segments
from rayload.loading.report import (
    READ,
    SYNC,
    TO_DEVICE,
    PhaseTimer,
    RankReport,
    mixed_method_warnings,
)
from rayload.loading.synthetic import write_checkpoint
from rayload.tracing import format_metrics_table, startup_metrics
from rayload.tracing.rank_spans import report_attributes
from support.peers import TensorPeer

TP = 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama written by transformers' ``save_pretrained`` (float32)."""
    pytest.importorskip("transformers")
    from support.transformers_models import write_llama_gqa

    return write_llama_gqa(tmp_path_factory.mktemp("peer") / "llama")


@pytest.fixture(params=["llama", "mixed_dtype"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    """The transformers Llama, and a checkpoint in BF16, F16, F32 and I32."""
    name = "llama" if request.param == "llama" else "mixed_dtype_checkpoint"
    path: Path = request.getfixturevalue(name)
    return path


def _storage(path: Path, rank: int = 1) -> tuple[dict[str, torch.Tensor], RankReport]:
    return load_rank(path, rank, TP, "scratch")


def _holder(path: Path, rank: int = 1, **faults: object) -> TensorPeer:
    """A peer holding rank ``rank``'s shards, loaded from storage by another "replica"."""
    tensors, _ = _storage(path, rank)
    return TensorPeer(tensors, rank=rank, **faults)  # type: ignore[arg-type]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# --- a peer that works -------------------------------------------------------------------


@pytest.mark.parametrize("method", ["auto", "peer"])
def test_peer_load_is_bit_identical_to_storage(checkpoint: Path, method: str) -> None:
    expected, storage_report = _storage(checkpoint)
    peer = _holder(checkpoint)
    tensors, report = load_rank(checkpoint, 1, TP, method, peer=peer)
    _assert_equal(tensors, expected)
    plan = plan_shards(checkpoint, TP).ranks[1]
    assert report.method.selected is LoadMethod.PEER
    assert report.method.effective is LoadMethod.PEER
    assert report.method.fallback_reason is None
    assert (
        report.bytes_from_peers
        == plan.nbytes
        == sum(t.numel() * t.element_size() for t in expected.values())
    )
    assert report.bytes_read == report.bytes_from_storage == 0
    assert storage_report.bytes_from_peers == 0 and storage_report.source == "storage"
    assert report.source == "peer replica=3f2a rank=1 node=ab12cd34" == source_label(peer)


@pytest.mark.parametrize(
    ("faults", "source"),
    [({}, "peer"), ({"fail_after": 2}, "peer and storage"), ({"fail_after": 0}, "storage")],
)
def test_peer_load_into_resident_tensors_writes_straight_into_them(
    checkpoint: Path, faults: dict[str, int], source: str
) -> None:
    # An engine's parameters on the CPU, a reload's tensors: the channel (or, for what it
    # did not give, storage) writes into that memory; nothing is loaded fresh and copied.
    expected, _ = _storage(checkpoint)
    resident = {name: torch.zeros_like(t) for name, t in expected.items()}
    pointers = {name: t.data_ptr() for name, t in resident.items()}
    tensors, report = load_rank(
        checkpoint, 1, TP, "peer", peer=_holder(checkpoint, **faults), into=resident
    )
    _assert_equal(tensors, expected)
    assert all(tensors[name] is resident[name] for name in resident)
    assert {name: t.data_ptr() for name, t in resident.items()} == pointers
    assert not [p for p in report.phases if p.attributes.get("copied_into_resident")]
    plan = plan_shards(checkpoint, TP).ranks[1]
    if source == "peer":
        assert (report.method.effective, report.bytes_from_peers) == (LoadMethod.PEER, plan.nbytes)
    else:
        assert report.method.effective is LoadMethod.SCRATCH
        assert (report.bytes_from_peers > 0) == (source == "peer and storage")


def test_auto_with_a_peer_says_why_it_chose_it(llama: Path) -> None:
    _, report = load_rank(llama, 0, TP, "auto", peer=_holder(llama, 0))
    [resolve] = [p for p in report.phases if p.name == "rank.resolve"]
    assert resolve.attributes["method.selected"] == "peer"
    assert "another replica holds this rank's shards" in resolve.attributes["resolve_reason"]


def test_peer_read_phase_names_the_source(llama: Path) -> None:
    _, report = load_rank(llama, 1, TP, "peer", peer=_holder(llama))
    assert [p.name for p in report.phases][2:6] == [READ, PIECES, TO_DEVICE, SYNC]
    [read] = [p for p in report.phases if p.name == READ]
    [pieces] = [p for p in report.phases if p.name == PIECES]
    # One piece per tensor from this source (it sends whole tensors), each timed.
    assert pieces.attributes["source"] == read.attributes["source"]
    shards = plan_shards(llama, TP).ranks[1].shards
    assert pieces.attributes["pieces"] == sum(1 for s in shards if s.nbytes)
    assert pieces.attributes["bytes"] == report.bytes_from_peers
    assert len(pieces.attributes["piece_ms"]) == pieces.attributes["pieces"]
    assert read.start_ns <= pieces.start_ns <= pieces.end_ns <= read.end_ns
    assert read.error is None
    assert read.attributes["source"] == "peer replica=3f2a rank=1 node=ab12cd34"
    assert read.attributes["peer.replica"] == "3f2a"
    assert read.attributes["peer.rank"] == 1
    assert read.attributes["peer.node_id"] == "ab12cd34"
    assert (
        read.attributes["bytes"] == read.attributes["bytes_from_peers"] == report.bytes_from_peers
    )


def test_peer_without_node_id_says_node_unknown(llama: Path) -> None:
    tensors, _ = _storage(llama)
    peer = TensorPeer(tensors, rank=1, node_id=None)
    _, report = load_rank(llama, 1, TP, "peer", peer=peer)
    assert report.source == "peer replica=3f2a rank=1 node=unknown"


def test_other_methods_ignore_a_peer(llama: Path) -> None:
    peer = _holder(llama)
    _, report = load_rank(llama, 1, TP, "scratch", peer=peer)
    assert peer.served == 0
    assert report.method.effective is LoadMethod.SCRATCH
    assert (report.bytes_from_peers, report.source) == (0, "storage")
    assert report.bytes_read > 0


# --- a peer that fails -------------------------------------------------------------------


FAULTS = {
    # fault: (TensorPeer's faults, the cause in the reason, how many tensors it kept)
    "dies after 2 shards": ({"fail_after": 2}, "the holder's actor died after 2 shards", 2),
    "dies before any shard": ({"fail_after": 0}, "died after 0 shards", 0),
    "raises something else": (
        {"fail_after": 3, "error": ConnectionResetError("object store lost")},
        "ConnectionResetError: object store lost",
        3,
    ),
    "holds a wrong length": (
        {"short": "model.norm.weight"},
        "its tensor 'model.norm.weight' has",
        0,
    ),
    "omits a tensor": ({"omit": "lm_head.weight"}, "without sending 1 of the", -1),
    "sends an unknown tensor": (
        {"extra": "model.bogus"},
        "'model.bogus', which rank 1's plan",
        0,  # its plan differs: nothing it sent is kept
    ),
}


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
def test_failing_peer_falls_back_to_storage_with_the_same_bytes(
    mixed_dtype_checkpoint: Path, fault: str
) -> None:
    faults, cause, kept = FAULTS[fault]
    path = mixed_dtype_checkpoint
    expected, storage_report = _storage(path)
    peer = _holder(path, **faults)
    tensors, report = load_rank(path, 1, TP, "auto", peer=peer)
    _assert_equal(tensors, expected)
    assert report.method.selected is LoadMethod.PEER
    assert report.method.effective is LoadMethod.SCRATCH
    reason = report.method.fallback_reason
    assert reason is not None
    assert reason.startswith("replica 3f2a rank 1 on node ab12cd34 failed mid-transfer: ")
    assert cause in reason
    shards = plan_shards(path, TP).ranks[1].shards
    if kept == 0:  # all of it from storage
        assert reason.endswith("; read from storage instead")
        assert report.bytes_read == storage_report.bytes_read
        assert (report.bytes_from_peers, report.source) == (0, "storage")
        return
    # What had arrived is kept: storage is read for the rest only, not from the start.
    kept_shards = shards[:kept] if kept > 0 else shards[:-1]
    got = sum(s.nbytes for s in kept_shards)
    assert f"{len(kept_shards)} of {len(shards)} tensors ({got} bytes) had arrived" in reason
    assert report.bytes_from_peers == got
    # (the reader's bytes: its gathered runs of strided rows count whole)
    assert sum(s.nbytes for s in shards) - got <= report.bytes_read < storage_report.bytes_read
    assert report.source.startswith("peer replica=3f2a ")


def test_failing_peer_spans_say_what_came_from_storage(llama: Path) -> None:
    _, report = load_rank(llama, 1, TP, "peer", peer=_holder(llama, fail_after=1))
    names = [p.name for p in report.phases]
    # The rest is read into the same host memory (no storage method's own to_device),
    # then moved as a whole.
    assert names[2:] == [READ, PIECES, READ, TO_DEVICE, SYNC, "rank.post_load"]
    peer_read, _, storage_read, to_device = report.phases[2:6]
    assert peer_read.error is None, "a peer failure is a fallback, not a failed rank"
    assert peer_read.attributes["source"].startswith("peer ")
    assert "died after 1 shards" in peer_read.attributes["peer.error"]
    assert storage_read.attributes["source"] == "storage"
    assert to_device.attributes.get("source") != "storage"
    assert "peer.replica" not in storage_read.attributes
    shards = plan_shards(llama, TP).ranks[1].shards
    assert storage_read.attributes["bytes"] == sum(s.nbytes for s in shards[1:])


# --- alternates: another holder gives what the first did not ---------------------------


def _bytes_of(shards: object) -> int:
    return sum(s.nbytes for s in shards)  # type: ignore[attr-defined]


def test_a_peer_failing_part_way_its_alternate_gives_the_rest_and_storage_is_not_read(
    llama: Path,
) -> None:
    expected, _ = _storage(llama)
    alternate = _holder(llama, part=True)
    alternate.replica = "77aa"
    peer = _holder(llama, fail_after=2, others=[alternate])
    tensors, report = load_rank(llama, 1, TP, "peer", peer=peer)
    _assert_equal(tensors, expected)
    shards = plan_shards(llama, TP).ranks[1].shards
    kept, rest = _bytes_of(shards[:2]), _bytes_of(shards[2:])
    assert report.method.effective is LoadMethod.PEER, "peer to peer is not a fallback"
    assert report.method.fallback_reason is None
    assert (report.bytes_read, report.bytes_from_peers) == (0, kept + rest)
    assert alternate.served == len(shards) - 2, "the alternate sends only what was missing"
    switch = report.peer_switch or ""
    assert switch.startswith("replica 3f2a rank 1 on node ab12cd34 failed mid-transfer: ")
    assert "died after 2 shards" in switch
    assert f"2 of {len(shards)} tensors ({kept} bytes) had arrived and were kept" in switch
    assert f"{len(shards) - 2} ({rest} bytes) came from replica 77aa rank 1" in switch
    # From whom each piece came: one span per source.
    pieces = [p for p in report.phases if p.name == PIECES]
    assert [p.attributes["source"] for p in pieces] == [
        source_label(peer),
        source_label(alternate),
    ]
    assert [p.attributes["bytes"] for p in pieces] == [kept, rest]
    assert report_attributes(report)["peer_switch"] == switch
    assert report.to_dict()["peer_switch"] == switch
    assert mixed_method_warnings([report]) == [f"rank 1 switched peers: {switch}"]
    metrics = startup_metrics([report], placement_seconds=0.0, actor_startup_seconds={})
    table = format_metrics_table(metrics)
    assert f"rank 1 switched peers: {switch}" in table


def test_a_tensor_cut_short_is_resumed_by_the_alternate_from_where_its_bytes_stopped(
    llama: Path,
) -> None:
    expected, _ = _storage(llama)
    shards = plan_shards(llama, TP).ranks[1].shards
    cut_name, cut = shards[2].name, shards[2].nbytes // 2
    assert cut > 0
    alternate = _holder(llama, part=True)
    alternate.replica = "77aa"
    peer = _holder(llama, fail_after=2, cut_at=cut, others=[alternate])
    tensors, report = load_rank(llama, 1, TP, "peer", peer=peer)
    _assert_equal(tensors, expected)
    assert alternate.asked == {cut_name: cut}, "asked for what is left of the cut tensor only"
    kept, rest = _bytes_of(shards[:2]) + cut, _bytes_of(shards[2:]) - cut
    assert (report.bytes_read, report.bytes_from_peers) == (0, kept + rest)
    pieces = [p for p in report.phases if p.name == PIECES]
    assert [p.attributes["bytes"] for p in pieces] == [kept, rest], "each byte once"
    assert (
        f"2 of {len(shards)} tensors ({kept} bytes) had arrived and were kept, "
        f"{len(shards) - 2} ({rest} bytes, {cut_name!r} from byte {cut} on) came from "
        "replica 77aa rank 1"
    ) in (report.peer_switch or "")


def _strided(shard: object) -> bool:
    """Whether ``shard``'s bytes are rows a stride apart in its file (split-1)."""
    return any(seg.row for seg in shard_segments([shard]))  # type: ignore[list-item]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "split-1 rows"])
def test_a_tensor_cut_short_is_read_from_storage_from_the_byte_where_it_stopped(
    llama: Path, strided: bool
) -> None:
    """``scratch`` reads byte ranges: of a tensor a failed peer cut short, only the bytes
    after its arrived prefix are read (a split-1 tensor's from inside a row: that row's
    end, then its other rows), the first ones kept and counted so."""
    expected, _ = _storage(llama)
    shards = plan_shards(llama, TP).ranks[1].shards
    k = next(i for i, s in enumerate(shards) if i >= 2 and _strided(s) == strided)
    cut_name, cut = shards[k].name, shards[k].nbytes // 2 + 5  # not on a row's edge
    peer = _holder(llama, fail_after=k, cut_at=cut)
    tensors, report = load_rank(llama, 1, TP, "peer", peer=peer)
    _assert_equal(tensors, expected)
    kept = _bytes_of(shards[:k]) + cut
    assert report.bytes_from_peers == kept
    assert (
        f"{k} of {len(shards)} tensors ({kept} bytes) had arrived and were kept, the other "
        f"{len(shards) - k} ({_bytes_of(shards[k:]) - cut} bytes, {cut_name!r} from byte "
        f"{cut} on) were read from storage"
    ) in (report.method.fallback_reason or "")
    # What the reader was asked for (its bytes_read counts split-1 rows' gaps too).
    [read] = [p for p in report.phases if p.name == READ and p.attributes["source"] == "storage"]
    assert read.attributes["bytes"] == _bytes_of(shards[k:]) - cut


def test_a_tensor_cut_short_is_read_whole_by_a_method_that_reads_whole_tensors(
    llama: Path, tmp_path: Path
) -> None:
    """``converted`` reads (and checks) whole files' tensors: a cut tensor is read again
    whole, and its first bytes are not counted kept."""
    converted = convert_checkpoint(llama, tmp_path / "tp2", TP)
    expected, _ = load_rank(converted, 1, TP, "converted")
    shards = plan_shards(converted, TP).ranks[1].shards
    holder = TensorPeer(expected, fail_after=2, cut_at=shards[2].nbytes // 2)
    tensors, report = load_rank(converted, 1, TP, "peer", peer=holder)
    _assert_equal(tensors, expected)
    assert report.method.effective is LoadMethod.CONVERTED
    kept = _bytes_of(shards[:2])
    assert report.bytes_from_peers == kept
    assert (
        f"2 of {len(shards)} tensors ({kept} bytes) had arrived and were kept, the other "
        f"{len(shards) - 2} ({_bytes_of(shards[2:])} bytes) were read from storage"
    ) in (report.method.fallback_reason or "")


def test_tail_segments_read_exactly_a_shard_s_bytes_from_any_byte_on(llama: Path) -> None:
    """The reader's plan of a shard's bytes from byte ``start`` on, checked against the
    whole shard read, for every shard of a real checkpoint and starts at its first byte,
    inside a row, on a row's edge and at its last byte."""
    from rayload.loading.reader.options import ReaderOptions
    from rayload.loading.reader.readplan import tail_segments
    from rayload.loading.reader.reads import read_segments

    for shard in plan_shards(llama, TP).ranks[1].shards:
        [whole], _, _ = read_segments(
            shard_segments([shard]), [shard.nbytes], torch.device("cpu"), ReaderOptions()
        )
        row = next((seg.row for seg in shard_segments([shard]) if seg.row), 4)
        for start in sorted({0, 1, row, row + 3, shard.nbytes // 2, shard.nbytes - 1}):
            segments = tail_segments(shard_segments([shard]), start, 0)
            [tail], _, _ = read_segments(
                segments, [shard.nbytes - start], torch.device("cpu"), ReaderOptions()
            )
            assert torch.equal(tail, whole[start:]), (shard.name, start)


def test_every_peer_failing_the_rest_is_read_from_storage_each_failure_named(
    llama: Path,
) -> None:
    expected, _ = _storage(llama)
    alternate = _holder(llama, part=True, fail_after=1)
    alternate.replica = "77aa"
    peer = _holder(llama, fail_after=2, others=[alternate])
    tensors, report = load_rank(llama, 1, TP, "peer", peer=peer)
    _assert_equal(tensors, expected)
    shards = plan_shards(llama, TP).ranks[1].shards
    assert report.method.effective is LoadMethod.SCRATCH
    reason = report.method.fallback_reason or ""
    assert "replica 77aa rank 1 on node ab12cd34 failed too: the holder's actor died" in reason
    assert (
        f"2 of {len(shards)} tensors ({_bytes_of(shards[:2])} bytes) had arrived and were "
        f"kept, 1 ({shards[2].nbytes} bytes) came from replica 77aa rank 1 on node ab12cd34, "
        f"the other {len(shards) - 3} ({_bytes_of(shards[3:])} bytes) were read from storage"
    ) in reason
    assert report.bytes_from_peers == _bytes_of(shards[:3])
    assert report.bytes_read > 0
    assert report.peer_switch is not None and "came from replica 77aa" in report.peer_switch


def test_a_publishing_rank_whose_peer_gave_nothing_reads_storage_into_the_same_arrivals(
    llama: Path,
) -> None:
    """A rank that forwards (``publish``) keeps its one Arrivals when its peer fails before
    any byte: its own receivers follow the storage read instead of being cut off."""
    published: list[Arrivals] = []

    def publish(
        names: Sequence[str], buffers: Sequence[torch.Tensor], *, relayed: bool = False
    ) -> Arrivals:
        published.append(Arrivals(names, buffers, relayed=relayed))
        return published[-1]

    expected, _ = _storage(llama)
    tensors, report = load_rank(
        llama, 1, TP, "peer", peer=_holder(llama, fail_after=0), publish=publish
    )
    _assert_equal(tensors, expected)
    assert report.method.effective is LoadMethod.SCRATCH
    assert len(published) == 1, "published once: the receivers' arrivals were never replaced"
    assert published[0].missing() == []
    shards = plan_shards(llama, TP).ranks[1].shards
    assert f"0 of {len(shards)} tensors (0 bytes) had arrived and were kept" in (
        report.method.fallback_reason or ""
    )


def test_an_alternate_is_asked_for_nothing_when_the_first_peer_gave_everything(
    llama: Path,
) -> None:
    alternate = _holder(llama, part=True)
    _, report = load_rank(llama, 1, TP, "peer", peer=_holder(llama, others=[alternate]))
    assert alternate.served == 0
    assert report.peer_switch is None
    assert "peer_switch" not in {k for k, v in report_attributes(report).items() if v}


def test_failing_peer_under_strict_raises_method_unavailable(llama: Path) -> None:
    with pytest.raises(MethodUnavailableError, match="failed mid-transfer") as info:
        load_rank(llama, 1, TP, "auto", peer=_holder(llama, fail_after=1), strict=True)
    assert "rank 1: peer ran as scratch" in str(info.value)


def test_fetch_that_raises_when_called_falls_back(llama: Path) -> None:
    class Refusing(TensorPeer):
        def fetch(self, plan, destinations, landed=None, offsets=None):  # type: ignore[no-untyped-def]
            raise PeerUnavailable("the holder replica was shut down")

    tensors, _ = _storage(llama)
    _, report = load_rank(llama, 1, TP, "peer", peer=Refusing(tensors, rank=1))
    assert report.method.effective is LoadMethod.SCRATCH
    assert "the holder replica was shut down" in (report.method.fallback_reason or "")


def test_receive_shards_closes_the_peer_iterator_when_it_fails(llama: Path) -> None:
    closed = []
    peer = _holder(llama, extra="model.bogus")
    inner = peer.fetch

    def fetch(plan, destinations, landed=None, offsets=None):  # type: ignore[no-untyped-def]
        try:
            yield from inner(plan, destinations, landed, offsets)
        finally:
            closed.append(True)

    peer.fetch = fetch  # type: ignore[method-assign]
    plan = plan_shards(llama, TP).ranks[1]
    destinations = [torch.empty(s.nbytes, dtype=torch.uint8) for s in plan.shards]
    with pytest.raises(PeerUnavailable, match=r"model\.bogus"):
        receive_shards(plan, peer, destinations)
    assert closed == [True]


# --- no peer -----------------------------------------------------------------------------


def test_peer_without_a_source_falls_back_to_storage_with_the_reason(llama: Path) -> None:
    expected, _ = _storage(llama)
    tensors, report = load_rank(llama, 1, TP, "peer")
    _assert_equal(tensors, expected)
    assert report.method.selected is LoadMethod.SCRATCH
    assert report.method.fallback_reason == (
        "no replica holding this checkpoint (same identity and plan) was found; read from storage"
    )


def test_peer_without_a_source_under_strict_raises(llama: Path) -> None:
    with pytest.raises(MethodUnavailableError, match="no replica holding this checkpoint"):
        load_rank(llama, 1, TP, "peer", strict=True)


def test_reload_with_method_peer_reads_storage_and_says_so(llama: Path) -> None:
    tensors, _ = _storage(llama)
    resident = {name: torch.zeros_like(t) for name, t in tensors.items()}
    report = reload_rank(llama, 1, TP, resident, "peer")
    _assert_equal(resident, tensors)
    assert report.method.selected is LoadMethod.SCRATCH
    assert "no replica holding this checkpoint" in (report.method.fallback_reason or "")


# --- accounting --------------------------------------------------------------------------


def test_report_json_span_attributes_and_metrics_count_peer_bytes(llama: Path) -> None:
    _, from_peer = load_rank(llama, 0, TP, "peer", peer=_holder(llama, 0))
    _, from_storage = _storage(llama, 1)
    entry = from_peer.to_dict()
    assert entry["bytes_from_peers"] == from_peer.bytes_from_peers > 0
    assert entry["bytes_from_storage"] == entry["bytes_read"] == 0
    assert entry["source"] == from_peer.source
    attributes = report_attributes(from_peer)
    assert attributes["bytes_from_peers"] == from_peer.bytes_from_peers
    assert attributes["bytes_from_storage"] == 0
    assert attributes["source"] == from_peer.source

    metrics = startup_metrics(
        [from_peer, from_storage], placement_seconds=0.0, actor_startup_seconds={}
    )
    rank0, rank1 = metrics["ranks"]
    assert (rank0["bytes_from_peers"], rank0["bytes_from_storage"]) == (
        from_peer.bytes_from_peers,
        0,
    )
    assert rank1["bytes_from_storage"] == from_storage.bytes_read
    aggregate = metrics["aggregate"]
    assert aggregate["bytes_from_peers"]["total"] == from_peer.bytes_from_peers
    assert aggregate["bytes_from_storage"]["total"] == from_storage.bytes_read
    assert aggregate["bytes_from_peers"]["slowest_rank"] is None
    assert metrics["method"] == "peer,scratch"


# --- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peer_load_onto_cuda_is_bit_identical_to_storage(mixed_dtype_checkpoint: Path) -> None:
    path = mixed_dtype_checkpoint
    expected, _ = load_rank(path, 1, TP, "scratch", "cuda")
    tensors, report = load_rank(path, 1, TP, "peer", "cuda", peer=_holder(path))
    assert report.method.effective is LoadMethod.PEER and report.device == "cuda:0"
    assert all(t.device == torch.device("cuda", 0) for t in tensors.values())
    _assert_equal(tensors, expected)
    # Each tensor went to the device as it landed, not all after the last.
    [to_device] = [p for p in report.phases if p.name == TO_DEVICE]
    assert to_device.attributes["copied_while_receiving"] == report.bytes_from_peers
    _, fell_back = load_rank(path, 1, TP, "peer", "cuda", peer=_holder(path, fail_after=1))
    assert fell_back.method.effective is not LoadMethod.PEER


class _CheckedArrivals(Arrivals):
    """Real arrivals that check each mark as it is made: the bytes marked must be in the
    device memory already, equal to ``expected`` (tensor index -> its bytes on the host)."""

    def __init__(
        self, names: Sequence[str], buffers: Sequence[torch.Tensor], expected: list[torch.Tensor]
    ) -> None:
        super().__init__(names, buffers)
        self.expected = expected
        self.wrong: list[str] = []

    def landed(self, index: int, offset: int, length: int) -> int:
        got = self.buffers[index][offset : offset + length].cpu()
        if not torch.equal(got, self.expected[index][offset : offset + length]):
            self.wrong.append(f"{self.names[index]} bytes {offset}..{offset + length}")
        return super().landed(index, offset, length)


class _ArrivedAtToDevice(PhaseTimer):
    """Notes how many bytes had been marked arrived when ``rank.to_device`` began (the
    staged copies' last wait)."""

    def __init__(self, arrivals: list[_CheckedArrivals]) -> None:
        super().__init__()
        self.arrivals = arrivals
        self.before_to_device: int | None = None

    @contextmanager
    def phase(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        if name == TO_DEVICE:
            a = self.arrivals[0]
            self.before_to_device = sum(a.arrived(i) for i in range(len(a.sizes)))
        with super().phase(name, **attributes) as attrs:
            yield attrs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_storage_load_onto_cuda_marks_each_batch_once_its_copy_has_landed(
    tmp_path: Path,
) -> None:
    """A GPU root of the pipelined fan-out forwards while it loads: scratch onto a GPU
    marks each staging batch's bytes as arrived once its host-to-device copy is done
    (every mark checked against the bytes in device memory at that moment), most of them
    before the load's last wait: all but the batches of the last window (staging
    buffers), not all at its end."""
    path = write_checkpoint(tmp_path / "ckpt", size_gb=0.02)  # some 300 batches of 64 KiB
    expected, _ = _storage(path)
    host = {n: t.contiguous().view(-1).view(torch.uint8) for n, t in expected.items()}
    made: list[_CheckedArrivals] = []

    def publish(
        names: Sequence[str], buffers: Sequence[torch.Tensor], *, relayed: bool = False
    ) -> Arrivals:
        made.append(_CheckedArrivals(names, buffers, [host[n] for n in names]))
        return made[-1]

    timer = _ArrivedAtToDevice(made)
    chunk, staging = 64 << 10, 2
    options = ReaderOptions(threads=2, chunk_bytes=chunk, staging_buffers=staging)
    tensors, _ = load_rank(
        path, 1, TP, "scratch", "cuda", publish=publish, timer=timer, reader_options=options
    )
    _assert_equal({k: v.cpu() for k, v in tensors.items()}, expected)
    [arrivals] = made
    assert all(b.device.type == "cuda" for b in arrivals.buffers)
    assert arrivals.wrong == [], "marked before its copy had landed"
    assert arrivals.missing() == []
    total = sum(arrivals.sizes)
    assert timer.before_to_device is not None
    # A batch is marked at the latest when its staging buffer is taken again: by the
    # load's last wait, only the last window's batches (and the one released last) can
    # still be on their way.
    unmarked = total - timer.before_to_device
    assert 0 <= unmarked <= (staging + 1) * chunk, (unmarked, total)


# --- the channel's buckets ----------------------------------------------------------------


def _upload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rayload-upload"]


def test_uploads_copy_each_tensor_once_it_has_wholly_landed_and_end_their_thread() -> None:
    # The CPU stands in for the device: the copies are real, on the uploads' own thread.
    hosts = [torch.arange(n, dtype=torch.int32) for n in (4, 6, 0, 5)]
    views = [h.view(torch.uint8) for h in hosts]
    arrivals = Arrivals([f"t{i}" for i in range(4)], views)
    before = _upload_threads()
    with Uploads(arrivals, hosts, torch.device("cpu")) as uploads:
        arrivals.landed(0, 0, 16)
        uploads.landed(0)
        arrivals.landed(1, 0, 8)  # 8 of its 24 bytes
        uploads.landed(1)
        uploads.landed(2)  # empty: whole at once
        arrivals.landed(3, 0, 20)
        uploads.landed(3)
        uploads.landed(3)  # told twice: copied once
        assert len(_upload_threads()) == len(before) + 1
        copies = uploads.finish()
    assert sorted(copies) == [0, 2, 3]
    for i, copy in copies.items():
        assert torch.equal(copy, hosts[i])
        assert not copy.numel() or copy.data_ptr() != hosts[i].data_ptr()
    assert _upload_threads() == before


def test_uploads_without_a_device_copy_nothing_and_start_no_thread() -> None:
    hosts = [torch.ones(3)]
    arrivals = Arrivals(["t"], [hosts[0].view(torch.uint8)])
    arrivals.landed(0, 0, 12)
    before = _upload_threads()
    with Uploads(arrivals, hosts, None) as uploads:
        uploads.landed(0)
        assert _upload_threads() == before
    assert uploads.finish() == {}


def test_leaving_uploads_on_an_error_ends_their_thread() -> None:
    hosts = [torch.ones(3)]
    arrivals = Arrivals(["t"], [hosts[0].view(torch.uint8)])
    before = _upload_threads()
    with (
        pytest.raises(RuntimeError, match="the load failed"),
        Uploads(arrivals, hosts, torch.device("cpu")),
    ):
        raise RuntimeError("the load failed")
    assert _upload_threads() == before


def test_buckets_pack_small_tensors_send_large_ones_alone_and_skip_empty_ones() -> None:
    from rayload.actors.peers import buckets

    sizes = [1, 2, 0, 10, 3, 3, 3, 5]
    runs = buckets(sizes, limit=5)
    assert runs == [[0, 1], [3], [4], [5], [6], [7]]
    # Every non-empty tensor is sent exactly once, in order, and no run is over the limit
    # unless it is one tensor of the limit or more.
    assert [i for run in runs for i in run] == [i for i, n in enumerate(sizes) if n]
    assert all(sum(sizes[i] for i in run) <= 5 or len(run) == 1 for run in runs)
    assert buckets([4, 1, 1], limit=6) == [[0, 1, 2]]
    assert buckets([0, 0], limit=5) == []


def test_pieces_ramp_up_then_cover_every_byte_once_in_order() -> None:
    import random

    from rayload.actors.channel import RAMP_PIECES, pieces

    # One large tensor: ranges of a sixteenth, an eighth, a quarter, a half, then whole.
    assert [b - a for ((_, a, b),) in pieces([1000], limit=64)][:7] == [4, 8, 16, 32, 64, 64, 64]
    # Small tensors: the first packed pieces are small too, later ones fill the limit.
    assert [len(p) for p in pieces([1] * 64, limit=16)] == [1, 2, 4, 8, 16, 16, 16, 1]
    # A tensor cut short is sent from where its bytes stopped, as a tensor of what is left.
    assert pieces([1000, 10], limit=64, ramp=0, starts=[990, 4]) == [((0, 990, 1000), (1, 4, 10))]
    rng = random.Random(31)
    for round_ in range(400):
        sizes = [rng.choice([0, 1, 3, 40, 64, 65, 200]) for _ in range(rng.randrange(1, 30))]
        starts = [rng.choice([0, 0, rng.randint(0, n)]) for n in sizes] if round_ % 2 else None
        begin = starts or [0] * len(sizes)
        out = pieces(sizes, limit=64, starts=starts)
        ranges = [r for piece in out for r in piece]
        # Every byte of every tensor from its start exactly once, in order (a tensor with
        # nothing to send in no piece).
        for k, size in enumerate(sizes):
            mine = [(a, b) for j, a, b in ranges if j == k]
            if begin[k] == size:
                assert not mine
                continue
            assert [a for a, _ in mine] == [begin[k], *[b for _, b in mine][:-1]]
            assert mine[-1][1] == size
        assert [j for j, _, _ in ranges] == sorted(j for j, _, _ in ranges)
        for i, piece in enumerate(out):
            cap = 64 >> max(RAMP_PIECES - i, 0)
            # No piece is over its cap; several tensors in one are each whole from their
            # start (a tensor that does not fit goes alone, in ranges).
            assert sum(b - a for _, a, b in piece) <= cap
            assert len(piece) == 1 or all(a == begin[j] and b == sizes[j] for j, a, b in piece)
