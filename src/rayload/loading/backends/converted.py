"""``converted``: read a rank's own pre-sharded files written by ``rayload convert``.

Each rank file is read whole, header and all, in large chunks with rayload's parallel
reader, and its CRC-32 is checked against the manifest on the way: each reader thread
computes the CRC-32 of the chunk it has just read (while the other threads read), and
the chunks' CRC-32s are combined in file order at the end (:func:`crc32_combine`, a few
microseconds per chunk). No thread waits for a checksum before reading on, and no byte is
read twice. A size or checksum mismatch is a CheckpointError naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from rayload.errors import CheckpointError, ConfigError
from rayload.loading.backends.base import BackendResult, ReaderBackend, register
from rayload.loading.manifest import (
    MANIFEST_NAME,
    Crc32,
    FileEntry,
    crc32,
    verify_file_checksum,
)
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import RankPlan
from rayload.loading.plan_converted import check_converted_tp
from rayload.loading.reader.readplan import Read, Segment, shard_segments
from rayload.loading.reader.reads import read_segments, shard_tensors
from rayload.loading.report import READ, TO_DEVICE, PhaseTimer
from rayload.loading.storage import storage_for


@register(LoadMethod.CONVERTED)
class ConvertedBackend(ReaderBackend):
    """Needs the opened converted :class:`~rayload.loading.checkpoint.Checkpoint`;
    ``bytes_read`` is the size of the rank's files."""

    def _read(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        targets: Sequence[torch.Tensor],
        touched: set[int] | None,
    ) -> BackendResult:
        entries = self._file_entries(plan)
        shards = plan.shards
        segments = shard_segments(shards)
        gaps = _gap_segments(segments, entries, first_target=len(shards))
        sizes = [s.nbytes for s in shards] + [g.length for g in gaps]
        order = {f: i for i, f in enumerate(entries)}
        segments = sorted(segments + gaps, key=lambda s: (order[s.file], s.offset))
        pieces: list[tuple[str, int, int, int]] = []  # file, offset, length, CRC-32

        def checksum(read: Read, views: list[memoryview]) -> None:
            value = 0
            for view in views:
                value = crc32(view, value)
            pieces.append((read.file, read.offset, read.length, value))  # atomic

        with timer.phase(READ, bytes=sum(e.size for e in entries.values())) as attrs:
            buffers, sink, bytes_read = read_segments(
                segments,
                sizes,
                device,
                self.options,
                on_read=checksum,
                targets=targets,
                touched=touched,
                keep=len(shards),
            )
            attrs["bytes_read"] = bytes_read
            try:
                for file, entry in entries.items():
                    verify_file_checksum(file, entry, crc32=_file_crc32(file, pieces))
            except BaseException:
                sink.finish()  # no device copy left in flight into memory given back
                raise
        with timer.phase(TO_DEVICE, device=str(device)):
            sink.finish()
            tensors = shard_tensors(shards, buffers)
        return BackendResult(tensors, bytes_read, self.method)

    def _file_entries(self, plan: RankPlan) -> dict[str, FileEntry]:
        """The manifest entry of each of the rank's files, sizes checked against disk."""
        checkpoint = self.checkpoint
        if checkpoint is None or checkpoint.manifest is None:
            raise ConfigError(
                "the converted backend needs a converted checkpoint opened with "
                "open_checkpoint(); this one has no manifest"
            )
        manifest = checkpoint.manifest
        manifest_path = os.path.join(checkpoint.root, MANIFEST_NAME)
        check_converted_tp(checkpoint.root, manifest.tp_size, plan.tp_size)
        own = {os.path.join(checkpoint.root, name) for name in manifest.ranks[plan.rank]}
        entries: dict[str, FileEntry] = {}
        for file in plan.files:
            name = os.path.basename(file)
            if file not in own:
                raise CheckpointError(
                    f"{file}: not one of rank {plan.rank}'s files in {manifest_path}; "
                    "re-run `rayload convert`",
                    file=file,
                )
            entry = manifest.files[name]
            size = storage_for(file).size(file)
            if size != entry.size:
                raise CheckpointError(
                    f"{file}: {size} bytes but {manifest_path} says {entry.size}; the file "
                    "is truncated or was changed: re-run `rayload convert` to rewrite it",
                    file=file,
                )
            entries[file] = entry
        return entries


def _file_crc32(file: str, pieces: list[tuple[str, int, int, int]]) -> str:
    """The CRC-32 of ``file`` from the CRC-32s of its reads, which cover it exactly once
    (every byte of the file is in exactly one segment, see :func:`_gap_segments`)."""
    crc = Crc32()
    for _, _, length, value in sorted(p for p in pieces if p[0] == file):
        crc.extend(value, length)
    return crc.hexdigest()


def _gap_segments(
    segments: list[Segment], entries: dict[str, FileEntry], *, first_target: int
) -> list[Segment]:
    """Segments for the bytes of each file no tensor covers (the header, any padding), so
    every byte is read once and the whole-file checksum can be computed on the way."""
    gaps: list[Segment] = []
    for file, entry in entries.items():
        pos = 0
        for seg in sorted((s for s in segments if s.file == file), key=lambda s: s.offset):
            if seg.row or seg.offset < pos:
                raise CheckpointError(
                    f"{file}: tensor {seg.tensor!r} is not stored contiguously after the "
                    "bytes before it; re-run `rayload convert`",
                    file=file,
                    tensor=seg.tensor,
                )
            if seg.offset > pos:
                gaps.append(Segment(file, pos, seg.offset - pos, first_target + len(gaps), 0, ""))
            pos = seg.offset + seg.length
        if entry.size > pos:
            gaps.append(Segment(file, pos, entry.size - pos, first_target + len(gaps), 0, ""))
    return gaps
