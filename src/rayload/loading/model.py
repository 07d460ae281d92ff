"""The engine's model on a rank: what a ``model=`` factory receives (:class:`ModelContext`,
its engine phases), and :func:`build_and_fill`, the rank's model step: build the module,
then fill it from the rank's shards (:mod:`rayload.loading.fill`).

Ray-free: the rank actor calls these; unit tests call them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rayload.errors import ConfigError
from rayload.loading.fill import fill_model
from rayload.loading.report import PhaseTimer

if TYPE_CHECKING:
    import torch
    from torch import nn

MODEL_PHASE = "rank.model"
"""The rank's whole model step: build the module, then fill it."""
MODEL_BUILD_PHASE = "rank.model.build"
"""``factory(context)``."""
MODEL_FILL_PHASE = "rank.model.fill"
""":func:`fill_model`."""

ENGINE_PREFIX = "engine."
"""Span names of the engine's own phases: ``state.phase("warmup")`` is ``engine.warmup``."""


def engine_phase_name(name: str) -> str:
    """``engine.<name>``: the span name of an engine phase (``name`` kept if prefixed)."""
    if not name or not isinstance(name, str):
        raise ConfigError(f"an engine phase needs a non-empty name, got {name!r}")
    return name if name.startswith(ENGINE_PREFIX) else ENGINE_PREFIX + name


def engine_phases(timer: PhaseTimer) -> Callable[..., AbstractContextManager[dict[str, Any]]]:
    """``phase(name, **attributes)`` recording ``engine.<name>`` into ``timer``: what
    :attr:`ModelContext.phase` and ``RankState.phase`` are on a rank."""

    def phase(name: str, **attributes: Any) -> AbstractContextManager[dict[str, Any]]:
        return timer.phase(engine_phase_name(name), **attributes)

    return phase


@contextmanager
def no_phase(name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
    """A phase recorded nowhere: the default of :attr:`ModelContext.phase`."""
    yield dict(attributes)


@dataclass(frozen=True)
class ModelContext:
    """What ``factory(context)`` gets on each rank to build that rank's ``torch.nn.Module``.

    ``config`` is the checkpoint's ``config.json`` (empty when it has none);
    ``process_group`` the ``torch.distributed`` group of the load's ranks (the default
    group; None when the load was asked for none, ``process_group=None``); ``phase(name)``
    records an engine phase of this rank into the load's trace (a context manager);
    ``expert_parallel`` says the load divided the experts among the ranks (contiguous
    blocks: rank ``r`` of ``tp`` holds experts ``r*E/tp .. (r+1)*E/tp - 1`` whole) instead
    of splitting every expert.
    """

    rank: int
    tp_size: int
    device: str
    config: Mapping[str, Any]
    process_group: Any = None
    phase: Callable[..., Any] = field(default=no_phase, repr=False, compare=False)
    expert_parallel: bool = False


ModelFactory = Callable[[ModelContext], Any]
"""``factory(context) -> torch.nn.Module``: builds a rank's module (meta or real device)."""


def build_and_fill(
    factory: ModelFactory,
    context: ModelContext,
    tensors: MutableMapping[str, torch.Tensor],
    *,
    timer: PhaseTimer,
) -> nn.Module:
    """``factory(context)`` then :func:`fill_model`, timed as ``rank.model`` >
    ``rank.model.build``, ``rank.model.fill``. Returns the filled module."""
    from torch import nn

    with timer.phase(MODEL_PHASE, device=context.device) as model_attrs:
        with timer.phase(MODEL_BUILD_PHASE) as attrs:
            module = factory(context)
            if not isinstance(module, nn.Module):
                raise ConfigError(
                    f"rank {context.rank}: the model factory returned "
                    f"{type(module).__name__}, not a torch.nn.Module"
                )
            attrs["model.class"] = type(module).__qualname__
        with timer.phase(MODEL_FILL_PHASE) as attrs:
            fill = fill_model(module, tensors, rank=context.rank)
            attrs.update(fill.attributes())
        model_attrs["model.class"] = type(module).__qualname__
    return module
