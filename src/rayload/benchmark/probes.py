"""What a benchmark process measures about itself and about the page cache (Linux only).

* Bytes read: ``rchar`` of ``/proc/self/io`` counts every byte that ``read``/``pread``
  returned to this process, whichever thread asked. Memory-mapped reads never go through
  ``read``, so a reader that maps the file (safetensors) is measured by the file-backed
  resident bytes of its mappings instead (:func:`mapped_bytes`, taken before unmapping).
* Peak memory: writing ``5`` to ``/proc/self/clear_refs`` resets the kernel's high-water
  mark ``VmHWM`` to the current RSS, so the peak of one measured block is exact even in a
  process forked from a parent that once used more.
* Page cache: ``posix_fadvise(DONTNEED)`` drops a file's clean cached pages (after an
  ``fsync`` so that freshly written pages are clean); ``mincore`` on a mapping says which
  pages are cached, so a "cold" case can prove it started cold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
from collections.abc import Iterable

from rayload.loading.probe import read_chars

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.mincore.restype = ctypes.c_int
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


def rchar() -> int:
    """Bytes this process has received from read-like system calls so far."""
    read = read_chars()
    if read is None:
        raise RuntimeError("/proc/self/io has no rchar line")
    return read


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return _status_kb("VmRSS") * 1024


def reset_peak_rss() -> None:
    """Make the peak RSS (``VmHWM``) equal to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """Highest RSS since the process started or :func:`reset_peak_rss` was last called."""
    return _status_kb("VmHWM") * 1024


def mapped_bytes(paths: Iterable[str]) -> int:
    """Resident bytes of this process's mappings of ``paths`` (what a mmap reader touched)."""
    wanted = {os.path.realpath(p) for p in paths}
    total = 0
    current = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5:
                current = len(head) == 6 and os.path.realpath(head[5].strip()) in wanted
            elif current and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def evict(paths: Iterable[str]) -> None:
    """Drop the cached pages of ``paths`` so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: Iterable[str], *, chunk: int = 16 << 20) -> None:
    """Read ``paths`` once so that their pages are cached."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def cached_fraction(paths: Iterable[str]) -> float:
    """Fraction of the pages of ``paths`` that are in the page cache (1.0 if all empty)."""
    cached = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        pages = (size + _PAGE - 1) // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mmap failed on {path}")
            try:
                if _libc.mincore(addr, size, vec) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"mincore failed on {path}: {os.strerror(err)}")
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
        cached += sum(b & 1 for b in vec)
        total += pages
    return cached / total if total else 1.0
