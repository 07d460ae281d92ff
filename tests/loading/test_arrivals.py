"""What ``Arrivals.landed`` counts: the bytes a range adds past a tensor's arrived prefix
(a peer's pieces span counts these, so a range sent again is not counted twice)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rayload.loading.arrivals import Arrivals, ArrivalsEnded


def test_landed_counts_only_the_bytes_new_past_the_prefix() -> None:
    arrivals = Arrivals(["a"], [torch.empty(100, dtype=torch.uint8)])
    assert arrivals.landed(0, 0, 40) == 40
    assert arrivals.landed(0, 0, 40) == 0  # told twice
    assert arrivals.landed(0, 0, 60) == 20  # sent again from 0, past the prefix by 20
    assert arrivals.landed(0, 80, 20) == 20  # past the prefix: held back, counted whole
    assert arrivals.arrived(0) == 60
    assert arrivals.landed(0, 60, 20) == 20  # joins the held-back range
    assert arrivals.arrived(0) == 100 and arrivals.missing() == []
    assert arrivals.landed(0, 10, 0) == 0


def test_relayed_arrivals_start_with_their_first_byte_a_storage_read_s_at_once() -> None:
    """A peer receiver's arrivals (``relayed``) say bytes are coming only once its holder
    has answered (an empty range) or a byte has landed: its upstream may be waiting for
    a whole load first; a storage read's at once."""
    assert Arrivals(["a"], [torch.empty(8, dtype=torch.uint8)]).started(0.0) is True
    relayed = Arrivals(["a"], [torch.empty(8, dtype=torch.uint8)], relayed=True)
    assert relayed.started(0.05) is False
    assert relayed.landed(0, 0, 0) == 0  # the holder answered: nothing landed, but coming
    assert relayed.started(0.0) is True and relayed.arrived(0) == 0
    landed = Arrivals(["a"], [torch.empty(8, dtype=torch.uint8)], relayed=True)
    landed.landed(0, 4, 2)  # any byte, even past the prefix
    assert landed.started(0.0) is True
    finished = Arrivals(["a"], [torch.empty(8, dtype=torch.uint8)], relayed=True)
    finished.complete()
    assert finished.started(0.0) is True


def test_waiting_for_relayed_arrivals_to_start_ends_with_the_load() -> None:
    relayed = Arrivals(["a"], [torch.empty(8, dtype=torch.uint8)], relayed=True)
    threading.Timer(0.05, relayed.end, args=("its own load failed",)).start()
    with pytest.raises(ArrivalsEnded, match="its own load failed"):
        relayed.started(30.0)
    woken = Arrivals(["a"], [torch.empty(8, dtype=torch.uint8)], relayed=True)
    threading.Timer(0.05, woken.landed, args=(0, 0, 1)).start()
    began = time.monotonic()
    assert woken.started(30.0) is True
    assert time.monotonic() - began < 10.0  # woken by the byte, not by the timeout
