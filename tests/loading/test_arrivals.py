"""What ``Arrivals.landed`` counts: the bytes a range adds past a tensor's arrived prefix
(a peer's pieces span counts these, so a range sent again is not counted twice)."""

from __future__ import annotations

import torch

from rayload.loading.arrivals import Arrivals


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
