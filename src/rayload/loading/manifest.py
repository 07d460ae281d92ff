"""The manifest of a converted checkpoint (``rayload-manifest.json``).

``rayload convert`` writes it next to the per-rank files
``model-rank-{rank}-part-{part}.safetensors``; :func:`rayload.loading.checkpoint.open_checkpoint`
reads and checks it. Example::

    {
      "format_version": 1,
      "tp_size": 2,
      "architecture": "LlamaForCausalLM",
      "rules": [{"pattern": "lm_head\\\\.weight", "split": 0}, ...],
      "ranks": {"0": ["model-rank-0-part-0.safetensors"], "1": [...]},
      "files": {"model-rank-0-part-0.safetensors": {"size": 123, "crc32": "1a2b3c4d"}, ...},
      "splits": {"lm_head.weight": 0, "model.norm.weight": null, ...},
      "full_shapes": {"lm_head.weight": [512, 64], ...},
      "shard_shapes": {"lm_head.weight": [256, 64], ...}
    }

``shard_shapes`` (every rank's shard has the same shape) is what the planner gave each
tensor, whole heads and fused parts included; manifests written before it existed lack it,
and their shards are the full shape cut evenly on the split. A checkpoint converted with
expert parallel says so (``expert_parallel``), lists each rank's experts (``experts``) and
the tensors only one rank holds (``owners``: name -> rank); ``block_size`` is the
quantization block size the conversion used, when the model has one.

Checksums are CRC-32 (zlib's polynomial, 8 lowercase hex digits) of the whole file: they
catch truncation and corruption, and are not a defence against deliberate tampering. They
are computed with ISA-L's carry-less-multiply CRC-32 when the ``isal`` package is installed
(same values as ``zlib.crc32``, about 4x faster here) and ``zlib.crc32`` otherwise. A
file's CRC-32 can be built chunk by chunk in file order (:meth:`Crc32.update`), or from the
CRC-32s of its pieces computed independently, in any order, on several threads
(:func:`crc32_combine`, :meth:`Crc32.extend`): that is how the converted backend checks a
file while it reads it in parallel.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rayload.errors import CheckpointError
from rayload.loading.storage import storage_for
from rayload.rules_file import RuleSpec, describe_validation_error

MANIFEST_NAME = "rayload-manifest.json"
FORMAT_VERSION = 1

_CHUNK = 8 << 20


def _fast_crc32() -> Callable[..., int]:
    try:
        from isal.isal_zlib import crc32 as isal_crc32
    except ImportError:
        return zlib.crc32
    return isal_crc32


crc32: Callable[..., int] = _fast_crc32()
"""``crc32(data, value=0) -> int``: ``zlib.crc32``'s contract, ISA-L's speed when installed.
Releases the GIL on large buffers (both implementations), so reader threads can run it."""


def rank_file_name(rank: int, part: int) -> str:
    """The name of part ``part`` of rank ``rank``'s files (vLLM's sharded_state naming)."""
    return f"model-rank-{rank}-part-{part}.safetensors"


class FileEntry(BaseModel):
    """Size and CRC-32 of one rank file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int = Field(ge=0)
    crc32: str = Field(pattern=r"^[0-9a-f]{8}$")


