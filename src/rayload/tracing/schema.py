"""Span and attribute names (fixed in docs/design.md "Spans"), and how values are cleaned.

Span tree::

    rayload.load                  driver, root; one per rayload.load(), from its first line
    ├── rayload.prepare           driver: arguments, config.json, headers, shard plan
    ├── rayload.connect           driver: ray.init (start a local Ray or join a cluster)
    │   ├── rayload.connect.address      finding the address and its TCP check
    │   ├── rayload.connect.gcs          (local Ray) GCS server started until it answered
    │   ├── rayload.connect.dashboard    (local Ray) monitor + dashboard processes
    │   │   └── .launch, .python, .head      launched, its Python start, its head modules
    │   ├── rayload.connect.raylet       (local Ray) raylet until registered with the GCS
    │   │   ├── .start, .agents, .register   its launch, its two agents, registering
    │   │   └── .agents.python, .agents.setup   the agents' Python start, then set-up
    │   └── rayload.connect.driver       this process joining as a driver
    │       └── .setup, .core_worker, .register   (local Ray, from Ray's driver log)
    ├── rayload.placement         driver: placement group created and ready
    ├── rayload.spawn             driver, one per rank: actor process launch to ready
    │   ├── rayload.spawn.worker_wait    spawn call until the worker process started
    │   ├── rayload.spawn.process_start  worker process start until rayload's first import
    │   ├── rayload.spawn.imports        the actor module's imports, one child per package
    │   │   └── rayload.spawn.import.<package>   torch, opentelemetry, rayload
    │   │       └── rayload.spawn.import.<module>   torch's direct child imports >= 1 ms (module)
    │   └── rayload.spawn.actor_init     Ray building the actor and its __init__
    │       └── rayload.spawn.cuda_context   CUDA context created (GPU ranks only)
    ├── rayload.clock_sync        driver, one per rank: the clock-offset round trips
    ├── rayload.peers             driver: replicas claimed in the peer directory, sources
    ├── rank.load                 rank process, one per rank
    │   ├── rank.process_group    joining the load's torch.distributed group (when asked)
    │   ├── rank.model.build      the model= factory's module built, before any read
    │   │                         (engine.<name> phases of the factory here too)
    │   ├── rank.resolve          ... one child per timed phase (loading.report.PHASES)
    │   ├── rank.plan
    │   ├── rank.destinations     where each shard is read into: the module's memory
    │   ├── rank.read
    │   ├── rank.to_device
    │   ├── rank.sync
    │   ├── rank.post_load
    │   └── rank.model.fill       within rank.post_load: the module filled from the shards
    └── engine.<name>             rank process: an engine phase after the load
                                  (state.phase(name) in LoadResult.apply)

Every attribute rayload sets is prefixed ``rayload.`` (``rayload.rank``,
``rayload.method.effective``, ...); resources carry ``service.name`` and ``host.name``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

from opentelemetry.util.types import AttributeValue

from rayload.loading.model import ENGINE_PREFIX, MODEL_BUILD_PHASE, MODEL_FILL_PHASE
from rayload.loading.report import PHASES

ROOT_SPAN = "rayload.load"
PREPARE_SPAN = "rayload.prepare"
CONNECT_SPAN = "rayload.connect"
CONNECT_ADDRESS_SPAN = "rayload.connect.address"
CONNECT_GCS_SPAN = "rayload.connect.gcs"
CONNECT_DASHBOARD_SPAN = "rayload.connect.dashboard"
CONNECT_DASHBOARD_LAUNCH_SPAN = "rayload.connect.dashboard.launch"
CONNECT_DASHBOARD_PYTHON_SPAN = "rayload.connect.dashboard.python"
CONNECT_DASHBOARD_HEAD_SPAN = "rayload.connect.dashboard.head"
CONNECT_RAYLET_SPAN = "rayload.connect.raylet"
CONNECT_RAYLET_START_SPAN = "rayload.connect.raylet.start"
CONNECT_RAYLET_AGENTS_SPAN = "rayload.connect.raylet.agents"
CONNECT_RAYLET_AGENTS_PYTHON_SPAN = "rayload.connect.raylet.agents.python"
CONNECT_RAYLET_AGENTS_SETUP_SPAN = "rayload.connect.raylet.agents.setup"
CONNECT_RAYLET_REGISTER_SPAN = "rayload.connect.raylet.register"
CONNECT_DRIVER_SPAN = "rayload.connect.driver"
CONNECT_DRIVER_SETUP_SPAN = "rayload.connect.driver.setup"
CONNECT_DRIVER_CORE_WORKER_SPAN = "rayload.connect.driver.core_worker"
CONNECT_DRIVER_REGISTER_SPAN = "rayload.connect.driver.register"
CONNECT_SPANS = (
    CONNECT_ADDRESS_SPAN,
    CONNECT_GCS_SPAN,
    CONNECT_DASHBOARD_SPAN,
    CONNECT_DASHBOARD_LAUNCH_SPAN,
    CONNECT_DASHBOARD_PYTHON_SPAN,
    CONNECT_DASHBOARD_HEAD_SPAN,
    CONNECT_RAYLET_SPAN,
    CONNECT_RAYLET_START_SPAN,
    CONNECT_RAYLET_AGENTS_SPAN,
    CONNECT_RAYLET_AGENTS_PYTHON_SPAN,
    CONNECT_RAYLET_AGENTS_SETUP_SPAN,
    CONNECT_RAYLET_REGISTER_SPAN,
    CONNECT_DRIVER_SPAN,
    CONNECT_DRIVER_SETUP_SPAN,
    CONNECT_DRIVER_CORE_WORKER_SPAN,
    CONNECT_DRIVER_REGISTER_SPAN,
)
"""The children of ``rayload.connect`` (what ``ray.init`` did; rayload.tracing.connect_spans)."""
PLACEMENT_SPAN = "rayload.placement"
SPAWN_SPAN = "rayload.spawn"
SPAWN_WORKER_WAIT_SPAN = "rayload.spawn.worker_wait"
SPAWN_PROCESS_START_SPAN = "rayload.spawn.process_start"
SPAWN_IMPORTS_SPAN = "rayload.spawn.imports"
SPAWN_IMPORT_PREFIX = "rayload.spawn.import."
SPAWN_ACTOR_INIT_SPAN = "rayload.spawn.actor_init"
SPAWN_CUDA_CONTEXT_SPAN = "rayload.spawn.cuda_context"
CLOCK_SYNC_SPAN = "rayload.clock_sync"
PEERS_SPAN = "rayload.peers"
"""Driver: the replicas claimed in the peer directory and each rank's source chosen."""
RELOAD_ROOT_SPAN = "rayload.reload"
ROOT_SPANS = (ROOT_SPAN, RELOAD_ROOT_SPAN)
"""A trace's root: ``rayload.load``, or ``rayload.reload`` for ``LoadResult.reload``."""
RANK_SPAN = "rank.load"
RANK_PHASES: tuple[str, ...] = PHASES
PROCESS_GROUP_SPAN = "rank.process_group"
MODEL_SPANS = (MODEL_BUILD_PHASE, MODEL_FILL_PHASE)
ENGINE_SPAN_PREFIX = ENGINE_PREFIX

