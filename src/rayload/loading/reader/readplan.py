"""The read plan of rayload's reader: which ``os.preadv`` calls fill which destination
bytes. Pure data and arithmetic, no I/O and no torch.

The caller describes *what* goes *where* as :class:`Segment` s (file bytes -> offset in a
destination buffer); :func:`shard_segments` makes them from a rank's shards.
:func:`plan_reads` turns them into :class:`Read` s of at most ``chunk_bytes``: a large
segment is split so its chunks are read in parallel, segments that touch in the file are
merged into one ``os.preadv`` with one buffer per segment (scatter read, no intermediate
copy), and the strided rows of a split-1 shard stay one strided read (the reader reads
them row by row, or, when they are less than a page apart, as runs of rows gathered out
of a bounce buffer). :func:`batch_reads` groups consecutive reads so a thread hand-off
costs one per ``chunk_bytes``, not one per row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from rayload.loading.plan import ByteRange, RowRanges, TensorShard

_IOV_MAX = 1024
_MAX_BATCH_READS = 1024
"""Reads per batch at most: tiny strided rows still spread over every thread."""


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` bytes at ``offset`` of ``file`` go to ``target_offset`` of destination
    ``target``. ``tensor`` names the tensor for error messages.

    With ``row > 0`` the file bytes are strided: ``length // row`` rows of ``row`` bytes,
    ``stride`` apart from ``offset`` on (the rows of a split-1 shard); they land one
    after the other at ``target_offset``. One such segment replaces thousands of
    per-row objects; its rows are read on one reader thread (``reader._pread_all``).
    """

    file: str
    offset: int
    length: int
    target: int
    target_offset: int
    tensor: str
    row: int = 0
    stride: int = 0


@dataclass(frozen=True, slots=True)
class Read:
    """One ``os.preadv``: ``length`` file-contiguous bytes from ``offset``, scattered over
    ``segments``; or, with ``row > 0``, the rows of its single strided segment."""

    file: str
    offset: int
    length: int
    segments: tuple[Segment, ...]
    row: int = 0
    stride: int = 0


@dataclass(frozen=True, slots=True)
class Batch:
    """Consecutive reads one thread performs in a row (one staging buffer's worth)."""

    reads: tuple[Read, ...]
    length: int


def plan_reads(segments: Iterable[Segment], chunk_bytes: int) -> list[Read]:
    """Group ``segments`` (kept in order) into reads of at most ``chunk_bytes``."""
    reads: list[Read] = []
    current: list[Segment] = []
    size = 0
    for piece in _split(segments, chunk_bytes):
        if piece.row:
            if current:
                reads.append(Read(current[0].file, current[0].offset, size, tuple(current)))
                current, size = [], 0
            reads.append(
                Read(piece.file, piece.offset, piece.length, (piece,), piece.row, piece.stride)
            )
            continue
        if current:
            last = current[-1]
            touches = last.file == piece.file and last.offset + last.length == piece.offset
            if not touches or size + piece.length > chunk_bytes or len(current) >= _IOV_MAX:
                reads.append(Read(current[0].file, current[0].offset, size, tuple(current)))
                current, size = [], 0
        current.append(piece)
        size += piece.length
    if current:
        reads.append(Read(current[0].file, current[0].offset, size, tuple(current)))
    return reads


def batch_reads(reads: Iterable[Read], chunk_bytes: int) -> list[Batch]:
    """Group consecutive ``reads`` into batches of at most ``chunk_bytes`` (and at most
    ``_MAX_BATCH_READS`` reads), so a thread hand-off is paid per batch, not per row."""
    batches: list[Batch] = []
    current: list[Read] = []
    size = 0
    for read in reads:
        if current and (size + read.length > chunk_bytes or len(current) >= _MAX_BATCH_READS):
            batches.append(Batch(tuple(current), size))
            current, size = [], 0
        current.append(read)
        size += read.length
    if current:
        batches.append(Batch(tuple(current), size))
    return batches


def _split(segments: Iterable[Segment], chunk_bytes: int) -> Iterator[Segment]:
    """Pieces of at most ``chunk_bytes`` (whole rows for strided segments)."""
    for seg in segments:
        if seg.length <= chunk_bytes:
            if seg.length:
                yield seg
            continue
        if seg.row:
            yield from _split_rows(seg, chunk_bytes)
            continue
        for start in range(0, seg.length, chunk_bytes):
            yield replace(
                seg,
                offset=seg.offset + start,
                length=min(chunk_bytes, seg.length - start),
                target_offset=seg.target_offset + start,
            )