class Manifest(BaseModel):
    """``rayload-manifest.json``. Invariants (checked on validation): ranks are exactly
    ``0..tp_size-1``; every rank file appears in ``files`` once and vice versa; file names
    are plain names in the checkpoint directory; every split tensor has a full shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1]
    tp_size: int = Field(ge=1)
    architecture: str | None = None
    rules: list[RuleSpec]
    ranks: dict[int, list[str]]
    files: dict[str, FileEntry]
    splits: dict[str, Literal[0, 1] | None]
    full_shapes: dict[str, list[int]]
    shard_shapes: dict[str, list[int]] | None = None
    expert_parallel: bool = False
    experts: dict[int, list[int]] | None = None
    owners: dict[str, int] | None = None
    block_size: list[int] | None = None

    def rank_names(self, rank: int) -> set[str]:
        """The tensors stored for ``rank``: all but other ranks' experts."""
        owners = self.owners or {}
        return {name for name in self.splits if owners.get(name, rank) == rank}

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if sorted(self.ranks) != list(range(self.tp_size)):
            raise ValueError(
                f"ranks are {sorted(self.ranks)}, expected 0..{self.tp_size - 1} for "
                f"tp_size {self.tp_size}"
            )
        listed = [name for names in self.ranks.values() for name in names]
        if len(listed) != len(set(listed)):
            raise ValueError("a file is listed under more than one rank")
        if set(listed) != set(self.files):
            raise ValueError(
                f"files {sorted(set(listed) ^ set(self.files))} appear in only one of "
                f"'ranks' and 'files'"
            )
        for name in listed:
            if os.path.basename(name) != name or name in (".", ".."):
                raise ValueError(f"file {name!r} is not a plain file name")
        if missing := set(self.splits) - set(self.full_shapes):
            raise ValueError(f"no full_shapes entry for {sorted(missing)[:3]}")
        return self


def read_manifest(path: str) -> Manifest:
    """Read and validate the manifest at ``path``; any problem is a CheckpointError."""
    try:
        data = json.loads(storage_for(path).read_all(path))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})", file=path) from exc
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(
            f"{path}: not valid JSON ({exc}); re-run `rayload convert`", file=path
        ) from exc
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise CheckpointError(
            f"{path}: invalid manifest {describe_validation_error(exc)}; re-run `rayload convert`",
            file=path,
        ) from exc


def write_manifest(manifest: Manifest, directory: str | os.PathLike[str]) -> str:
    """Write ``manifest`` as ``directory/rayload-manifest.json``; returns the path."""
    path = os.path.join(os.fspath(directory), MANIFEST_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write(manifest.model_dump_json(indent=1))
        f.write("\n")
    return path


class Crc32:
    """Running CRC-32 of a byte stream: ``update`` with each chunk (or ``extend`` with the
    CRC-32 of each chunk), in stream order, then ``hexdigest``."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._value = crc32(data, self._value)

    def extend(self, value: int, length: int) -> None:
        """Append a piece of ``length`` bytes whose own CRC-32 is ``value``."""
        self._value = crc32_combine(self._value, value, length)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


_POLY = 0xEDB88320
"""CRC-32's polynomial, bit-reflected (the lowest bit is the coefficient of x^31)."""


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial, in GF(2), reflected representation."""
    m = 1 << 31
    product = 0
    while True:
        if a & m:
            product ^= b
            if not a & (m - 1):
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x_pow_2n_table() -> tuple[int, ...]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return tuple(table)


_X2N = _x_pow_2n_table()
"""``_X2N[k]`` is x^(2^k) modulo the polynomial."""


def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: appending n zero bytes multiplies a CRC by it."""
    p = 1 << 31  # x^0
    k = 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and
    ``len2 = len(B)`` (zlib's ``crc32_combine``; O(log len2), a few microseconds)."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def file_entry(path: str | os.PathLike[str]) -> FileEntry:
    """Size and CRC-32 of the file at ``path`` (what ``rayload convert`` records)."""
    crc = Crc32()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc.update(chunk)
    return FileEntry(size=os.path.getsize(path), crc32=crc.hexdigest())


def verify_file_checksum(path: str, entry: FileEntry, *, crc32: str | None = None) -> None:
    """Raise CheckpointError when the file at ``path`` does not match ``entry``.

    Pass ``crc32`` when the caller already computed it while reading (:class:`Crc32`);
    otherwise the file is read once more.
    """
    actual = crc32 if crc32 is not None else file_entry(path).crc32
    if actual != entry.crc32:
        raise CheckpointError(
            f"{path}: CRC-32 is {actual} but the manifest says {entry.crc32}; the file is "
            f"corrupt: re-run `rayload convert` to rewrite it",
            file=path,
        )
