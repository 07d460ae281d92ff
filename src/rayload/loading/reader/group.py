"""Split-1 tensors from object storage, fetched once per TP group.

In a file, a split-1 shard is one short run of bytes per row, with the other ranks'
columns in between. From a local file the reader reads just those runs. From object
storage, where each request costs a round trip, it fetches runs of rows with the gaps
included (:mod:`~rayload.loading.reader.reads`' gather), so at ``tp`` ranks the server
sends each split-1 tensor ``tp`` times.

With the load's process group (``torch.distributed``: gloo for host tensors, NCCL for
CUDA ones) the ranks share that work instead. Each split-1 tensor has one owner, chosen
so that every rank fetches about as many bytes. The owner fetches the whole tensor with
ranged GETs, and ``torch.distributed.scatter`` gives each rank its columns. The group
then fetches each byte of those tensors once.

How the ranks keep in step (every rank of the group runs :func:`share_split1` for the
same plan):

* **Agreeing.** One ``all_gather_object`` of each rank's split-1 shards (their row runs).
  A tensor is shared when every rank holds it, the same rows of the same file, and the
  ranks' columns tile each row in equal widths. Anything else is read as before.
* **Rounds.** The whole tensors a rank owns are fetched in rounds of at most
  :data:`ROUND_BYTES` per rank, so memory stays bounded. The first round is fetched
  together with the rank's other shards, in one read.
* **Failing together.** After each round's read, the ranks exchange whether it
  succeeded (a second ``all_gather_object``). A rank whose read failed raises its own
  error; the others raise an error naming that rank and its cause. No rank waits in a
  scatter for bytes that will not come. A rank that fails before the agreement (its
  method, plan or destinations: :func:`failing_together`) still takes part in it, saying
  so: the others raise at once, naming it and its cause, instead of waiting out the
  group's timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from rayload.errors import StorageError
from rayload.loading.plan import RowRanges, TensorShard
from rayload.loading.reader.readplan import Segment
from rayload.loading.storage import is_remote

if TYPE_CHECKING:
    from rayload.loading.arrivals import Arrivals
    from rayload.loading.checkpoint import Checkpoint

_T = TypeVar("_T")

ROUND_BYTES = 256 << 20
"""The most bytes of whole tensors one rank holds for the group at once."""


@dataclass(frozen=True)
class Shared:
    """Tensor ``name``: ``rows`` rows of ``row_bytes`` from ``start`` of ``file``, each
    row cut in ``width``-byte columns. Rank ``r`` holds the columns at ``columns[r]``
    of every row, in its destination ``target``. ``owner`` fetches it whole."""

    name: str
    file: str
    start: int
    rows: int
    row_bytes: int
    width: int
    columns: tuple[int, ...]
    owner: int
    target: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class GroupShare:
    """What this rank (``rank`` of the group) does for the shared tensors: ``rounds``
    of indices into ``shared``, in the order every rank scatters them."""

    rank: int
    shared: tuple[Shared, ...]
    rounds: tuple[tuple[int, ...], ...]

    @property
    def targets(self) -> frozenset[int]:
        """The destinations the scatters fill (their shards are not read directly)."""
        return frozenset(s.target for s in self.shared)

    def owned(self, round_: int) -> list[Shared]:
        """The tensors this rank fetches whole in round ``round_``."""
        return [self.shared[k] for k in self.rounds[round_] if self.shared[k].owner == self.rank]

    @property
    def fetched_bytes(self) -> int:
        """Bytes this rank fetches whole for the group."""
        return sum(s.nbytes for s in self.shared if s.owner == self.rank)


class _Tiling(NamedTuple):
    """How the ranks' columns cut tensor rows: ``rows`` rows of ``row_bytes`` from
    ``start`` of ``file``, rank ``r``'s ``width`` bytes at ``columns[r]`` of each."""

    file: str
    start: int
    width: int
    row_bytes: int
    rows: int
    columns: tuple[int, ...]


