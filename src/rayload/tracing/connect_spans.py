"""What ``ray.init`` spent its time on: the children of ``rayload.connect``.

:func:`rayload.cluster.connect_recorded` records a :class:`ConnectRecord`: when the connect
began, when ``ray.init`` was called and returned, and, where that call started a local Ray,
what Ray observably did meanwhile (:func:`observe_local_start`): the create time of each
process it launched (``/proc/<pid>/stat``, 10 ms) and the moments two of Ray's own logs
stamp (milliseconds). Ray starts a local node strictly in this order
(``ray._private.node.Node``), so the events cut ``ray.init`` into consecutive spans::

    connect ─ address ─ ray.init called ─ gcs ─ monitor created ─ dashboard ─ log monitor
      created ─ raylet ─ raylet registered ─ driver ─ ray.init returned = end of connect

    rayload.connect.address     finding the address (argument, RAY_ADDRESS, the file
                                ``ray start`` records) and the TCP check of it
    rayload.connect.gcs         session directory and the GCS server, until it answered
                                (Ray starts the autoscaler monitor next)
    rayload.connect.dashboard   the monitor and the dashboard (API server) processes, until
                                the dashboard published its address in the GCS, of which
      rayload.connect.dashboard.launch  Ray launching the monitor, then the dashboard
      rayload.connect.dashboard.python  the dashboard's interpreter start and imports,
                                        until the first line of its log
      rayload.connect.dashboard.head    its head modules, until Ray saw it up
    rayload.connect.raylet      the log monitor and the raylet, until the raylet registered
                                with the GCS (its log: "Raylet ... started"), of which
      rayload.connect.raylet.start    raylet process start until it launched its agents
      rayload.connect.raylet.agents   the dashboard and runtime-env agents (Python
                                      processes, side by side) until both wrote their
                                      ports, of which
        rayload.connect.raylet.agents.python  their interpreters' start and imports,
                                              until the later one's first log line
        rayload.connect.raylet.agents.setup   that agent's set-up until its port
      rayload.connect.raylet.register the raylet finishing its set-up and registering
    rayload.connect.driver      this process joining as a driver, of which
      rayload.connect.driver.setup        Ray's Python side until its core worker began
      rayload.connect.driver.core_worker  the core worker's construction (its log: from
                                          "Constructing CoreWorkerProcess" to "driver
                                          server started"); the raylet starts its idle
                                          workers meanwhile, which compete for the cores
      rayload.connect.driver.register     job registration until ``ray.init`` returned

Joining a running cluster gives ``address`` and ``driver`` only. An event that was not
observed (a process Ray did not start, a log line not found, a time outside ``ray.init``)
merges its two neighbours into the later one's span, so every span's name stays true of
what it covers; boundaries are clamped into ``ray.init`` and kept in order, and empty
spans are left out.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from rayload.tracing import schema
from rayload.tracing.spawn_spans import SpawnPhase

GCS_CREATED = "gcs_created"
MONITOR_CREATED = "monitor_created"
DASHBOARD_CREATED = "dashboard_created"
DASHBOARD_LOGGED = "dashboard_logged"
LOG_MONITOR_CREATED = "log_monitor_created"
RAYLET_CREATED = "raylet_created"
AGENTS_CREATED = "agents_created"
AGENTS_LOGGED = "agents_logged"
AGENTS_READY = "agents_ready"
RAYLET_REGISTERED = "raylet_registered"
CORE_WORKER_STARTED = "core_worker_started"
CORE_WORKER_BUILT = "core_worker_built"
EVENTS = (
    GCS_CREATED,
    MONITOR_CREATED,
    DASHBOARD_CREATED,
    DASHBOARD_LOGGED,
    LOG_MONITOR_CREATED,
    RAYLET_CREATED,
    AGENTS_CREATED,
    AGENTS_LOGGED,
    AGENTS_READY,
    RAYLET_REGISTERED,
    CORE_WORKER_STARTED,
    CORE_WORKER_BUILT,
)
"""What :func:`observe_local_start` looks for, in the order Ray does it."""

_LOG_TIME = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\s")
_AGENT_PORT_FILES = {
    "dashboard_agent_listen_port_": "dashboard_agent.log",
    "runtime_env_agent_port_": "runtime_env_agent.log",
}
"""Each agent's port file (written once it is up) and its log."""
_TOLERANCE_NS = 50_000_000
"""How far outside ``ray.init`` an observed time may lie and still count (log stamps are
whole milliseconds, create times 10 ms ticks); further out it is not trusted."""


