"""rayload.loading.reader.pages: a read's fresh destination faulted in at once."""

from __future__ import annotations

import mmap
import time

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


def _fresh_tensors(sizes: list[int]) -> list[torch.Tensor]:
    """Fresh tensors of ``sizes`` bytes side by side in one untouched mapping (as the
    allocator places a receiver's many small tensors): views of it, in order."""
    return list(_fresh(sum(sizes)).split(sizes))


def test_prefaulter_maps_many_small_tensors_ahead_and_changes_no_written_byte() -> None:
    sizes = [512, 64 << 10, 256 << 10] * 120 + [3 * MIB]  # ~41 MiB, most far under 1 MiB
    tensors = _fresh_tensors(sizes)
    written = tensors[: len(tensors) // 2]
    for i, t in enumerate(written):  # a writer that got there first
        t.fill_(i % 251 + 1)
    before = _resident_kb()
    prefaulter = pages.Prefaulter(tensors)
    prefaulter.advance(sum(t.numel() for t in written))  # the rest is within AHEAD_BYTES
    prefaulter._thread.join(30)
    said = prefaulter.stop()
    if pages._unsupported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+): prefault is a no-op")
    assert said == f"{prefaulter.mapped} bytes mapped ahead"
    assert prefaulter.mapped >= sum(sizes)  # whole pages: a little more than the bytes
    unwritten = sum(t.numel() for t in tensors[len(written) :])
    assert (_resident_kb() - before) * 1024 >= 0.9 * unwritten
    assert all(bool((t == i % 251 + 1).all()) for i, t in enumerate(written))
    assert all(torch.count_nonzero(t) == 0 for t in tensors[len(written) :])


def test_prefaulter_waits_for_the_first_bytes_then_stays_at_most_its_window_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pages, "AHEAD_BYTES", 8 * MIB)
    monkeypatch.setattr(pages, "STEP_BYTES", 1 * MIB)
    tensors = _fresh_tensors([4 * MIB] * 8)  # 32 MiB
    prefaulter = pages.Prefaulter(tensors)
    try:
        time.sleep(0.3)
        assert prefaulter.mapped == 0  # nothing came yet: nothing mapped
        prefaulter.advance(2 * MIB)

        def settled() -> int:  # the thread stops moving once it is its window ahead
            deadline, last = time.monotonic() + 20, -1
            while prefaulter.mapped != last and time.monotonic() < deadline:
                last = prefaulter.mapped
                time.sleep(0.3)
            return last

        mapped = settled()
        if pages._unsupported:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
        assert 10 * MIB <= mapped <= 11 * MIB + mmap.PAGESIZE
        prefaulter.advance(30 * MIB)
        prefaulter._thread.join(20)
        assert prefaulter.mapped >= 32 * MIB
    finally:
        prefaulter.stop()


def test_page_ranges_merge_neighbours_and_skip_empty_tensors() -> None:
    whole = torch.empty(10 * mmap.PAGESIZE, dtype=torch.uint8)
    page = mmap.PAGESIZE
    base = whole.data_ptr()
    parts = [whole[:100], whole[100 : 2 * page], whole[2 * page : 2 * page], whole[6 * page :]]
    ranges = pages.page_ranges(parts)
    first = base // page * page
    assert ranges == [
        (first, -(-(base + 2 * page) // page) * page),
        ((base + 6 * page) // page * page, -(-(base + 10 * page) // page) * page),
    ]


def test_a_turned_off_prefaulter_maps_nothing_and_says_so() -> None:
    tensors = _fresh_tensors([8 * MIB])
    pages.enabled = False
    try:
        before = _resident_kb()
        prefaulter = pages.Prefaulter(tensors)
        assert prefaulter.stop() == "off"
        assert prefaulter.mapped == 0
        assert _resident_kb() - before < 4 * 1024
    finally:
        pages.enabled = True
