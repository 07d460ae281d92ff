"""The engine's model on a rank: what a ``model=`` factory receives, and filling the
module it returns from the rank's shards.

Ray-free: the rank actor calls these; unit tests call them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@contextmanager
def _no_phase(name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
    yield dict(attributes)


@dataclass(frozen=True)
class ModelContext:
    """What ``factory(context)`` gets on each rank to build that rank's ``torch.nn.Module``.

    ``config`` is the checkpoint's ``config.json`` (empty when it has none);
    ``process_group`` the ``torch.distributed`` group of the load's ranks (None when the
    load was asked for none, or for tp 1 without one); ``phase(name)`` records an engine
    phase of this rank into the load's trace (a context manager).
    """

    rank: int
    tp_size: int
    device: str
    config: Mapping[str, Any]
    process_group: Any = None
    phase: Callable[..., Any] = field(default=_no_phase, repr=False, compare=False)


ModelFactory = Callable[[ModelContext], Any]
"""``factory(context) -> torch.nn.Module``: builds a rank's module (meta or real device)."""
