"""The peer channel (``rayload.actors.peers``) without actors: a holder's
:class:`ShardServer` and a receiver in two threads of this process, over a real two-rank
gloo group on loopback. What the receiver gets is compared byte for byte with what the
holder holds."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from rayload.actors.channel import span
from rayload.actors.peers import ShardServer, receive
from rayload.loading.peer import PeerUnavailable
from rayload.loading.reader.sinks import host_buffers

HOST = "127.0.0.1"


def _held() -> dict[str, torch.Tensor]:
    """Tensors of the kinds a checkpoint has: large ones (sent alone), small ones (packed
    into buckets), an empty one, a non-contiguous one, several dtypes."""
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(64, 512, generator=g),  # 128 KiB: over the 64 KiB buckets
        "norm": torch.randn(512, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 16),
        "ids": torch.randint(0, 1 << 30, (300,), generator=g, dtype=torch.int32),
        "transposed": torch.randn(96, 80, generator=g).t(),  # not contiguous
        "bias": torch.randn(1000, generator=g),
        "lm_head": torch.randn(80, 512, generator=g),
    }


def _sizes(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: t.numel() * t.element_size() for name, t in tensors.items()}


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def test_receiver_gets_every_tensor_byte_for_byte_in_buckets() -> None:
    held = _held()
    server = ShardServer(bucket_bytes=64 << 10)
    server.loaded(held)
    channel = server.open(HOST, 0.0, _sizes(held))
    into = {name: torch.full((n,), 0xAB, dtype=torch.uint8) for name, n in _sizes(held).items()}
    arrived = list(receive(channel, HOST, into))
    assert sorted(arrived) == sorted(held), "every tensor once, the empty one included"
    for name, tensor in held.items():
        assert bytes(into[name].numpy().tobytes()) == _bytes(tensor), name
    assert server.started == 1


@pytest.mark.parametrize("holder_together", [True, False])
def test_tensors_laid_out_together_cross_in_place_and_nothing_around_them_is_written(
    holder_together: bool,
) -> None:
    # The holder's tensors in one allocation (a storage load's) or one by one (a finished
    # load's own tensors); the receiver's in one, as the peer backend allocates them, with
    # a guard buffer after the last and a tensor cut short (its first bytes must stay).
    g = torch.Generator().manual_seed(1)
    first = {"norm": torch.randn(512, generator=g).to(torch.bfloat16)}  # cut short, below
    first |= {"q_norm": torch.randn(256, generator=g), "k_norm": torch.randn(1024, generator=g)}
    held = first | {n: t.contiguous() for n, t in _held().items() if n != "norm"}
    sizes = _sizes(held)
    if holder_together:
        memory = host_buffers([*sizes.values()])
        for buffer, tensor in zip(memory, held.values(), strict=True):
            buffer.copy_(tensor.reshape(-1).view(torch.uint8))
        held = dict(zip(held, memory, strict=True))
    server = ShardServer(bucket_bytes=64 << 10)
    server.loaded(held)
    *buffers, guard = host_buffers([*sizes.values(), 4096])
    for buffer in buffers:
        buffer.fill_(0xAB)
    guard.fill_(0xCD)
    into = dict(zip(sizes, buffers, strict=True))
    channel = server.open(HOST, 0.0, sizes, part=True, offsets={"norm": 10})
    runs = [[into[channel.names[k]][a:b] for k, a, b in p] for p in channel.pieces()]
    assert any(len(r) > 1 and span(r) is not None for r in runs), "a run crosses in place"
    assert any(span(r) is None for r in runs), "a run with a gap is packed"
    arrived = list(receive(channel, HOST, into))
    assert sorted(arrived) == sorted(held)
    for name, tensor in held.items():
        data, at = into[name].numpy().tobytes(), 10 if name == "norm" else 0
        assert data[:at] == b"\xab" * at and data[at:] == _bytes(tensor)[at:], name
    assert guard.numpy().tobytes() == b"\xcd" * 4096, "nothing written past the last tensor"


def test_a_tensor_cut_short_is_sent_from_where_its_bytes_stopped_and_nothing_before() -> None:
    held = _held()
    server = ShardServer(bucket_bytes=64 << 10)
    server.loaded(held)
    sizes = _sizes(held)
    # What another holder did not give: the end of "embed" (sent alone, in ranges), the
    # end of "ids" (packed with "lm_head"), all of "lm_head".
    offsets = {"embed": 100_001, "ids": 7}
    want = {name: sizes[name] for name in ("embed", "ids", "lm_head")}
    channel = server.open(HOST, 0.0, want, part=True, offsets=offsets)
    assert channel.starts == (100_001, 7, 0)
    assert channel.sent == sum(want.values()) - sum(offsets.values())
    into = {name: torch.full((n,), 0xAB, dtype=torch.uint8) for name, n in want.items()}
    ranges: list[tuple[str, int, int]] = []
    arrived = list(receive(channel, HOST, into, lambda n, a, k: ranges.append((n, a, k))))
    assert arrived == ["embed", "ids", "lm_head"]
    for name in want:
        at = offsets.get(name, 0)
        data = into[name].numpy().tobytes()
        assert data[:at] == b"\xab" * at, f"{name}: nothing written before its offset"
        assert data[at:] == _bytes(held[name])[at:], name
        mine = [(a, k) for n, a, k in ranges if n == name]
        assert mine[0][0] == at and sum(k for _, k in mine) == sizes[name] - at, name
    with pytest.raises(ValueError, match="offset 99999 of tensor 'ids' is outside its 1200"):
        server.open(HOST, 0.0, want, part=True, offsets={"ids": 99_999})


def test_holder_refuses_a_receiver_whose_plan_differs() -> None:
    held = _held()
    server = ShardServer()
    server.loaded(held)
    want = _sizes(held) | {"norm": 2}
    with pytest.raises(PeerUnavailable, match="its tensor 'norm' has 1024 bytes, this rank's"):
        server.open(HOST, 0.0, want)
    with pytest.raises(PeerUnavailable, match="holds no tensor 'extra'"):
        server.open(HOST, 0.0, _sizes(held) | {"extra": 4})


def test_holder_that_failed_or_still_loads_says_so() -> None:
    server = ShardServer()
    server.loading()
    with pytest.raises(PeerUnavailable, match="still loading after 0 s"):
        server.open(HOST, 0.0, {})
    server.failed("rank 0: disk gone")
    with pytest.raises(PeerUnavailable, match="its own load failed: rank 0: disk gone"):
        server.open(HOST, 0.0, {})


def test_reload_stops_a_send_under_way_and_the_receiver_fails() -> None:
    held = _held()
    server = ShardServer(pause_s=1.0, bucket_bytes=64 << 10)
    server.loaded(held)
    channel = server.open(HOST, 0.0, _sizes(held))
    into = {name: torch.empty(n, dtype=torch.uint8) for name, n in _sizes(held).items()}
    outcome: list[BaseException | list[str]] = []

    def receiving() -> None:
        try:
            outcome.append(list(receive(channel, HOST, into)))
        except BaseException as exc:  # the outcome is what is checked
            outcome.append(exc)

    thread = threading.Thread(target=receiving)
    thread.start()
    while server.started == 0:  # the first bucket has left; the holder pauses
        threading.Event().wait(0.01)
    server.loading()  # a reload begins: returns once the send has stopped
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(outcome[0], PeerUnavailable), outcome[0]
    assert "the channel broke after " in str(outcome[0])


# --- streaming: a holder still loading forwards each piece as it lands ---------------------


def _loading(
    server: ShardServer, held: dict[str, torch.Tensor]
) -> tuple[list[str], list[torch.Tensor]]:
    """Start a load on ``server`` whose memory is empty buffers of ``held``'s sizes: the
    names and buffers, published (nothing landed yet)."""
    server.loading()
    names = list(held)
    buffers = [torch.zeros(n, dtype=torch.uint8) for n in _sizes(held).values()]
    server.publish(names, buffers)
    return names, buffers


def _receiving(
    server: ShardServer, held: dict[str, torch.Tensor], forward: ShardServer | None = None
) -> tuple[threading.Thread, dict[str, torch.Tensor], list[tuple[float, str]], list[object]]:
    """A streaming receiver of ``server`` in a thread (forwarding into ``forward``'s
    published memory when given): its thread, memory, (time, name) arrivals, outcome."""
    import time

    channel = server.open(HOST, 5.0, _sizes(held), stream=True)
    if forward is not None:
        names, buffers = _loading(forward, held)
        into = dict(zip(names, buffers, strict=True))
        arrivals = forward._arrivals
        assert arrivals is not None
        landed = arrivals.landed_name
    else:
        into = {name: torch.zeros(n, dtype=torch.uint8) for name, n in _sizes(held).items()}
        landed = None
    seen: list[tuple[float, str]] = []
    outcome: list[object] = []

    def run() -> None:
        try:
            for name in receive(channel, HOST, into, landed):
                seen.append((time.monotonic(), name))
            outcome.append("done")
        except BaseException as exc:  # the outcome is what is checked
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, into, seen, outcome


def test_a_holder_still_loading_sends_each_piece_as_it_lands_and_the_next_forwards_it() -> None:
    import time

    held = _held()
    first, second = ShardServer(bucket_bytes=64 << 10), ShardServer(bucket_bytes=64 << 10)
    names, buffers = _loading(first, held)
    # The second replica receives from the first while the first loads, and forwards to a
    # third as it receives: a chain of three.
    t2, into2, _seen2, out2 = _receiving(first, held, forward=second)
    t3, into3, seen3, out3 = _receiving(second, held)
    arrivals = first._arrivals
    assert arrivals is not None
    source = {n: t.contiguous().reshape(-1).view(torch.uint8) for n, t in held.items()}
    landed_at = {}
    for k, name in enumerate(names):  # "storage": one tensor every 0.2 s, half then half
        size = arrivals.sizes[k]
        for start, stop in ((0, size // 2), (size // 2, size)):
            buffers[k][start:stop] = source[name][start:stop]
            landed_at[name] = time.monotonic()  # (just before its last bytes land)
            arrivals.landed(k, start, stop - start)
        time.sleep(0.2)
    t2.join(timeout=60)
    t3.join(timeout=60)
    assert out2 == ["done"] and out3 == ["done"], (out2, out3)
    for name, tensor in held.items():
        assert bytes(into2[name].numpy().tobytes()) == _bytes(tensor), name
        assert bytes(into3[name].numpy().tobytes()) == _bytes(tensor), name
    # Pipelined: the third had the first tensor long before the first's load ended.
    got3 = {name: at for at, name in seen3}
    assert got3["embed"] < landed_at["lm_head"] - 0.5
    assert all(got3[n] >= landed_at[n] for n in names if held[n].numel()), "not before it landed"


def test_a_holder_whose_load_fails_mid_stream_ends_its_receivers_with_what_had_landed() -> None:
    held = _held()
    server = ShardServer(bucket_bytes=64 << 10)
    _names, buffers = _loading(server, held)
    thread, into, seen, outcome = _receiving(server, held)
    arrivals = server._arrivals
    assert arrivals is not None
    buffers[0][:] = held["embed"].reshape(-1).view(torch.uint8)
    arrivals.landed(0, 0, arrivals.sizes[0])
    server.failed("rank 0: disk gone")
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(outcome[0], PeerUnavailable), outcome[0]  # the group dropped
    assert "the channel broke after " in str(outcome[0])
    assert [name for _, name in seen] == ["empty", "embed"]
    assert bytes(into["embed"].numpy().tobytes()) == _bytes(held["embed"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_root_streams_its_load_from_device_memory_to_a_receiver(tmp_path: Path) -> None:
    """A holder whose load goes to a GPU (scratch through staged copies) publishes device
    memory: a streaming receiver that opened its channel before the load began gets
    every byte (each piece copied from the device as its staging batch landed)."""
    from rayload.loading import load_rank, plan_shards
    from rayload.loading.reader.options import ReaderOptions
    from rayload.loading.synthetic import write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt", size_gb=0.02)
    expected, _ = load_rank(path, 0, 1, "scratch", "cpu")
    sizes = {s.name: s.nbytes for s in plan_shards(path, 1).ranks[0].shards}
    server = ShardServer(bucket_bytes=64 << 10)
    loaded: dict[str, torch.Tensor] = {}
    options = ReaderOptions(threads=2, chunk_bytes=64 << 10, staging_buffers=2)

    def load() -> None:
        tensors, _ = load_rank(
            path, 0, 1, "scratch", "cuda", publish=server.publish, reader_options=options
        )
        loaded.update(tensors)
        server.loaded(tensors)

    loader = threading.Thread(target=load)
    loader.start()
    channel = server.open(HOST, 60.0, sizes, stream=True)  # waits for the publish only
    into = {name: torch.full((n,), 0xAB, dtype=torch.uint8) for name, n in sizes.items()}
    arrived = list(receive(channel, HOST, into))
    loader.join(timeout=60)
    assert sorted(arrived) == sorted(sizes)
    assert all(t.device.type == "cuda" for t in loaded.values())
    for name, tensor in expected.items():
        assert bytes(into[name].numpy().tobytes()) == _bytes(tensor), name
