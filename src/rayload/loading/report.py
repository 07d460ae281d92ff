"""Plain records a rank load produces: timed phases and the rank report.

They are frozen dataclasses so they pickle cheaply across Ray and carry no OpenTelemetry
objects: ``loading/`` records *when* each phase ran; ``tracing/`` turns the records into
spans.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rayload.loading.methods import LoadMethod, MethodReport

RESOLVE = "rank.resolve"
PLAN = "rank.plan"
READ = "rank.read"
TO_DEVICE = "rank.to_device"
SYNC = "rank.sync"
POST_LOAD = "rank.post_load"
PHASES = (RESOLVE, PLAN, READ, TO_DEVICE, SYNC, POST_LOAD)
DESTINATIONS = "rank.destinations"
"""Between rank.plan and rank.read when the load is given an engine's memory: where
each shard of the plan is read into (an engine's parameters)."""
"""Span names of a rank's phases, all children of ``rank.load``."""

STORAGE_SOURCE = "storage"
"""The ``rayload.source`` of bytes read from the checkpoint's files (the other source is a
peer: :func:`rayload.loading.peer.source_label`)."""


@dataclass(frozen=True)
class PhaseRecord:
    """One timed phase. Times are ``time.time_ns()`` wall-clock nanoseconds of the process
    that ran it (the driver corrects for clock offsets later)."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


class PhaseTimer:
    """Collects :class:`PhaseRecord` s; ``with timer.phase("rank.read"):`` times a block.

    A phase that raises is still recorded, with ``error`` set, and the exception propagates.
    ``clock`` returns wall-clock nanoseconds; tests inject a skewed one to model another
    node's clock.
    """

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self.clock = clock
        self.records: list[PhaseRecord] = []
        self._tags: dict[str, Any] = {}

    @contextmanager
    def phase(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        """Time the block; the yielded dict may be filled with attributes inside it."""
        attrs = {**self._tags, **attributes}
        start = self.clock()
        try:
            yield attrs
        except BaseException as exc:
            self.records.append(PhaseRecord(name, start, self.clock(), attrs, repr(exc)))
            raise
        self.records.append(PhaseRecord(name, start, self.clock(), attrs))

    @property
    def tags(self) -> dict[str, Any]:
        """The attributes :meth:`tagged` gives the phases started now."""
        return dict(self._tags)

    @contextmanager
    def tagged(self, **attributes: Any) -> Iterator[None]:
        """Give every phase started inside the block ``attributes`` (a phase's own
        attributes win): e.g. ``source="storage"`` on the phases of a storage read that
        another backend runs for its fallback."""
        saved = self._tags
        self._tags = {**saved, **attributes}
        try:
            yield
        finally:
            self._tags = saved


@dataclass(frozen=True)
class RankReport:
    """What one rank did. Same fields as an entry of ``rayload load --json``'s ``ranks``.

    ``start_ns``/``end_ns`` bound the whole rank load (from the start of config parsing to
    the end of post-load work); ``phases`` are the timed children.

    ``bytes_read`` counts the bytes read from the checkpoint's files
    (:attr:`bytes_from_storage`), ``bytes_from_peers`` those copied from a rank of another
    replica (the ``peer`` method); ``source`` is the ``rayload.source`` of the bytes the
    rank holds: ``"storage"``, or ``"peer replica=<id> rank=<r> node=<node>"``.
    """

    rank: int
    tp_size: int
    device: str
    method: MethodReport
    bytes_read: int
    tensors: int
    start_ns: int
    end_ns: int
    files: tuple[str, ...] = ()
    phases: tuple[PhaseRecord, ...] = ()
    node_id: str | None = None
    model_role: str = "main"
    bytes_from_peers: int = 0
    source: str = STORAGE_SOURCE
    replica: int = 0
    storage: str = "file"
    """Where the checkpoint is: ``file`` or ``s3`` (apart from the method)."""
    storage_endpoint: str | None = None
    """The object store's host (None for files)."""
    storage_bucket: str | None = None
    requests: int = 0
    """Requests made to object storage (headers, listings and ranges), retries included."""
    retries: int = 0
    """Of those, the retried ones (throttling, 5xx, connection errors, bodies cut short)."""
    peer_switch: str | None = None
    """The peer given failed part way and another gave (some of) the rest: who, why, how
    many tensors came from where (``BackendResult.peer_switch``)."""

    @property
    def label(self) -> str:
        """``rank 1``, or ``replica 2 rank 1`` for a replica other than the first."""
        return (
            f"rank {self.rank}" if self.replica == 0 else f"replica {self.replica} rank {self.rank}"
        )

    @property
    def bytes_from_storage(self) -> int:
        """Bytes read from the checkpoint's files: ``bytes_read`` by its other name."""
        return self.bytes_read

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def phase_seconds(self, name: str) -> float:
        """Total seconds spent in phases called ``name`` (0.0 if none ran)."""
        return sum(p.seconds for p in self.phases if p.name == name)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` shape of one rank."""
        return {
            "rank": self.rank,
            "replica": self.replica,
            "node_id": self.node_id,
            "device": self.device,
            "method": self.method.to_dict(),
            "bytes_read": self.bytes_read,
            "bytes_from_storage": self.bytes_from_storage,
            "bytes_from_peers": self.bytes_from_peers,
            "source": self.source,
            "storage": self.storage,
            "storage_endpoint": self.storage_endpoint,
            "storage_bucket": self.storage_bucket,
            "requests": self.requests,
            "retries": self.retries,
            "peer_switch": self.peer_switch,
            "tensors": self.tensors,
            "seconds": round(self.seconds, 6),
        }


def mixed_method_warnings(reports: Sequence[RankReport]) -> list[str]:
    """Warnings for a load whose ranks did not all run the same way: different effective
    methods or devices across ranks, or any fallback (shown as requested -> selected ->
    effective, repeats dropped, with the reason), or a switch from one peer to another.
    Empty when every rank agrees."""
    warnings: list[str] = []
    by_method: dict[str, list[str]] = {}
    by_device: dict[str, list[str]] = {}
    several = any(report.replica for report in reports)
    for report in reports:
        who = f"{report.replica}/{report.rank}" if several else str(report.rank)
        if report.method.effective is not LoadMethod.PEER:  # peer beside storage: by design
            by_method.setdefault(report.method.effective.value, []).append(who)
        by_device.setdefault(report.device, []).append(who)
    if len(by_method) > 1:
        warnings.append(f"ranks loaded with different methods: {_groups(by_method)}")
    if len(by_device) > 1:
        warnings.append(f"ranks loaded onto different devices: {_groups(by_device)}")
    for report in reports:
        method = report.method
        if method.fallback_reason:
            chain = [method.requested.value]
            for step in (method.selected.value, method.effective.value):
                if step != chain[-1]:
                    chain.append(step)
            warnings.append(
                f"{report.label} fell back: {' -> '.join(chain)}: {method.fallback_reason}"
            )
        elif report.peer_switch:
            warnings.append(f"{report.label} switched peers: {report.peer_switch}")
    return warnings


def _groups(ranks_by_value: dict[str, list[str]]) -> str:
    """``scratch on ranks [0, 1]; converted on ranks [2]`` (``replica/rank`` with
    replicas)."""
    return "; ".join(
        f"{value} on ranks [{', '.join(ranks)}]" for value, ranks in ranks_by_value.items()
    )
