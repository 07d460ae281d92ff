"""The storage contract: what the checkpoint reader and the read engine ask of a storage.

Paths are strings throughout (``/abs/dir/model.safetensors``, or
``s3://bucket/prefix/model.safetensors``) so that plans, headers and reports stay plain
data whatever the storage.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

StorageKind = Literal["file", "s3"]

Progress = Callable[[int], None]
"""``progress(done)``: the first ``done`` bytes of a read are in place."""

S3_SCHEME = "s3://"


_deadlines: list[tuple[float, float]] = []
"""The :func:`storage_deadline` blocks open in this process, in the order they opened."""
_deadlines_lock = threading.Lock()


@contextmanager
def storage_deadline(timeout_s: float, *, of: float | None = None) -> Iterator[None]:
    """Within this block no storage request of this process (any thread) starts, nor
    retries, past ``timeout_s`` seconds from now: a load's ``--timeout`` bounds an
    endpoint that does not answer. ``of``: the load's whole timeout, when ``timeout_s``
    is what was left of it (a rank's), which errors name and time-outs derive from.

    Blocks may overlap in any order (loads in threads of one process, e.g. a Serve
    replica's): each leaving removes its own deadline, so none outlives its load."""
    entry = (time.monotonic() + timeout_s, timeout_s if of is None else of)
    with _deadlines_lock:
        _deadlines.append(entry)
    try:
        yield
    finally:
        with _deadlines_lock:
            _deadlines.remove(entry)  # an equal entry would be the same deadline


def current_deadline() -> tuple[float, float] | None:
    """The latest :func:`storage_deadline` still open: (its ``time.monotonic()`` end, the
    load's timeout in seconds), or None."""
    with _deadlines_lock:
        return _deadlines[-1] if _deadlines else None


def is_remote(path: str) -> bool:
    """Whether ``path`` names object storage (``s3://...``)."""
    return path.startswith(S3_SCHEME)


@dataclass(frozen=True)
class StorageCounters:
    """Requests a storage made, the retries among them and the bytes it received; a
    rank reports the difference between two snapshots."""

    requests: int = 0
    retries: int = 0
    bytes: int = 0

    def __sub__(self, other: StorageCounters) -> StorageCounters:
        return StorageCounters(
            self.requests - other.requests, self.retries - other.retries, self.bytes - other.bytes
        )


class Storage(ABC):
    """One kind of storage.

    Invariants: :meth:`read_into` fills exactly the bytes asked for or raises (never a
    short tensor); a storage that can tell object versions apart reads every byte of a
    file from the version its header was read at, or raises naming the file.
    """

    kind: ClassVar[StorageKind]
    gather_gap: ClassVar[int]
    """Strided rows (a split-1 shard) less than this many bytes apart are read as one
    run, gaps included, then gathered; farther apart, one read per row."""
    gather_bytes: ClassVar[int]
    """The longest such run."""

    @abstractmethod
    def join(self, root: str, name: str) -> str:
        """The path of file ``name`` inside directory ``root``."""

    @abstractmethod
    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory (an object prefix holding objects)."""

    @abstractmethod
    def is_file(self, path: str) -> bool:
        """Whether ``path`` is a file (an object)."""

    @abstractmethod
    def listdir(self, root: str) -> list[str]:
        """The names of the files directly inside ``root``, sorted."""

    @abstractmethod
    def size(self, path: str) -> int:
        """The size of file ``path`` in bytes."""

    @abstractmethod
    def read(self, path: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of ``path`` from ``offset`` (fewer only at its end)."""

    @abstractmethod
    def read_into(
        self,
        path: str,
        offset: int,
        views: list[memoryview],
        size: int,
        progress: Progress | None = None,
    ) -> int:
        """Fill ``views`` (``size`` bytes together, in order) from ``offset`` of ``path``;
        returns ``size`` or raises (a CheckpointError naming the file). ``progress``, when
        given, may be told how many of the bytes are in place as they come."""

    @abstractmethod
    def read_all(self, path: str) -> bytes:
        """The whole file ``path`` (small files: JSON documents)."""

    @abstractmethod
    def counters(self) -> StorageCounters:
        """What this storage did so far in this process."""

    @abstractmethod
    def attributes(self) -> dict[str, Any]:
        """Span attributes describing it (``rayload.storage`` ...); never a credential."""

    def versions(self, root: str) -> dict[str, tuple[int, str]]:
        """The size and version (an ETag) of each file under ``root`` read so far in this
        process: what an opened checkpoint records (``Checkpoint.versions``), for ranks
        given it. A storage that cannot tell versions apart: none."""
        return {}

    def adopt(self, root: str, versions: Mapping[str, tuple[int, str]]) -> None:
        """Take ``versions`` (path -> (size, version), another process's: the driver's)
        as this process's for the files under ``root``, without a request: every later
        read of one of them reads that version or fails naming the file, so every rank
        reads what the driver planned from. A storage without versions: nothing to do."""
        del root, versions
