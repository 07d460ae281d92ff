"""The backend contract: one class per load method, registered by method.

A backend executes one rank's :class:`~rayload.loading.plan.RankPlan` on one device. The
public :meth:`Backend.load` checks the result once (every planned tensor, with its shard
shape and dtype, on the device) and times the device synchronization; implementations
override :meth:`Backend._load` and record ``rank.read`` and ``rank.to_device`` themselves;
a phase that queues device work ends with :func:`synchronize`.
A backend never branches on the method name: methods that differ in one setting are two
classes sharing a base.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from rayload.errors import CheckpointError
from rayload.loading.arrivals import Arrivals, Publish
from rayload.loading.checkpoint import Checkpoint
from rayload.loading.dtypes import torch_dtype
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import RankPlan
from rayload.loading.probe import EnvProbe
from rayload.loading.reader import ReaderOptions
from rayload.loading.reader.reads import byte_view
from rayload.loading.report import STORAGE_SOURCE, SYNC, TO_DEVICE, PhaseTimer

if TYPE_CHECKING:
    from rayload.loading.peer import PeerSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendResult:
    """What a backend loaded.

    ``effective`` is the method that really ran; ``fallback_reason`` is set exactly when it
    differs from the backend's own method (e.g. fastsafetensors silently used its CPU
    copier instead of GDS).
    """

    tensors: dict[str, torch.Tensor]
    bytes_read: int
    """Bytes read from the checkpoint's files."""
    effective: LoadMethod
    fallback_reason: str | None = None
    copied_into: bool = False
    """Loading into existing tensors (``Backend.load(into=...)``): True when the backend
    loaded fresh tensors and copied them in, False when it read straight into them."""
    bytes_from_peers: int = 0
    """Bytes copied from a rank of another replica (the ``peer`` method)."""
    source: str = STORAGE_SOURCE
    """Where the tensors' bytes came from: ``storage``, or the peer's
    :func:`~rayload.loading.peer.source_label`."""
    peer_switch: str | None = None
    """Set when the peer given failed part way and another holder gave (some of) the rest:
    who failed, why, and how many tensors came from where (the method is still ``peer``
    when no byte came from storage)."""


