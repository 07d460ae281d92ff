"""The local file system (and anything mounted into it)."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from rayload.loading.storage.base import Progress, Storage, StorageCounters, StorageKind


class FileStorage(Storage):
    """Files by absolute path. Reads of tensor data use positional reads on file
    descriptors (:mod:`~rayload.loading.reader.reads`); page-cache friendly, so rows a
    page apart are gathered."""

    kind: ClassVar[StorageKind] = "file"
    gather_gap: ClassVar[int] = 4096
    gather_bytes: ClassVar[int] = 1 << 20

    def join(self, root: str, name: str) -> str:
        return os.path.join(root, name)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def listdir(self, root: str) -> list[str]:
        return sorted(os.listdir(root))

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def read(self, path: str, offset: int, length: int) -> bytes:
        with open(path, "rb", buffering=0) as f:
            return os.pread(f.fileno(), length, offset)

    def read_into(
        self,
        path: str,
        offset: int,
        views: list[memoryview],
        size: int,
        progress: Progress | None = None,
    ) -> int:
        from rayload.loading.reader.reads import truncated_error

        with open(path, "rb", buffering=0) as f:
            done = 0
            for view in views:
                while len(view):
                    n = os.preadv(f.fileno(), [view], offset + done)
                    if n == 0:
                        raise truncated_error(path, offset + done, "")
                    done += n
                    view = view[n:]
        return size

    def read_all(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def counters(self) -> StorageCounters:
        return StorageCounters()

    def attributes(self) -> dict[str, Any]:
        return {"rayload.storage": "file"}