def plan_share(shards: Sequence[TensorShard], group: Any) -> GroupShare | None:
    """Agree with the rest of ``group`` (every rank calls this, for the same checkpoint)
    on the split-1 tensors to share; None when there are none, so nothing else is
    exchanged."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    mine = {
        s.name: (index, s.ranges)
        for index, s in enumerate(shards)
        if s.split == 1
        and isinstance(s.ranges, RowRanges)
        and s.ranges.rows > 1
        and s.ranges.stride > s.ranges.length
    }
    every: list[Any] = [None] * size
    runs = {name: _fields(ranges) for name, (_, ranges) in mine.items()}
    dist.all_gather_object(every, (runs, sum(s.nbytes for s in shards)), group=group)
    if left := [(r, said) for r, said in enumerate(every) if isinstance(said, _Left)]:
        rank, said = left[0]
        raise StorageError(
            f"rank {rank} of the TP group failed before the group agreed on its split-1 "
            f"tensors: {said.cause}",
            url=shards[0].files[0] if shards else "",
        )
    tilings = {
        name: tiling
        for name in mine
        if (tiling := _tiling([their.get(name) for their, _ in every])) is not None
    }
    # Owners: the largest tensors first, each to the rank with the fewest bytes to fetch
    # so far (its whole plan, then the other ranks' columns of what it owns), so that the
    # ranks finish their reads together.
    load = [planned for _, planned in every]
    owners: dict[str, int] = {}
    for name in sorted(tilings, key=lambda n: (-_nbytes(tilings[n]), n)):
        owner = min(range(size), key=lambda r: (load[r], r))
        owners[name] = owner
        load[owner] += _nbytes(tilings[name]) * (size - 1) // size
    shared = sorted(
        (
            Shared(
                name,
                t.file,
                t.start,
                t.rows,
                t.row_bytes,
                t.width,
                t.columns,
                owners[name],
                mine[name][0],
            )
            for name, t in tilings.items()
        ),
        key=lambda s: (s.file, s.start),
    )
    if not shared:
        return None
    return GroupShare(rank, tuple(shared), _rounds(shared, size))


def _fields(ranges: RowRanges) -> tuple[str, int, int, int, int]:
    return (ranges.file, ranges.offset, ranges.length, ranges.stride, ranges.rows)


def _nbytes(tiling: _Tiling) -> int:
    return tiling.rows * tiling.row_bytes


def _tiling(entries: list[tuple[str, int, int, int, int] | None]) -> _Tiling | None:
    """The tiling of the ranks' runs (``file, offset, length, stride, rows`` each) when
    they cut the same rows into equal columns that tile every row; None otherwise."""
    if any(e is None for e in entries):
        return None
    files, offsets, lengths, strides, rows = zip(*entries, strict=True)
    if any(len(set(field)) != 1 for field in (files, lengths, strides, rows)):
        return None
    width, row_bytes, start = lengths[0], strides[0], min(offsets)
    columns = tuple(offset - start for offset in offsets)
    if width * len(entries) != row_bytes or sorted(columns) != list(range(0, row_bytes, width)):
        return None
    return _Tiling(files[0], start, width, row_bytes, rows[0], columns)


def _rounds(shared: Sequence[Shared], size: int) -> tuple[tuple[int, ...], ...]:
    """Consecutive tensors, a round ending before any rank would own more than
    :data:`ROUND_BYTES` of them (a larger tensor is a round of its own)."""
    rounds: list[tuple[int, ...]] = []
    current: list[int] = []
    held = [0] * size
    for k, s in enumerate(shared):
        if current and held[s.owner] + s.nbytes > ROUND_BYTES:
            rounds.append(tuple(current))
            current, held = [], [0] * size
        current.append(k)
        held[s.owner] += s.nbytes
    rounds.append(tuple(current))
    return tuple(rounds)


def whole_segments(owned: Sequence[Shared], first_target: int) -> list[Segment]:
    """The reads of ``owned`` whole, into destinations ``first_target`` on."""
    return [
        Segment(s.file, s.start, s.nbytes, first_target + i, 0, s.name) for i, s in enumerate(owned)
    ]


@dataclass(frozen=True)
class _Left:
    """What a rank that failed before the agreement says in it: its error."""

    cause: str


@contextmanager
def failing_together(group: Any, checkpoint: Callable[[], Checkpoint | None]) -> Iterator[None]:
    """Run a rank's steps before its group's agreement (:func:`plan_share`): when one
    raises, and the other ranks are to agree (``group`` given, ``checkpoint()`` a Hugging
    Face checkpoint in object storage), this rank takes part in the agreement saying it
    failed, then re-raises: the others raise at once, naming it. A checkpoint this rank
    could not open is not told (the others meet the same listing and headers)."""
    try:
        yield
    except Exception as exc:
        opened = checkpoint()
        if group is not None and opened is not None and _agrees(opened):
            import torch.distributed as dist

            every: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, _Left(_describe(exc)), group=group)
        raise


def _agrees(checkpoint: Checkpoint) -> bool:
    """Whether the ranks of a TP group loading ``checkpoint`` share its split-1 tensors."""
    return is_remote(checkpoint.root) and checkpoint.layout != "converted"


def checked_round(share: GroupShare, group: Any, read: Callable[[], _T]) -> _T:
    """``read()``'s value, once every rank of ``group`` says its read of this round
    succeeded; else this rank's own error, or a StorageError naming the rank that failed
    and its cause."""
    import torch.distributed as dist

    failure: BaseException | None = None
    value: _T | None = None
    try:
        value = read()
    except Exception as exc:
        failure = exc
    said = None if failure is None else (_describe(failure), getattr(failure, "file", None))
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, said, group=group)
    if failure is not None:
        raise failure
    for rank, cause in enumerate(every):
        if cause is not None:
            message, file = cause
            raise StorageError(
                f"rank {rank} of the TP group could not fetch the split-1 tensors it fetches "
                f"for the group: {message}",
                url=file or share.shared[0].file,
            )
    assert value is not None
    return value


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def scatter_round(
    share: GroupShare,
    round_: int,
    group: Any,
    destinations: Sequence[torch.Tensor],
    wholes: Sequence[torch.Tensor],
    touched: set[int] | None,
    arrivals: Arrivals | None = None,
) -> None:
    """Give every rank its columns of round ``round_``'s tensors: ``destinations`` are
    this rank's shard buffers (1-D bytes), ``wholes`` the whole tensors it fetched in
    this round, in :meth:`GroupShare.owned` order; ``arrivals`` is told of each as it
    lands (what a holder forwards while it loads)."""
    import torch.distributed as dist

    whole = iter(wholes)
    for k in share.rounds[round_]:
        s = share.shared[k]
        if touched is not None:
            touched.add(s.target)
        pieces = None
        if s.owner == share.rank:
            rows = next(whole).view(s.rows, s.row_bytes)
            pieces = [rows[:, c : c + s.width].contiguous().view(-1) for c in s.columns]
        dist.scatter(destinations[s.target], pieces, group=group, group_src=s.owner)
        if arrivals is not None:
            if destinations[s.target].device.type == "cuda":  # NCCL's scatter is queued
                torch.cuda.current_stream(destinations[s.target].device).synchronize()
            arrivals.landed(s.target, 0, destinations[s.target].numel())
