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
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from rayload.errors import CheckpointError
from rayload.loading.checkpoint import Checkpoint
from rayload.loading.dtypes import torch_dtype
from rayload.loading.methods import LoadMethod
from rayload.loading.plan import RankPlan
from rayload.loading.probe import EnvProbe
from rayload.loading.reader import ReaderOptions
from rayload.loading.report import SYNC, PhaseTimer

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
    effective: LoadMethod
    fallback_reason: str | None = None


class Backend(ABC):
    """Loads one rank's shards onto a device.

    ``checkpoint`` is the opened checkpoint (the converted backend reads its manifest);
    ``options`` tune rayload's own reader.
    """

    method: ClassVar[LoadMethod]

    def __init__(
        self,
        probe: EnvProbe,
        *,
        checkpoint: Checkpoint | None = None,
        options: ReaderOptions | None = None,
    ) -> None:
        self.probe = probe
        self.checkpoint = checkpoint
        self.options = options or ReaderOptions()

    def load(self, plan: RankPlan, device: torch.device | str, timer: PhaseTimer) -> BackendResult:
        """Load every shard of ``plan`` onto ``device``; phases go to ``timer``.

        Postcondition (checked): exactly the plan's tensors, each with its shard shape and
        dtype, on ``device``, and the device synchronized inside a ``rank.sync`` phase.
        """
        target = torch.device(device)
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", 0)
        result = self._load(plan, target, timer)
        with timer.phase(SYNC, device=str(target)):
            synchronize(target)
        _check_result(plan, result, target)
        return result

    @abstractmethod
    def _load(self, plan: RankPlan, device: torch.device, timer: PhaseTimer) -> BackendResult:
        """Read ``plan`` onto ``device``, timing ``rank.read`` and ``rank.to_device``."""


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished all queued work (no-op on CPU). A phase timing
    device work calls it last, so the phase ends when the work does, not when it was
    queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BACKENDS: dict[LoadMethod, type[Backend]] = {}
"""Load method -> backend class, filled by :func:`register`."""

_B = TypeVar("_B", bound=type[Backend])


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


def _check_result(plan: RankPlan, result: BackendResult, device: torch.device) -> None:
    expected = {s.name for s in plan.shards}
    if missing := expected - result.tensors.keys():
        raise CheckpointError(
            f"rank {plan.rank}: backend {result.effective} returned no tensor for "
            f"{sorted(missing)[:5]}",
            tensor=min(missing),
        )
    for shard in plan.shards:
        tensor = result.tensors[shard.name]
        want = (shard.shape, torch_dtype(shard.dtype), device)
        got = (tuple(tensor.shape), tensor.dtype, tensor.device)
        if got != want:
            raise CheckpointError(
                f"rank {plan.rank}: tensor {shard.name!r} was loaded as "
                f"(shape, dtype, device)={got}, the plan says {want}",
                tensor=shard.name,
            )
