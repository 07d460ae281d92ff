"""What rayload's reader reads for a plan, computed here from the plan's byte ranges."""

from __future__ import annotations

from collections.abc import Iterable

from rayload.loading.plan import RowRanges, TensorShard

PAGE = 4096


def bytes_to_read(shards: Iterable[TensorShard]) -> int:
    """The shards' bytes, except that split-1 rows less than a page apart are read as one
    run from the first row's start to the last row's end (the gaps are read and dropped)."""
    total = 0
    for shard in shards:
        r = shard.ranges
        if isinstance(r, RowRanges) and r.rows > 1 and r.stride - r.length < PAGE:
            total += (r.rows - 1) * r.stride + r.length
        else:
            total += shard.nbytes
    return total
