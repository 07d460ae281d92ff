"""TEST HOOKS: make one rank fail on purpose, so the failure paths run on a real cluster.

Never set in production. The driver reads ``RAYLOAD_TEST_FAULT`` (a JSON object, e.g.
``{"rank": 1, "phase": "rank.plan", "action": "exit"}``) and hands the fault to that rank's
actor, which triggers it when the named phase starts:

* ``raise``: the phase raises ``RuntimeError`` (a rank that fails)
* ``exit``: the actor process exits at once with ``os._exit(1)`` (a rank that dies, as
  under the OOM killer)
* ``hang``: the phase sleeps ``seconds`` (a rank that hangs past the timeout)

The env var is read in the driver, not in the actors, so it works for the CLI and the
Python API alike and no worker environment has to be prepared.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from rayload.errors import ConfigError
from rayload.loading.report import PhaseTimer

FAULT_ENV = "RAYLOAD_TEST_FAULT"


class FaultInjection(BaseModel):
    """One injected fault: ``action`` on ``rank`` when ``phase`` starts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    phase: str = "rank.plan"
    action: Literal["raise", "exit", "hang"] = "raise"
    seconds: float = 3600.0

    def trigger(self) -> None:
        if self.action == "raise":
            raise RuntimeError(f"injected fault in {self.phase} ({FAULT_ENV})")
        if self.action == "exit":
            os._exit(1)
        time.sleep(self.seconds)


def fault_from_env(environ: Mapping[str, str] = os.environ) -> FaultInjection | None:
    """The fault ``RAYLOAD_TEST_FAULT`` asks for, or None when it is unset or empty."""
    raw = environ.get(FAULT_ENV, "").strip()
    if not raw:
        return None
    try:
        return FaultInjection.model_validate(json.loads(raw))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ConfigError(f"{FAULT_ENV} is not a valid fault: {exc}") from exc


class FaultyTimer(PhaseTimer):
    """A :class:`PhaseTimer` that triggers ``fault`` when its phase starts, so the fault
    happens inside the real load, and the phase is recorded as failed."""

    def __init__(self, fault: FaultInjection, clock: Callable[[], int] = time.time_ns) -> None:
        super().__init__(clock)
        self.fault = fault

    @contextmanager
    def phase(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        with super().phase(name, **attributes) as attrs:
            if name == self.fault.phase:
                self.fault.trigger()
            yield attrs