def _split_rows(seg: Segment, chunk_bytes: int) -> Iterator[Segment]:
    rows = seg.length // seg.row
    if seg.row > chunk_bytes:  # a row alone is over a chunk: each row in contiguous pieces
        for i in range(rows):
            row = replace(
                seg,
                offset=seg.offset + i * seg.stride,
                length=seg.row,
                target_offset=seg.target_offset + i * seg.row,
                row=0,
                stride=0,
            )
            yield from _split([row], chunk_bytes)
        return
    per_piece = max(1, chunk_bytes // seg.row)
    for first in range(0, rows, per_piece):
        count = min(per_piece, rows - first)
        yield replace(
            seg,
            offset=seg.offset + first * seg.stride,
            length=count * seg.row,
            target_offset=seg.target_offset + first * seg.row,
            row=seg.row if count > 1 else 0,
            stride=seg.stride if count > 1 else 0,
        )


def shard_segments(shards: Sequence[TensorShard]) -> list[Segment]:
    """Segments that put shard ``i``'s ranges, in order, into destination ``i``. Runs of
    equal-length ranges a constant stride apart (split-1 rows) become one strided
    segment."""
    segments = []
    for index, shard in enumerate(shards):
        ranges = shard.ranges
        if isinstance(ranges, RowRanges) and ranges.rows > 1 and ranges.stride > ranges.length:
            segments.append(
                Segment(
                    ranges.file,
                    ranges.offset,
                    ranges.rows * ranges.length,
                    index,
                    0,
                    shard.name,
                    ranges.length,
                    ranges.stride,
                )
            )
            continue
        pos = i = 0
        while i < len(ranges):
            first = ranges[i]
            end = _row_run_end(ranges, i)
            if end - i > 1:
                length = (end - i) * first.length
                stride = ranges[i + 1].offset - first.offset
                segments.append(
                    Segment(
                        first.file,
                        first.offset,
                        length,
                        index,
                        pos,
                        shard.name,
                        first.length,
                        stride,
                    )
                )
            else:
                length = first.length
                segments.append(Segment(first.file, first.offset, length, index, pos, shard.name))
            pos += length
            i = end
    return segments


def tail_segments(segments: Iterable[Segment], start: int, target: int) -> list[Segment]:
    """The bytes of one destination's ``segments`` from its byte ``start`` on, as segments
    into destination ``target`` at ``target_offset - start``: the rest of a tensor whose
    first ``start`` bytes are in place (a peer's cut short). A strided segment cut inside
    a row becomes that row's end, then its remaining rows."""
    tail: list[Segment] = []
    for seg in segments:
        skip = start - seg.target_offset
        if skip >= seg.length:
            continue
        if skip <= 0:
            tail.append(replace(seg, target=target, target_offset=-skip))
            continue
        if not seg.row:
            tail.append(
                replace(
                    seg,
                    offset=seg.offset + skip,
                    length=seg.length - skip,
                    target=target,
                    target_offset=0,
                )
            )
            continue
        rows, within = divmod(skip, seg.row)
        offset, at = seg.offset + rows * seg.stride, rows * seg.row - skip
        if within:
            part = seg.row - within
            tail.append(Segment(seg.file, offset + within, part, target, 0, seg.tensor))
            offset, at, rows = offset + seg.stride, at + seg.row, rows + 1
        left = seg.length // seg.row - rows
        if left:
            row, stride = (seg.row, seg.stride) if left > 1 else (0, 0)
            tail.append(
                Segment(seg.file, offset, left * seg.row, target, at, seg.tensor, row, stride)
            )
    return tail


def _row_run_end(ranges: Sequence[ByteRange], i: int) -> int:
    """End (exclusive) of the run of rows starting at ``ranges[i]``: same file and length,
    a constant stride larger than the length apart."""
    first = ranges[i]
    if i + 1 >= len(ranges):
        return i + 1
    stride = ranges[i + 1].offset - first.offset
    if stride <= first.length:
        return i + 1
    end = i + 1
    while (
        end < len(ranges)
        and ranges[end].file == first.file
        and ranges[end].length == first.length
        and ranges[end].offset - ranges[end - 1].offset == stride
    ):
        end += 1
    return end
