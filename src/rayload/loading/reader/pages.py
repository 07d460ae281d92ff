"""Faulting in a read's destination pages before the read writes them.

Memory the kernel has not handed out yet (a fresh ``torch.empty``, an engine's
parameters right after it built its model) costs a page fault per 4 KiB page on its
first write, and the kernel zeroes each page. When a read writes such memory, those
faults cost more than the copy itself: here 180 MB of fresh memory took 90 ms to read
from the page cache, of which 15 ms were the copy (docs/benchmarks.md, "Straight into
vLLM's parameters"). ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) faults a whole range
in with one system call instead: :func:`prefault` does it for a read's destination,
on the reader thread that is about to read into it, so the threads of a load share the
work. It changes no byte (the pages read as zeros until the read writes them) and is
skipped where the kernel lacks it or the range is under :data:`PREFAULT_BYTES`.

A peer receiver's destinations are many tensors, written as the network delivers, while
its CPU mostly waits: :class:`Prefaulter` faults them in beforehand from a thread of the
lowest CPU priority (nice 19: CPU time nothing else wants), in the order they will be
written, every tensor however small (adjacent ones share one call), once the first bytes
have come and at most :data:`AHEAD_BYTES` ahead of them: faulting a whole shard in at
once, as a load starts, slowed the first pieces of replicas started together (their
store's first bytes, on a shared host, waited for it). Mapping pages changes no byte, so
it may run ahead of, beside or behind the writer with no race.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

MADV_POPULATE_WRITE = 23
"""Linux's ``madvise`` advice: populate (prefault) page tables writable (since 5.14)."""
PREFAULT_BYTES = 1 << 20
"""Destinations smaller than this are left to fault page by page (a strided split-1 row,
a norm's weight): one more system call would cost what it saves."""
_PAGE = mmap.PAGESIZE


@functools.cache
def _madvise() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    return madvise


_unsupported = False
enabled = True
"""False turns prefaulting off in this process (benchmarks/vllm_load.py compares both in
one run)."""


def prefault(view: memoryview) -> None:
    """Fault in the whole pages inside ``view`` (a writable buffer about to be written
    whole) at once; a no-op for small views and where ``MADV_POPULATE_WRITE`` is
    unsupported (then never tried again in this process)."""
    if view.nbytes < PREFAULT_BYTES:
        return
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    _populate(-(-address // _PAGE) * _PAGE, (address + view.nbytes) // _PAGE * _PAGE)


def _populate(start: int, end: int) -> bool:
    """``MADV_POPULATE_WRITE`` over the pages ``start .. end`` (page-aligned addresses);
    False when it did nothing: turned off, unsupported (then never tried again in this
    process) or refused for this range (ENOMEM: no longer mapped, the writer maps it)."""
    global _unsupported
    if _unsupported or not enabled or end <= start:
        return False
    madvise = _madvise()
    if madvise is None:
        _unsupported = True
        return False
    if madvise(start, end - start, MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:  # before 5.14: fault page by page, as before
        _unsupported = True
    return False


STEP_BYTES = 16 << 20
"""The most bytes one call of a :class:`Prefaulter` maps, so that it sees ``stop`` soon."""
AHEAD_BYTES = 64 << 20
"""How far a :class:`Prefaulter` maps ahead of the bytes that have come (at 200 MB/s, a
third of a second)."""
JOIN_S = 1.0
"""How long :meth:`Prefaulter.stop` waits for the thread's last call. Not waiting longer
is safe: mapping pages changes no byte, wherever they have gone since."""


def page_ranges(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """The pages ``[start, end)`` (addresses) holding ``tensors`` (contiguous CPU tensors),
    in order, ranges that touch or overlap merged."""
    ranges: list[tuple[int, int]] = []
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or tensor.device.type != "cpu":
            continue
        start = tensor.data_ptr() // _PAGE * _PAGE
        end = -(-(tensor.data_ptr() + nbytes) // _PAGE) * _PAGE
        if ranges and ranges[-1][0] <= start <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], end))
        else:
            ranges.append((start, end))
    return ranges


class Prefaulter:
    """Faults in the pages of ``tensors`` (fresh CPU tensors about to be written, in that
    order) from a background thread at nice 19, once the writer has said that bytes came
    (:meth:`advance`) and at most :data:`AHEAD_BYTES` ahead of them, until done or
    :meth:`stop`. ``mapped`` counts the bytes it mapped."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.mapped = 0
        self._came = 0
        self._ranges = page_ranges(tensors)
        self._stop = False
        self._moved = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rayload-prefault", daemon=True)
        self._thread.start()

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the tensors' bytes have been written (the writer's
        progress, which the mapping follows)."""
        with self._moved:
            self._came += nbytes
            self._moved.notify()

    def _run(self) -> None:
        # Refused (a sandbox): at the process's priority then, still off the writer's thread.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        for start, end in self._ranges:
            for at in range(start, end, STEP_BYTES):
                with self._moved:
                    self._moved.wait_for(
                        lambda: self._stop or 0 < self._came > self.mapped - AHEAD_BYTES
                    )
                    if self._stop:
                        return
                stop = min(at + STEP_BYTES, end)
                if _populate(at, stop):
                    self.mapped += stop - at
                elif _unsupported or not enabled:
                    return

    def stop(self) -> str:
        """Stop the thread (waiting at most :data:`JOIN_S`); what it did, in words (for a
        span's attribute)."""
        with self._moved:
            self._stop = True
            self._moved.notify()
        self._thread.join(JOIN_S)
        if not enabled:
            return "off"
        if _unsupported:
            return "off: this kernel has no madvise(MADV_POPULATE_WRITE) (Linux 5.14+)"
        return f"{self.mapped} bytes mapped ahead"
