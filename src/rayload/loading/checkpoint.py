"""Checkpoint discovery and safetensors header parsing (no tensor data is read).

Layouts (see DESIGN.md "Checkpoint layouts"):

* ``hf_single``: one ``model.safetensors``
* ``hf_index``: ``model.safetensors.index.json`` + the shard files it names
* ``converted``: ``rayload-manifest.json`` + ``model-rank-{rank}-part-{part}.safetensors``
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Layout = Literal["hf_single", "hf_index", "converted"]


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
class Checkpoint:
    """A validated checkpoint: every header parsed and checked, no tensor data read.

    For the ``converted`` layout, ``tensors`` holds the *sharded* tensors of every rank file
    keyed by name (names repeat across ranks, so use ``rank_tensors(rank)``), ``manifest``
    holds the parsed manifest and ``tp_size`` the tp size it was converted for.
    """

    root: str
    layout: Layout
    files: tuple[str, ...]
    tensors: Mapping[str, TensorInfo]
    config: Mapping[str, Any] | None
    manifest: Any = None  # rayload.loading.convert.Manifest for the converted layout
    tp_size: int | None = None
    rank_files: Mapping[int, tuple[str, ...]] | None = None

    @property
    def architecture(self) -> str | None:
        archs = (self.config or {}).get("architectures") or []
        return archs[0] if archs else None

    @property
    def total_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Find the layout of ``path`` (a directory or a ``.safetensors`` file), parse and
    validate every header, and return the :class:`Checkpoint`.

    Raises :class:`rayload.errors.CheckpointError` naming the file (and tensor) on any of
    the bad inputs listed in DESIGN.md.
    """
    raise NotImplementedError
