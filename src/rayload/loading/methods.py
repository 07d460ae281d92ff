"""Load methods and the per-rank record of which one really ran."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LoadMethod(str, enum.Enum):
    """How a rank reads its weights. Values are the CLI's ``--method`` strings.

    ``peer`` copies the rank's shards from a rank of another replica that holds them
    (same checkpoint identity, same plan), falling back to storage when it cannot.
    """

    AUTO = "auto"
    SCRATCH = "scratch"
    CONVERTED = "converted"
    FASTSAFETENSORS = "fastsafetensors"
    FASTSAFETENSORS_GDR = "fastsafetensors_gdr"
    DUMMY = "dummy"
    PEER = "peer"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class MethodReport:
    """What a rank was asked to do, what the resolver chose and what really ran.

    Invariant: ``fallback_reason`` is None exactly when nothing fell back, i.e. when
    ``selected`` is what was requested (or what ``auto`` chose) and ``effective`` equals
    ``selected``.
    """

    requested: LoadMethod
    selected: LoadMethod
    effective: LoadMethod
    fallback_reason: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {
            "requested": self.requested.value,
            "selected": self.selected.value,
            "effective": self.effective.value,
            "fallback_reason": self.fallback_reason,
        }