DRIVER_SERVICE = "rayload"
RANK_SERVICE = "rayload-rank"
SCOPE_NAME = "rayload"

ATTR_PREFIX = "rayload."
RANK = "rayload.rank"
REPLICA = "rayload.replica"
"""Resource attribute of a rank's spans in a load of several replicas: which replica
(0..N-1); absent with one."""
TP_SIZE = "rayload.tp_size"
NODE_ID = "rayload.node_id"
DEVICE = "rayload.device"
METHOD_REQUESTED = "rayload.method.requested"
METHOD_SELECTED = "rayload.method.selected"
METHOD_EFFECTIVE = "rayload.method.effective"
FALLBACK_REASON = "rayload.fallback_reason"
PEER_SWITCH = "rayload.peer_switch"
BYTES = "rayload.bytes"
MODEL_ROLE = "rayload.model_role"
CLOCK_OFFSET_MS = "rayload.clock_offset_ms"
CLOCK_RTT_MS = "rayload.clock_rtt_ms"

_PRIMITIVES = (bool, str, int, float)
_EXCEPTION_TYPE = re.compile(r"^([A-Za-z_][\w.]*)\(")


def prefixed(key: str) -> str:
    """``key`` with the ``rayload.`` prefix, added only where it is missing."""
    return key if key.startswith(ATTR_PREFIX) else ATTR_PREFIX + key


def rayload_attributes(attributes: Mapping[str, Any] | None) -> dict[str, AttributeValue]:
    """Span attributes from a plain dict: keys prefixed ``rayload.``, values made valid.

    OpenTelemetry accepts only str, bool, int, float and homogeneous sequences of them.
    ``None`` means "not applicable" (e.g. no ``fallback_reason``) and is left out; enums
    become their value, paths and anything else their ``str``.
    """
    cleaned: dict[str, AttributeValue] = {}
    for key, value in (attributes or {}).items():
        if value is None:
            continue
        cleaned[prefixed(key)] = _attribute_value(value)
    return cleaned


def _attribute_value(value: Any) -> AttributeValue:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        items = [_attribute_value(v) for v in value]
        if items and all(type(v) is type(items[0]) for v in items):
            return items
        return [str(v) for v in items]
    return str(value)


def exception_attributes(error: str) -> dict[str, AttributeValue]:
    """Attributes of an ``exception`` span event (semantic conventions) from ``repr(exc)``.

    Ranks send failures as strings (exceptions do not always pickle across Ray), so the
    type is recovered from the ``TypeName(...)`` shape of ``repr`` when it has one.
    """
    match = _EXCEPTION_TYPE.match(error)
    return {
        "exception.type": match.group(1) if match else "Error",
        "exception.message": error,
    }
