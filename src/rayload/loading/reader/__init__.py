"""rayload's reader engine: parallel positional reads of exact byte ranges into
preallocated destinations, with bounded memory. Shared by the load methods that read
files themselves (scratch, converted) and by ``rayload convert``.

* :mod:`~rayload.loading.reader.options`: :class:`ReaderOptions` (threads, chunk size,
  staging buffers) and the :class:`ReadSettings` they decide for a device;
* :mod:`~rayload.loading.reader.readplan`: which ``os.preadv`` calls fill which bytes;
* :mod:`~rayload.loading.reader.reads`: executing them on a thread pool;
* :mod:`~rayload.loading.reader.sinks`: where the bytes land (host buffers, or pinned
  staging and host-to-device copies).
"""

from __future__ import annotations

from rayload.loading.reader.options import ReaderOptions, ReadSettings

__all__ = ["ReadSettings", "ReaderOptions"]
