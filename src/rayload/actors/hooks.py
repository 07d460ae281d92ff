"""TEST HOOKS: make a rank fail on purpose, or its clock run ahead, so the failure paths and
the clock-offset correction run on a real cluster.

Never set in production. The driver reads ``RAYLOAD_TEST_HOOKS``, a JSON object such as
``{"fault": {"rank": 1, "phase": "rank.plan", "action": "exit"}, "clock_skew_ns": {"1": 5e9}}``,
and hands each rank actor its part. ``clock_skew_ns`` shifts every time that rank reports.
A fault triggers when the named phase starts:

* ``raise``: the phase raises ``RuntimeError`` (a rank that fails)
* ``exit``: the actor process exits at once with ``os._exit(1)`` (a rank that dies, as
  under the OOM killer)
* ``ray_kill``: the actor is killed with ``ray.kill`` (as by an operator or a controller)
* ``hang``: the phase sleeps ``seconds`` (a rank that hangs past the timeout)

``probe_overrides`` replaces fields of a rank's environment probe
(:class:`~rayload.loading.probe.EnvProbe`), e.g. ``{"1": {"fastsafetensors_version": null}}``
for a rank whose node lacks fastsafetensors: ranks that resolve differently, as on a
cluster of unlike nodes.

``peer_pause_s`` makes a rank, once it holds its shards, pause each send to a receiver
after the first bucket, e.g. ``{"0": 5}``, so a test can stop the holder mid-transfer;
``peer_bucket_bytes`` makes the loaded ranks pack their tensors into buckets of that many
bytes (several buckets from a small checkpoint); ``peer_link_mbps`` paces every rank's
sends to that many MB/s each, as links of that speed between machines would (the peer
benchmarks emulate a cluster's network on one host with it: label such figures so);
``prefault: false`` stops every rank from faulting in memory ahead of its writes (a
storage read's destinations and a peer receiver's; :mod:`rayload.loading.reader.pages`),
for the benchmarks that measure what it buys; ``peer_pack: true`` makes every rank's
channels pack each piece of several tensors into a buffer of its own (a copy on each
side), as they did before such runs crossed from and into the tensors' own memory
(:func:`~rayload.actors.channel.span`), for the benchmark that measures it.
``peer_stall_s`` shortens how long a receiving rank waits for its next piece before it
takes its holder as stalled (:data:`~rayload.actors.channel.STALL_S`), so a test can
freeze a holder for seconds.

Besides the load phases (``rank.resolve`` ... ``rank.post_load``), ``phase`` may be
``actor.init``: the fault then fires in the actor's ``__init__`` (a rank that never starts).

The variable is read in the driver, not in the actors, so it works for the CLI and the
Python API alike and no worker environment has to be prepared.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from rayload.errors import ConfigError
from rayload.loading.report import PLAN, PhaseTimer

HOOKS_ENV = "RAYLOAD_TEST_HOOKS"

INIT_PHASE = "actor.init"
"""The pseudo-phase of a fault that fires in the rank actor's ``__init__``."""


class FaultInjection(BaseModel):
    """One injected fault: ``action`` on ``rank`` when ``phase`` starts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    phase: str = PLAN
    action: Literal["raise", "exit", "ray_kill", "hang"] = "raise"
    seconds: float = 3600.0

    def trigger(self) -> None:
        if self.action == "raise":
            raise RuntimeError(f"injected fault in {self.phase} ({HOOKS_ENV})")
        if self.action == "exit":
            os._exit(1)
        if self.action == "ray_kill":
            import ray

            ray.kill(ray.get_runtime_context().current_actor)  # lands during the sleep
        time.sleep(self.seconds)


class TestHooks(BaseModel):
    """Everything ``RAYLOAD_TEST_HOOKS`` can ask for; the default asks for nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    __test__ = False  # not a pytest test class

    fault: FaultInjection | None = None
    clock_skew_ns: dict[int, int] = {}
    probe_overrides: dict[int, dict[str, Any]] = {}
    peer_pause_s: dict[int, float] = {}
    peer_bucket_bytes: int | None = None
    peer_link_mbps: float | None = None
    prefault: bool = True
    peer_pack: bool = False
    peer_stall_s: float | None = None

    @field_validator("probe_overrides")
    @classmethod
    def _known_probe_fields(cls, value: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        from dataclasses import fields

        from rayload.loading.probe import EnvProbe

        known = {f.name for f in fields(EnvProbe)}
        if unknown := sorted({k for fields_ in value.values() for k in fields_} - known):
            raise ValueError(f"EnvProbe has no field(s) {unknown}")
        return value

    def fault_for(self, rank: int) -> FaultInjection | None:
        return self.fault if self.fault is not None and self.fault.rank == rank else None


def hooks_from_env(environ: Mapping[str, str] = os.environ) -> TestHooks:
    """The hooks ``RAYLOAD_TEST_HOOKS`` asks for (none when it is unset or empty)."""
    raw = environ.get(HOOKS_ENV, "").strip()
    if not raw:
        return TestHooks()
    try:
        return TestHooks.model_validate(json.loads(raw))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ConfigError(f"{HOOKS_ENV} is not valid: {exc}") from exc


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
