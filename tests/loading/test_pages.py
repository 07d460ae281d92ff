"""rayload.loading.reader.pages: a read's fresh destination faulted in at once."""

from __future__ import annotations

import mmap

import pytest
import torch

from rayload.loading.reader import pages
from rayload.loading.reader.sinks import host_view

MIB = 1 << 20


def _resident_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _fresh(nbytes: int) -> torch.Tensor:
    """Memory no page of which has been touched: an anonymous mapping of its own."""
    region = mmap.mmap(-1, nbytes)
    return torch.frombuffer(region, dtype=torch.uint8)


def test_prefault_makes_a_fresh_destination_resident_and_changes_no_byte() -> None:
    buffer = _fresh(64 * MIB)
    before = _resident_kb()
    pages.prefault(host_view(buffer))
    if pages._unsupported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+): prefault is a no-op")
    assert _resident_kb() - before >= 60 * 1024  # 64 MiB faulted in by one call
    assert torch.count_nonzero(buffer) == 0


def test_small_destinations_and_a_turned_off_prefault_are_left_alone() -> None:
    small = _fresh(pages.PREFAULT_BYTES // 2)
    before = _resident_kb()
    pages.prefault(host_view(small))
    assert _resident_kb() - before < pages.PREFAULT_BYTES // 1024
    big = _fresh(32 * MIB)
    pages.enabled = False
    try:
        before = _resident_kb()
        pages.prefault(host_view(big))
        assert _resident_kb() - before < 8 * 1024
    finally:
        pages.enabled = True