@dataclass(frozen=True)
class ConnectRecord:
    """What :func:`rayload.cluster.connect_recorded` saw, on this process's wall clock (ns).

    ``init_start_ns`` / ``init_end_ns``: around ``ray.init``; None when no ``ray.init``
    ran (a Ray already initialized in this process). ``events``: from
    :func:`observe_local_start` when ``ray.init`` started a local Ray (names in
    :data:`EVENTS`), empty when it joined a cluster. ``attributes`` go on the span."""

    start_ns: int
    end_ns: int
    started_ray: bool
    init_start_ns: int | None = None
    init_end_ns: int | None = None
    events: Mapping[str, int] = field(default_factory=dict)
    attributes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Step:
    """A span of ``ray.init`` that ends at ``until`` (an event; None: where its parent
    ends), cut into ``steps`` where their events were observed inside it."""

    name: str
    until: str | None
    steps: tuple[_Step, ...] = ()


_LOCAL_START = (
    _Step(schema.CONNECT_GCS_SPAN, MONITOR_CREATED),
    _Step(
        schema.CONNECT_DASHBOARD_SPAN,
        LOG_MONITOR_CREATED,
        (
            _Step(schema.CONNECT_DASHBOARD_LAUNCH_SPAN, DASHBOARD_CREATED),
            _Step(schema.CONNECT_DASHBOARD_PYTHON_SPAN, DASHBOARD_LOGGED),
            _Step(schema.CONNECT_DASHBOARD_HEAD_SPAN, None),
        ),
    ),
    _Step(
        schema.CONNECT_RAYLET_SPAN,
        RAYLET_REGISTERED,
        (
            _Step(schema.CONNECT_RAYLET_START_SPAN, AGENTS_CREATED),
            _Step(
                schema.CONNECT_RAYLET_AGENTS_SPAN,
                AGENTS_READY,
                (
                    _Step(schema.CONNECT_RAYLET_AGENTS_PYTHON_SPAN, AGENTS_LOGGED),
                    _Step(schema.CONNECT_RAYLET_AGENTS_SETUP_SPAN, None),
                ),
            ),
            _Step(schema.CONNECT_RAYLET_REGISTER_SPAN, None),
        ),
    ),
    _Step(
        schema.CONNECT_DRIVER_SPAN,
        None,
        (
            _Step(schema.CONNECT_DRIVER_SETUP_SPAN, CORE_WORKER_STARTED),
            _Step(schema.CONNECT_DRIVER_CORE_WORKER_SPAN, CORE_WORKER_BUILT),
            _Step(schema.CONNECT_DRIVER_REGISTER_SPAN, None),
        ),
    ),
)
"""How a local Ray's start is cut (module docstring), in the order Ray does it."""


def connect_phases(record: ConnectRecord) -> tuple[SpawnPhase, ...]:
    """The children of ``rayload.connect`` (module docstring): contiguous, in order, and
    covering the connect from its start to the end of ``ray.init``."""
    if record.init_start_ns is None or record.init_end_ns is None:
        return ()
    start, end = record.init_start_ns, max(record.init_end_ns, record.init_start_ns)
    address = SpawnPhase(schema.CONNECT_ADDRESS_SPAN, record.start_ns, start)
    events = _trusted(record.events, start, end)
    if not events:
        driver = SpawnPhase(schema.CONNECT_DRIVER_SPAN, start, end, {"cluster": "joined"})
        return _kept([address, driver])
    return _kept([address, *_cut(start, end, _LOCAL_START, events, top=True)])


def _cut(
    start: int, end: int, steps: Sequence[_Step], events: Mapping[str, int], *, top: bool
) -> tuple[SpawnPhase, ...]:
    """``steps`` as consecutive spans from ``start`` to ``end``. At the top a step whose
    event was not observed is merged into the next one; below it, a span gets children
    only when every one of their events was observed in order inside it (otherwise it
    stays one span: a merged child would be named for less than it covers)."""
    ends = [end if step.until is None else events.get(step.until) for step in steps]
    if not top:
        cuts = [t for t in ends[:-1] if t is not None]
        if len(cuts) < len(ends) - 1 or cuts != sorted(cuts):
            return ()
        if not all(start <= t <= end for t in cuts):
            return ()
    phases, cursor = [], start
    for step, stop in zip(steps, ends, strict=True):
        if stop is None or not cursor <= stop <= end:
            continue  # not observed, or out of Ray's order: merged into the next step
        children = _cut(cursor, stop, step.steps, events, top=False) if step.steps else ()
        phases.append(SpawnPhase(step.name, cursor, stop, children=children))
        cursor = stop
    kept = _kept(phases)
    return kept if top or len(kept) > 1 else ()


def _trusted(events: Mapping[str, int], start: int, end: int) -> dict[str, int]:
    """The events inside ``ray.init`` (give or take :data:`_TOLERANCE_NS`), clamped into
    it; further out they are not trusted (a clock or time-zone mismatch, a stale log)."""
    return {
        name: min(max(t, start), end)
        for name, t in events.items()
        if start - _TOLERANCE_NS <= t <= end + _TOLERANCE_NS
    }


def _kept(phases: Sequence[SpawnPhase]) -> tuple[SpawnPhase, ...]:
    return tuple(p for p in phases if p.end_ns > p.start_ns)


