"""Where a checkpoint's bytes are: a local file system or object storage (``s3://``).

A storage is a small interface (:class:`~rayload.loading.storage.base.Storage`): list a
checkpoint's files, read a small range (a header, a JSON file), read ranges into given
buffers. One class per kind: :class:`~rayload.loading.storage.file.FileStorage` and
:class:`~rayload.loading.storage.s3.S3Storage`. The read plan
(:mod:`~rayload.loading.reader.readplan`) never knows which one runs it.

:func:`storage_for` gives the storage of a path; S3 storages are kept per process (one
client, one connection pool, one record of the object versions read so far).
"""

from __future__ import annotations

import threading

from rayload.loading.storage.base import (
    Storage,
    StorageCounters,
    current_deadline,
    is_remote,
    storage_deadline,
)
from rayload.loading.storage.file import FileStorage

__all__ = [
    "FileStorage",
    "Storage",
    "StorageCounters",
    "current_deadline",
    "is_remote",
    "storage_deadline",
    "storage_for",
]

_FILE = FileStorage()
_S3: dict[str, Storage] = {}
_lock = threading.Lock()


def storage_for(path: str) -> Storage:
    """The storage holding ``path``: :class:`S3Storage` for ``s3://bucket/...`` (one per
    bucket and process), the local file system otherwise."""
    if not is_remote(path):
        return _FILE
    from rayload.loading.storage.s3 import S3Storage, split_url

    bucket, _ = split_url(path)
    with _lock:
        storage = _S3.get(bucket)
        if storage is None:
            storage = _S3[bucket] = S3Storage(bucket)
        return storage


def forget_s3_clients() -> None:
    """Drop the process's S3 storages (their clients, pinned versions and counters): the
    next :func:`storage_for` reads the AWS environment afresh (tests that change it)."""
    with _lock:
        _S3.clear()
