"""The engine's model on a rank: what a ``model=`` factory receives (:class:`ModelContext`,
its engine phases), and the rank's model step: :func:`build_module` before any byte is
read, :func:`model_destinations` (the memory each shard is read into: the module's own,
where it has it) and :func:`fill_module` after the read (:mod:`rayload.loading.fill`).

Ray-free: the rank actor calls these; unit tests call them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rayload.errors import ConfigError
from rayload.loading.fill import ModelFill, destinations, fill_model
from rayload.loading.report import PhaseTimer

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rayload.loading.plan import RankPlan

MODEL_PHASE = "rank.model"
"""The rank's whole model step in a benchmark's summary: ``rank.model.build`` plus
``rank.model.fill`` (not a span: the read lies between them)."""
MODEL_BUILD_PHASE = "rank.model.build"
"""``factory(context)``, before the checkpoint is opened."""
MODEL_FILL_PHASE = "rank.model.fill"
""":func:`fill_model`, within ``rank.post_load``."""

_READS_INTO_MEMORY = frozenset({"auto", "scratch", "converted"})
"""Requested methods whose reader fills given memory (``auto`` picks one of them when
the load is given memory, :func:`rayload.loading.resolve.resolve_method`)."""

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


def build_module(factory: ModelFactory, context: ModelContext, *, timer: PhaseTimer) -> nn.Module:
    """``factory(context)``, timed as ``rank.model.build``: the rank's module, checked to
    be a ``torch.nn.Module`` (a :class:`ConfigError` otherwise)."""
    from torch import nn

    with timer.phase(MODEL_BUILD_PHASE) as attrs:
        module = factory(context)
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"rank {context.rank}: the model factory returned "
                f"{type(module).__name__}, not a torch.nn.Module"
            )
        attrs["model.class"] = type(module).__qualname__
    return module


def model_destinations(
    module: nn.Module, method: str, device: str, *, peer: bool = False
) -> Callable[[RankPlan], dict[str, torch.Tensor]] | None:
    """What ``load_rank(into=...)`` gets for ``module``: given the rank's plan, the memory
    each shard is read into (:func:`rayload.loading.fill.destinations`: the module's own
    where it has it, so that :func:`fill_module` copies nothing). None (the shards are
    read into fresh memory, then put in the module) when the requested ``method`` loads
    into memory of its own (fastsafetensors, dummy; a ``peer`` source onto a GPU: a gloo
    channel lands in host memory), or when the module has nothing to read into (every
    parameter on meta, nothing stacked): it then takes the shards' storage as they are.
    A ``peer`` source onto the CPU writes straight into the module's memory too."""
    if peer:
        fills = str(device).split(":", 1)[0] == "cpu" and method in (*_READS_INTO_MEMORY, "peer")
    else:
        fills = method in _READS_INTO_MEMORY
    if not fills:
        return None
    has_memory = any(not p.is_meta for p in module.parameters())
    if not has_memory and not getattr(module, "stacked_params_mapping", None):
        return None

    def into(plan: RankPlan) -> dict[str, torch.Tensor]:
        return destinations(module, plan, device)

    return into


def fill_module(
    module: nn.Module, tensors: MutableMapping[str, torch.Tensor], *, rank: int, timer: PhaseTimer
) -> ModelFill:
    """:func:`fill_model`, timed as ``rank.model.fill`` (its counts as attributes)."""
    with timer.phase(MODEL_FILL_PHASE) as attrs:
        fill = fill_model(module, tensors, rank=rank)
        attrs.update(fill.attributes())
        attrs["model.class"] = type(module).__qualname__
    return fill