class Backend(ABC):
    """Loads one rank's shards onto a device.

    ``checkpoint`` is the opened checkpoint (the converted backend reads its manifest);
    ``options`` tune rayload's own reader. ``peer`` (the rank of another replica holding
    the shards) and ``storage`` (the storage method to read with when the peer fails,
    :attr:`~rayload.loading.resolve.Resolution.storage`) are for the ``peer`` backend;
    the others ignore them. ``group``, the TP group's ``torch.distributed`` process
    group, lets ``scratch`` fetch split-1 tensors from object storage once per group.
    ``publish`` (:data:`~rayload.loading.arrivals.Publish`) is told the memory of the
    plan's tensors as the backend allocates it and marks their bytes as they land, so a
    holder can forward them while this load runs (``scratch`` and ``peer`` do; the
    others publish nothing, and their tensors count as arrived when the load ends).
    """

    method: ClassVar[LoadMethod]

    def __init__(
        self,
        probe: EnvProbe,
        *,
        checkpoint: Checkpoint | None = None,
        options: ReaderOptions | None = None,
        peer: PeerSource | None = None,
        storage: LoadMethod | None = None,
        group: Any = None,
        publish: Publish | None = None,
    ) -> None:
        self.probe = probe
        self.checkpoint = checkpoint
        self.options = options or ReaderOptions()
        self.peer = peer
        self.storage = storage
        self.group = group
        self.publish = publish

    def _publisher(self, plan: RankPlan) -> Callable[[Sequence[torch.Tensor]], Arrivals] | None:
        """``publish`` for ``plan``'s tensors, given their memory (the first buffers of a
        read); None without ``publish``."""
        publish = self.publish
        if publish is None:
            return None
        names = [s.name for s in plan.shards]
        return lambda buffers: publish(names, buffers[: len(names)])

    def load(
        self,
        plan: RankPlan,
        device: torch.device | str,
        timer: PhaseTimer,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        written: set[str] | None = None,
    ) -> BackendResult:
        """Load every shard of ``plan`` onto ``device``; phases go to ``timer``.

        Postcondition (checked): exactly the plan's tensors, each with its shard shape and
        dtype, on ``device``, and the device synchronized inside a ``rank.sync`` phase.

        With ``into`` (a rank's resident tensors by name: every shard's, with its shape,
        on ``device``), the shards are loaded into those tensors, which the result holds:
        read straight into them (:meth:`_load_into`) when each is contiguous with the
        shard's dtype, else loaded fresh and copied in (``copied_into``; ``copy_``
        converts a dtype). ``written`` collects the names of the tensors the backend began
        to write, so a caller whose load raised knows which ones may hold new bytes.
        """
        target = torch.device(device)
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", 0)
        if into is None:
            result = self._load(plan, target, timer)
        else:
            written = written if written is not None else set()
            views = _byte_views(plan, into, target)
            if views is None:
                result = self._copy_into(plan, target, timer, into, written)
            else:
                result = self._load_into(plan, target, timer, views, written)
                result = replace(result, tensors={s.name: into[s.name] for s in plan.shards})
        with timer.phase(SYNC, device=str(target)):
            synchronize(target)
        _check_result(plan, result, target, converted=into is not None)
        return result

    @abstractmethod
    def _load(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        """Read ``plan`` onto ``device``, timing ``rank.read`` and ``rank.to_device``."""

    def _load_into(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        views: Sequence[torch.Tensor],
        written: set[str],
    ) -> BackendResult:
        """Read ``plan`` into ``views`` (shard ``i``'s destination bytes, a 1-D uint8 view of
        the resident tensor), adding each tensor to ``written`` as its writing begins.
        Default: load fresh tensors and copy them in; backends whose reader can fill
        given memory override it."""
        into = {s.name: views[i] for i, s in enumerate(plan.shards)}
        return self._copy_into(plan, device, timer, into, written, as_bytes=True)

    def _copy_into(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        into: Mapping[str, torch.Tensor],
        written: set[str],
        *,
        as_bytes: bool = False,
    ) -> BackendResult:
        """Load fresh tensors, then copy each into its destination (inside a second
        ``rank.to_device``, ``copied_into_resident=True``): a second copy of the shards
        while it runs, which the result says (``copied_into``)."""
        result = self._load(plan, device, timer)
        with timer.phase(TO_DEVICE, device=str(device), copied_into_resident=True):
            for shard in plan.shards:
                source = result.tensors[shard.name]
                if as_bytes:
                    source = source.reshape(-1).view(torch.uint8)
                written.add(shard.name)
                into[shard.name].copy_(source)
            synchronize(device)
        tensors = {s.name: into[s.name] for s in plan.shards}
        return replace(result, tensors=tensors, copied_into=True)


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished all queued work (no-op on CPU). A phase timing
    device work calls it last, so the phase ends when the work does, not when it was
    queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BACKENDS: dict[LoadMethod, type[Backend]] = {}
"""Load method -> backend class, filled by :func:`register`."""

_B = TypeVar("_B", bound=type[Backend])


class ReaderBackend(Backend):
    """A backend whose reader fills given memory: it implements :meth:`_read` once, for
    fresh destinations (``targets`` empty) and for the resident tensors of a reload."""

    def _load(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        return self._read(plan, device, timer, (), None)

    def _load_into(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        views: Sequence[torch.Tensor],
        written: set[str],
    ) -> BackendResult:
        """Straight into the resident tensors; ``written`` gets every shard whose bytes the
        reader began to write, even when the read fails."""
        touched: set[int] = set()
        try:
            return self._read(plan, device, timer, views, touched)
        finally:
            written.update(plan.shards[i].name for i in touched if i < len(plan.shards))

    @abstractmethod
    def _read(
        self,
        plan: RankPlan,
        device: torch.device,
        timer: PhaseTimer,
        targets: Sequence[torch.Tensor],
        touched: set[int] | None,
    ) -> BackendResult:
        """Read ``plan`` into ``targets`` (new buffers when empty), adding to ``touched``
        (when given) the index of each destination as its writing begins."""


def register(method: LoadMethod) -> Callable[[_B], _B]:
    """Class decorator: ``@register(LoadMethod.SCRATCH)`` makes the class the backend of
    ``method``. Registering a method twice is a programming error."""

    def decorator(cls: _B) -> _B:
        if method in BACKENDS:
            raise RuntimeError(f"{method} already has backend {BACKENDS[method].__name__}")
        cls.method = method
        BACKENDS[method] = cls
        return cls

    return decorator


def _byte_views(
    plan: RankPlan, into: Mapping[str, torch.Tensor], device: torch.device
) -> list[torch.Tensor] | None:
    """Each shard's destination as bytes to read into, in plan order; None when one cannot
    take the shard's raw bytes (another dtype, not contiguous). A missing tensor, or one of
    another shape or device, or a resident tensor the plan lacks, is a CheckpointError naming
    it: nothing was written yet."""
    if extra := into.keys() - {s.name for s in plan.shards}:
        name = min(extra)
        raise CheckpointError(
            f"rank {plan.rank}: the checkpoint gives this rank no tensor {name!r}, which it "
            f"holds resident ({len(extra)} such tensor(s))",
            tensor=name,
        )
    views = []
    for shard in plan.shards:
        tensor = into.get(shard.name)
        if tensor is None:
            raise CheckpointError(
                f"rank {plan.rank}: no resident tensor {shard.name!r} to load into",
                tensor=shard.name,
            )
        if tuple(tensor.shape) != shard.shape or tensor.device != device:
            raise CheckpointError(
                f"rank {plan.rank}: tensor {shard.name!r} is {tuple(shard.shape)} in the "
                f"checkpoint but the resident one is {tuple(tensor.shape)} on {tensor.device}",
                tensor=shard.name,
            )
        view = byte_view(tensor) if tensor.dtype == torch_dtype(shard.dtype) else None
        if view is None:
            return None
        views.append(view)
    return views


def _check_result(
    plan: RankPlan, result: BackendResult, device: torch.device, *, converted: bool = False
) -> None:
    expected = {s.name for s in plan.shards}
    if missing := expected - result.tensors.keys():
        raise CheckpointError(
            f"rank {plan.rank}: backend {result.effective} returned no tensor for "
            f"{sorted(missing)[:5]}",
            tensor=min(missing),
        )
    for shard in plan.shards:
        tensor = result.tensors[shard.name]
        dtype = tensor.dtype if converted else torch_dtype(shard.dtype)
        want = (shard.shape, dtype, device)
        got = (tuple(tensor.shape), tensor.dtype, tensor.device)
        if got != want:
            raise CheckpointError(
                f"rank {plan.rank}: tensor {shard.name!r} was loaded as "
                f"(shape, dtype, device)={got}, the plan says {want}",
                tensor=shard.name,
            )