def observe_local_start(
    pids: Mapping[str, Sequence[int]], session_dir: str | os.PathLike[str], driver_pid: int
) -> dict[str, int]:
    """What a local Ray's start observably did (names in :data:`EVENTS`, wall clock ns).

    ``pids``: Ray's process type (``gcs_server``, ``monitor``, ``dashboard``,
    ``log_monitor``, ``raylet``) to the pids it started (``Node.all_processes``); the
    agents are the raylet's children. ``session_dir``: the session's directory (port
    files, ``logs/``). Anything that cannot be read is left out."""
    events: dict[str, int] = {}
    for event, kind in (
        (GCS_CREATED, "gcs_server"),
        (MONITOR_CREATED, "monitor"),
        (DASHBOARD_CREATED, "dashboard"),
        (LOG_MONITOR_CREATED, "log_monitor"),
        (RAYLET_CREATED, "raylet"),
    ):
        created = [t for pid in pids.get(kind, ()) if (t := process_created_ns(pid)) is not None]
        if created:
            events[event] = min(created)
    session = Path(session_dir)
    raylets = pids.get("raylet", ())
    agents = [
        t
        for raylet in raylets
        for pid in _children(raylet)
        if _is_agent(pid) and (t := process_created_ns(pid)) is not None
    ]
    if agents:
        events[AGENTS_CREATED] = min(agents)
    logs = session / "logs"
    ready = {
        log: t
        for prefix, log in _AGENT_PORT_FILES.items()
        for path in session.glob(prefix + "*")
        if (t := _mtime_ns(path)) is not None
    }
    if len(ready) == len(_AGENT_PORT_FILES):
        last = max(ready, key=lambda log: ready[log])
        events[AGENTS_READY] = ready[last]
        logged = log_time_ns(logs / last, "")
        if logged is not None:
            events[AGENTS_LOGGED] = logged
    dashboard_logged = log_time_ns(logs / "dashboard.log", "")
    if dashboard_logged is not None:
        events[DASHBOARD_LOGGED] = dashboard_logged
    registered = log_time_ns(logs / "raylet.out", "Raylet of id")
    if registered is not None:
        events[RAYLET_REGISTERED] = registered
    for driver_log in logs.glob(f"python-core-driver-*_{driver_pid}.log"):
        started = log_time_ns(driver_log, "Constructing CoreWorkerProcess")
        built = log_time_ns(driver_log, "driver server started")
        if started is not None:
            events[CORE_WORKER_STARTED] = started
        if built is not None:
            events[CORE_WORKER_BUILT] = built
    return events


def process_created_ns(pid: int) -> int | None:
    """When process ``pid`` was created, on the wall clock, in ns (None where unknown):
    its start in clock ticks since boot (``/proc/<pid>/stat``, field 22) against
    ``CLOCK_BOOTTIME`` now, as ``process_start_ns`` does for a rank's own process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])
        since_boot_s = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time_ns() - int(since_boot_s * 1e9)


def log_time_ns(path: str | os.PathLike[str], marker: str) -> int | None:
    """The time stamped on the first line of Ray's log ``path`` containing ``marker``
    (``[YYYY-MM-DD HH:MM:SS,mmm ...``, this machine's local time), ns; None if absent."""
    try:
        with open(path, encoding="utf-8", errors="replace") as log:
            for line in log:
                if marker in line:
                    match = _LOG_TIME.match(line)
                    if match is None:
                        return None
                    stamp = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f")
                    return int(stamp.timestamp() * 1e9)
    except OSError:
        return None
    return None


def _mtime_ns(path: Path) -> int | None:
    """When ``path`` was last written (Ray writes each port file once)."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        return []


def _is_agent(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    argv = cmdline.split(b"\0")
    return b"Agent" in argv[0] or any(a.endswith((b"/agent.py", b"/agent/main.py")) for a in argv)


class _Trace(Protocol):
    def add_span(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
        error: str | None = None,
        *,
        parent: Any = None,
    ) -> Any: ...


def add_connect_spans(trace: _Trace, record: ConnectRecord) -> Any:
    """Record ``rayload.connect`` (``ray.started`` and ``record.attributes`` on it) and its
    children (:func:`connect_phases`) on ``trace``; returns the connect span."""
    attributes = {"ray.started": record.started_ray, **record.attributes}
    span = trace.add_span(schema.CONNECT_SPAN, record.start_ns, record.end_ns, attributes)
    record_phases(trace, span, connect_phases(record))
    return span


def record_phases(trace: _Trace, parent: Any, phases: Sequence[SpawnPhase]) -> None:
    """Each phase as a span under ``parent``, its children under it, recursively."""
    for phase in phases:
        span = trace.add_span(
            phase.name, phase.start_ns, phase.end_ns, phase.attributes, parent=parent
        )
        record_phases(trace, span, phase.children)
