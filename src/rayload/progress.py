"""The progress events of a load: what ``rayload.load(progress=...)`` is called with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Stage = Literal["placed", "spawned", "rank_loaded"]


@dataclass(frozen=True)
class LoadProgress:
    """One step of a load, as ``rayload.load(progress=...)`` reports it."""

    stage: Stage
    tp_size: int
    rank: int | None = None
    node_id: str | None = None
    bytes_read: int = 0
    seconds: float = 0.0
    method: str | None = None
    done: int = 0


ProgressCallback = Callable[[LoadProgress], None]
"""What ``rayload.load(progress=...)`` takes: called once per :class:`LoadProgress`."""
