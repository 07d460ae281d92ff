"""Read and validate the header of one safetensors file without touching tensor data.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the tensor data; ``data_offsets`` are relative to the end of the header. Reading a
header costs two positional reads, whatever the file size.

Every inconsistency is a :class:`~rayload.errors.CheckpointError` that names the file
(and the tensor) and says what to do.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from rayload.errors import CheckpointError
from rayload.loading.dtypes import itemsize
from rayload.loading.storage import is_remote, storage_for

MAX_HEADER_BYTES = 100_000_000
"""Larger headers are refused, as the safetensors library does."""

_REDO = "re-download or re-save the file"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives. ``start``/``end`` are absolute byte offsets in ``file``
    (header included), so ``end - start == nbytes``."""

    name: str
    dtype: str  # safetensors dtype string: "BF16", "F16", "F32", "I32", ...
    shape: tuple[int, ...]
    file: str  # absolute path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FileHeader:
    """The validated header of one safetensors file.

    ``tensors`` is ordered by data offset; ``data_start`` is where tensor data begins.
    """

    file: str
    size: int
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, Any] | None


def read_header(path: str) -> FileHeader:
    """Read and validate the header of the safetensors file at ``path`` (absolute, or an
    ``s3://`` URL: two ranged GETs, the 8-byte length then the header)."""
    if is_remote(path):
        storage = storage_for(path)
        size = storage.size(path)
        prefix = storage.read(path, 0, 8)
        length = _header_length(path, prefix, size)
        return _parse(path, storage.read(path, 8, length), size)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(
            f"{path}: cannot open ({exc.strerror}); check the path and its permissions",
            file=path,
        ) from exc
    try:
        size = os.fstat(fd).st_size
        length = _header_length(path, os.pread(fd, 8, 0), size)
        raw = os.pread(fd, length, 8)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})", file=path) from exc
    finally:
        os.close(fd)
    return _parse(path, raw, size)


def _header_length(path: str, prefix: bytes, size: int) -> int:
    """The header length the 8-byte ``prefix`` of a ``size``-byte file gives, checked."""
    if len(prefix) < 8:
        raise CheckpointError(
            f"{path}: file is {size} bytes, too short to hold the 8-byte safetensors "
            f"header length; it is truncated or not a safetensors file: {_REDO}",
            file=path,
        )
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: header length is {length} bytes, over the {MAX_HEADER_BYTES}-byte "
            f"limit; the file is corrupt or not a safetensors file: {_REDO}",
            file=path,
        )
    if 8 + length > size:
        raise CheckpointError(
            f"{path}: header length is {length} bytes but the file is only {size} "
            f"bytes; the file is truncated: {_REDO}",
            file=path,
        )
    return length


def _parse(path: str, raw: bytes, size: int) -> FileHeader:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path}: header is not valid JSON ({exc}); the file is corrupt: {_REDO}",
            file=path,
        ) from exc
    except RecursionError as exc:
        raise CheckpointError(
            f"{path}: header JSON is nested too deeply to parse; the file is corrupt: {_REDO}",
            file=path,
        ) from exc
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: header is a JSON {type(header).__name__}, not an object; "
            f"the file is corrupt: {_REDO}",
            file=path,
        )
    data_start = 8 + len(raw)
    metadata = header.pop("__metadata__", None)
    tensors = [_tensor(path, name, entry, data_start, size) for name, entry in header.items()]
    tensors.sort(key=lambda t: (t.start, t.end))
    _check_no_overlap(path, tensors)
    return FileHeader(
        file=path,
        size=size,
        data_start=data_start,
        tensors={t.name: t for t in tensors},
        metadata=metadata if isinstance(metadata, dict) else None,
    )


def _tensor(path: str, name: str, entry: Any, data_start: int, size: int) -> TensorInfo:
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(
            f"{path}: tensor {name!r} {problem}; the header is corrupt: {_REDO}",
            file=path,
            tensor=name,
        )

    if not isinstance(entry, dict):
        raise bad(f"has a header entry of type {type(entry).__name__}, not an object")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
    if missing:
        raise bad(f"has no {', '.join(missing)} in its header entry")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise bad(f"has dtype {dtype!r}, not a string")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"has shape {shape!r}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise bad(f"has data_offsets {offsets!r}, not two non-negative integers")
    begin, end = offsets
    if end < begin:
        raise bad(f"has reversed data_offsets [{begin}, {end}]")
    if data_start + end > size:
        raise CheckpointError(
            f"{path}: tensor {name!r} ends at byte {data_start + end} but the file is "
            f"{size} bytes; the file is truncated: {_REDO}",
            file=path,
            tensor=name,
        )
    expected = math.prod(shape) * itemsize(dtype, file=path, tensor=name)
    if expected != end - begin:
        raise bad(
            f"has shape {shape} x {dtype} = {expected} bytes but data_offsets "
            f"[{begin}, {end}] span {end - begin} bytes"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, data_start + end)


def _check_no_overlap(path: str, tensors: list[TensorInfo]) -> None:
    """``tensors`` sorted by start: each non-empty one must begin after all before it end."""
    reach, owner = 0, ""
    for t in tensors:
        if t.nbytes and t.start < reach:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} (bytes {t.start}-{t.end}) overlaps tensor "
                f"{owner!r} (ends at {reach}); the header is corrupt: {_REDO}",
                file=path,
                tensor=t.name,
            )
        if t.end > reach:
            reach, owner = t.end, t.name


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
