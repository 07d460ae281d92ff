"""``converted``: read a rank's own pre-sharded files written by ``rayload convert``.

Each rank file is read front to back in large chunks with rayload's reader, header and
all, so its CRC-32 can be checked against the manifest while the reads go on (the reader
hands finished chunks over in file order; the checksum of one chunk overlaps the reads of
the next). A size or checksum mismatch is a CheckpointError naming the file.
"""

from __future__ import annotations

import os

import torch

from rayload.errors import CheckpointError, ConfigError
from rayload.loading.backends.base import Backend, BackendResult, register
from rayload.loading.backends.reader import (
    Read,
    Segment,
    read_segments,
    shard_segments,
    shard_tensors,
)
from rayload.loading.manifest import MANIFEST_NAME, Crc32, FileEntry, verify_file_checksum
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import RankPlan
from rayload.loading.report import PhaseTimer


@register(LoadMethod.CONVERTED)
class ConvertedBackend(Backend):
    """Needs the opened converted :class:`~rayload.loading.checkpoint.Checkpoint`;
    ``bytes_read`` is the size of the rank's files."""

    def _load(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        entries = self._file_entries(plan)
        shards = plan.shards
        segments = shard_segments(shards)
        gaps = _gap_segments(segments, entries, first_target=len(shards))
        sizes = [s.nbytes for s in shards] + [g.length for g in gaps]
        order = {f: i for i, f in enumerate(entries)}
        segments = sorted(segments + gaps, key=lambda s: (order[s.file], s.offset))
        crcs = {file: Crc32() for file in entries}

        def checksum(read: Read, views: list[memoryview]) -> None:
            crc = crcs[read.file]
            for view in views:
                crc.update(view)

        with timer.phase("rank.read", bytes=sum(e.size for e in entries.values())) as attrs:
            buffers, sink, bytes_read = read_segments(
                segments, sizes, device, self.options, on_read=checksum
            )
            attrs["bytes_read"] = bytes_read
            for file, entry in entries.items():
                verify_file_checksum(file, entry, crc32=crcs[file].hexdigest())
        with timer.phase("rank.to_device", device=str(device)):
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
        if manifest.tp_size != plan.tp_size:
            raise CheckpointError(
                f"{manifest_path}: converted for tp_size={manifest.tp_size}, but rank "
                f"{plan.rank} loads tp_size={plan.tp_size}; convert again with "
                f"`rayload convert SRC OUT --tp {plan.tp_size}`",
                file=manifest_path,
            )
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
            size = os.path.getsize(file)
            if size != entry.size:
                raise CheckpointError(
                    f"{file}: {size} bytes but {manifest_path} says {entry.size}; the file "
                    "is truncated or was changed: re-run `rayload convert` to rewrite it",
                    file=file,
                )
            entries[file] = entry
        return entries


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
