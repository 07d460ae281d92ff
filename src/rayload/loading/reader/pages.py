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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from typing import Any

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
    global _unsupported
    if _unsupported or not enabled or view.nbytes < PREFAULT_BYTES:
        return
    madvise = _madvise()
    if madvise is None:
        _unsupported = True
        return
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    start = -(-address // _PAGE) * _PAGE
    end = (address + view.nbytes) // _PAGE * _PAGE
    if end > start and madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
        _unsupported = True  # EINVAL before 5.14: fault page by page, as before
