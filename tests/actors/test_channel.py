"""The peer channel's wire without Ray: what a receiver says when gloo fails, and which
pieces cross from and into their tensors' own memory."""

from __future__ import annotations

import pickle

import pytest
import torch

from rayload.actors.channel import _gloo_error, pieces, span
from rayload.loading.reader.sinks import ALIGN_BYTES, host_buffers

GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [192.0.2.2]:43656. This is typically caused by a remote worker crashing. Check "
    "the logs of the remote worker before reporting an error. GLHF! 🏖️"
)


@pytest.mark.parametrize(
    ("message", "said"),
    [
        (GLOO_CLOSED, "Connection closed by peer [192.0.2.2]:43656"),
        ("Connection reset by peer", "Connection reset by peer"),
        ("", "RuntimeError"),
    ],
)
def test_a_gloo_failure_is_said_without_its_source_line_and_advice(message: str, said: str) -> None:
    assert _gloo_error(RuntimeError(message)) == said


def test_host_buffers_lie_one_after_the_other_aligned_each_with_a_storage_of_its_own() -> None:
    sizes = [4096, 0, 640, 100, 64, 1 << 20]
    buffers = host_buffers(sizes)
    assert [b.numel() for b in buffers] == sizes
    assert all(b.dtype == torch.uint8 and b.dim() == 1 for b in buffers)
    at = [b.data_ptr() - buffers[0].data_ptr() for b in buffers]
    assert at[2:] == [4096, 4096 + 640, 4096 + 640 + 128, 4096 + 640 + 128 + 64]
    assert all(a % ALIGN_BYTES == 0 for a in at[2:]), "a gap after 100 bytes, none after 640"
    for b in buffers:
        b.fill_(len(b) % 251)
    assert [int(b[0]) for b in buffers if b.numel()] == [s % 251 for s in sizes if s]
    # One buffer pickles (e.g. returned through Ray) with its own bytes, not the whole run.
    assert len(pickle.dumps(buffers[4])) < 2048
    assert buffers[0].untyped_storage().nbytes() == 4096


def test_a_run_of_adjacent_views_is_one_span_over_their_memory_and_a_gap_is_none() -> None:
    a, b, c, d = host_buffers([256, 512, 100, 64])
    whole = span([a, b[:512]])
    assert whole is not None and whole.data_ptr() == a.data_ptr() and whole.numel() == 768
    whole.copy_(torch.arange(768).to(torch.uint8))
    assert a.tolist() == list(range(256)) and b.tolist() == [x % 256 for x in range(256, 768)]
    assert span([b]) is b, "a single view is its own span"
    assert span([c, d]) is None, "100 bytes leave a gap before the next buffer"
    assert span([a, c]) is None, "not adjacent"
    assert span([b[10:], c]) is not None, "the rest of a tensor cut short, then the next"
    separate = [torch.empty(256, dtype=torch.uint8) for _ in range(3)]
    assert span(separate) is None, "tensors allocated one by one are never adjacent"


def test_every_piece_of_a_models_tensors_in_host_buffers_crosses_in_place() -> None:
    # A Llama layer's shapes at width 256 (bf16): sizes that are multiples of 64 bytes.
    sizes = [256 * 2, 256 * 256 * 2, 64 * 256 * 2, 64 * 256 * 2, 256 * 256 * 2, 256 * 2]
    sizes = sizes * 40 + [4 << 20]
    views = host_buffers(sizes)
    cut = pieces(sizes, 1 << 20)
    assert any(len(p) > 1 for p in cut) and any(len(p) == 1 for p in cut)
    for piece in cut:
        assert span([views[k][a:b] for k, a, b in piece]) is not None, piece
