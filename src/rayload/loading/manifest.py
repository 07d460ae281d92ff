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
      "full_shapes": {"lm_head.weight": [512, 64], ...}
    }

Checksums are CRC-32 (``zlib.crc32``, 8 lowercase hex digits) of the whole file: they
catch truncation and corruption at about twice the speed of SHA-256, and can be updated
chunk by chunk while a backend reads the file (:class:`Crc32`). They are not a defence
against deliberate tampering.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rayload.config import RuleSpec, describe_validation_error
from rayload.errors import CheckpointError

MANIFEST_NAME = "rayload-manifest.json"
FORMAT_VERSION = 1
RANK_FILE_RE = re.compile(r"model-rank-(\d+)-part-(\d+)\.safetensors")

_CHUNK = 8 << 20


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
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})", file=path) from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
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
    """Running CRC-32 of a byte stream: ``update`` with each chunk, then ``hexdigest``."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


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
