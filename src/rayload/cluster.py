"""The Ray cluster a load runs on: find its address, check it answers before joining it, and
watch its head (the GCS) while the driver waits, so a dead cluster is an error in seconds.

Ray itself retries a dead address for minutes and, once joined, waits 60 s
(``gcs_rpc_server_reconnect_timeout_s``) for a lost head before its core terminates the
driver with dumps on stderr; a GCS call made meanwhile (removing a placement group) spins a
core for that whole minute. rayload never lets it get there:

* :func:`find_address` says where the address comes from, as Ray would find it: ``address=``
  / ``--address``, else ``RAY_ADDRESS``, else the file ``ray start`` records,
  ``<ray temp dir>/ray_current_cluster`` (``RAY_TMPDIR`` or ``/tmp``, then ``ray``);
* :func:`check_reachable` opens a TCP connection to that ``host:port`` first: nobody there is
  a :class:`~rayload.errors.ConfigError` naming the address, its source and what to do;
* :func:`wait` is ``ray.wait`` in slices of :data:`PROBE_INTERVAL_S`, probing the GCS port
  between slices (one connect, no Ray call: the driver sleeps in ``ray.wait``, it does not
  spin); :data:`LOST_AFTER` failed probes in a row raise
  :class:`~rayload.errors.ClusterLostError` naming the phase, the cause and Ray's log
  directory, and :func:`head_lost` then tells the caller to skip the GCS calls of cleanup;
* :class:`HeadWatch` is the backstop for the calls that block in Ray's core while the head
  is gone (creating a placement group or an actor, reading the group's nodes): a daemon
  thread probing the head; when it is lost and the load is still stuck :data:`GRACE_S`
  later, the watch writes the failed trace and calls the handlers of :func:`on_stuck` (the
  CLI prints its one line and exits 1), else it logs the error.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rayload.errors import ClusterLostError, ConfigError
from rayload.tracing.connect_spans import ConnectRecord, observe_local_start

CONNECT_TIMEOUT_S = 5.0
"""At most this long to open a TCP connection to the cluster's address before ``ray.init``."""

PROBE_INTERVAL_S = 1.0
"""How often :func:`wait` probes the head's GCS port while it waits."""

PROBE_TIMEOUT_S = 1.0
LOST_AFTER = 2
"""Failed probes in a row that mean the head is lost (a refused connection fails at once,
so a lost head is noticed within about ``LOST_AFTER * PROBE_INTERVAL_S`` seconds)."""

GRACE_S = 3.0
"""After the watch finds the head lost, how long the load may take to notice it itself."""

log = logging.getLogger(__name__)

_ADDRESS_FILE_NAME = "ray_current_cluster"
_HOST_PORT = re.compile(r"(?:ray://)?\[?([\w.\-:]+?)\]?:(\d+)")
_lost: set[str] = set()


@dataclass(frozen=True)
class ClusterAddress:
    """An address to give ``ray.init`` and where it came from.

    ``address`` None means no cluster was named: ``ray.init`` starts a local Ray. ``source``
    is ``"--address"``, ``"RAY_ADDRESS"``, ``"file"`` (``file`` names it) or ``"none"``.
    """

    address: str | None
    source: str
    file: str | None = None

    def describe(self) -> str:
        """Where the address came from, for messages."""
        if self.source == "file":
            return f"recorded by `ray start` in {self.file}"
        if self.source == "RAY_ADDRESS":
            return "from RAY_ADDRESS"
        return "from --address / address="

    def remedy(self, port: str) -> str:
        """What to do when nothing answers at the address."""
        start = f"start it with `ray start --head --port {port}`"
        fresh = "or pass --address local (address='local') for a fresh local Ray"
        if self.source == "file":
            return f"that cluster is gone: remove the stale file ({self.file}), {start}, {fresh}"
        if self.source == "RAY_ADDRESS":
            return f"{start}, fix or unset RAY_ADDRESS, {fresh}"
        return f"{start}, pass the right --address, {fresh}"


def address_file() -> str:
    """``<ray temp dir>/ray_current_cluster``, where ``ray start`` records its address."""
    system_temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(system_temp, "ray", _ADDRESS_FILE_NAME)


def find_address(address: str | None) -> ClusterAddress:
    """The address ``ray.init(address=address)`` would join, and its source (Ray's order:
    the argument, ``RAY_ADDRESS``, the recorded cluster file, else a new local Ray)."""
    if address not in (None, "auto"):
        return ClusterAddress(address, "--address")
    from_env = os.environ.get("RAY_ADDRESS")
    if from_env:
        return ClusterAddress(from_env, "RAY_ADDRESS")
    path = address_file()
    try:
        with open(path, encoding="utf-8") as f:
            recorded = f.read().strip()
    except OSError:
        recorded = ""
    if recorded:
        return ClusterAddress(recorded, "file", file=path)
    return ClusterAddress(address, "none")


def check_reachable(found: ClusterAddress, *, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail in seconds, not minutes, when nothing listens at a ``host:port`` address.
    Addresses without a port (``local``, ``auto``, None) pass."""
    match = _HOST_PORT.fullmatch(found.address or "")
    if match is None:
        return
    host, port = match[1], match[2]
    try:
        socket.create_connection((host, int(port)), timeout=max(timeout_s, 0.1)).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise ConfigError(
            f"cannot reach a Ray cluster at {found.address} ({found.describe()}): {reason}; "
            f"{found.remedy(port)}"
        ) from exc


def connect(address: str | None, *, deadline: float) -> bool:
    """Join the cluster at ``address`` (see :func:`find_address`) or start a local Ray,
    after checking it answers; True when this call ran ``ray.init``. A Ray already
    initialized in this process is used as is. ``deadline`` (``time.monotonic()``) bounds
    the reachability check."""
    return connect_recorded(address, deadline=deadline).started_ray


def connect_recorded(address: str | None, *, deadline: float) -> ConnectRecord:
    """:func:`connect`, recording what it did for the children of ``rayload.connect``
    (:func:`rayload.tracing.connect_spans.add_connect_spans`): when ``ray.init`` was
    called and returned, and, where it started a local Ray, what that Ray's start
    observably did (:func:`~rayload.tracing.connect_spans.observe_local_start`)."""
    start_ns = time.time_ns()
    if ray.is_initialized():
        return ConnectRecord(start_ns, time.time_ns(), started_ray=False)
    found = find_address(address)
    check_reachable(found, timeout_s=min(CONNECT_TIMEOUT_S, deadline - time.monotonic()))
    init_start_ns = time.time_ns()
    try:
        ray.init(
            address=found.address,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    except (ConnectionError, ValueError) as exc:
        raise ConfigError(
            f"cannot connect to Ray at {found.address!r} ({found.describe()}): {exc}"
        ) from exc
    init_end_ns = time.time_ns()
    events = _observe_local_start()
    return ConnectRecord(
        start_ns,
        time.time_ns(),
        started_ray=True,
        init_start_ns=init_start_ns,
        init_end_ns=init_end_ns,
        events=events,
        attributes={"ray.address_source": found.source, "ray.local_start": bool(events)},
    )


def _observe_local_start() -> dict[str, int]:
    """What the local Ray this process just started did (empty: it joined a cluster)."""
    node = getattr(ray._private.worker, "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}
    if node is None or "raylet" not in processes:
        return {}
    pids = {
        kind: [info.process.pid for info in infos if getattr(info, "process", None)]
        for kind, infos in processes.items()
    }
    try:
        session_dir = node.get_session_dir_path()
    except AttributeError:
        return {}
    try:
        return observe_local_start(pids, session_dir, os.getpid())
    except (OSError, ValueError) as exc:  # telemetry never fails a load
        log.debug("could not read what the local Ray's start did: %s", exc)
        return {}


def gcs_address() -> str | None:
    """The connected cluster's GCS ``host:port`` (None: not connected, or Ray Client)."""
    worker = ray._private.worker.global_worker
    node = getattr(worker, "node", None)
    return getattr(node, "gcs_address", None) if node is not None else None


def log_dir() -> str | None:
    """Ray's log directory for this driver's session, when Ray knows it."""
    node = getattr(ray._private.worker.global_worker, "node", None)
    try:
        return str(node.get_logs_dir_path()) if node is not None else None
    except (AttributeError, OSError):
        return None


def head_lost() -> bool:
    """True once :func:`wait` found the connected cluster's head gone: cleanup must then
    skip GCS calls (removing a placement group, ``ray.shutdown``), which would hang."""
    address = gcs_address()
    return address is not None and address in _lost


class _HeadProbe:
    """Counts failed TCP connects to the GCS port; raises once :data:`LOST_AFTER` in a row."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.address = gcs_address()
        self.failures = 0

    def check(self) -> None:
        match = _HOST_PORT.fullmatch(self.address or "")
        if match is None:
            return
        assert self.address is not None
        try:
            socket.create_connection((match[1], int(match[2])), timeout=PROBE_TIMEOUT_S).close()
        except OSError as exc:
            self.failures += 1
            if self.failures >= LOST_AFTER:
                _lost.add(self.address)
                raise _lost_error(self.address, self.phase, exc.strerror or str(exc)) from exc
            return
        self.failures = 0


def _lost_error(address: str, phase: str, reason: str) -> ClusterLostError:
    """The error for a head that stopped answering while the driver was ``phase``."""
    logs = log_dir()
    where = f"; Ray's logs: {logs}" if logs else ""
    return ClusterLostError(
        f"the Ray cluster's head (GCS at {address}) stopped answering while {phase}: "
        f"{reason}; the load is abandoned (restart the cluster, then load again){where}",
        phase=phase,
        address=address,
        log_dir=logs,
    )


def wait(
    refs: Sequence[Any], *, num_returns: int = 1, timeout: float, phase: str
) -> tuple[list[Any], list[Any]]:
    """``ray.wait(refs, num_returns=..., timeout=...)``, checking the head is alive every
    :data:`PROBE_INTERVAL_S`; raises :class:`ClusterLostError` when it is not."""
    probe = _HeadProbe(phase)
    end = time.monotonic() + max(timeout, 0.0)
    while True:
        remaining = end - time.monotonic()
        ready, pending = ray.wait(
            list(refs), num_returns=num_returns, timeout=max(min(remaining, PROBE_INTERVAL_S), 0)
        )
        if len(ready) >= num_returns or remaining <= PROBE_INTERVAL_S:
            return ready, pending
        probe.check()


def check_head(phase: str) -> None:
    """Raise :class:`ClusterLostError` now if the head does not answer (two probes)."""
    probe = _HeadProbe(phase)
    for _ in range(LOST_AFTER):
        probe.check()
        if probe.failures == 0:
            return
        time.sleep(PROBE_INTERVAL_S / 2)


_stuck_handlers: list[Callable[[ClusterLostError], None]] = []


def on_stuck(handler: Callable[[ClusterLostError], None]) -> None:
    """Call ``handler(error)`` from :class:`HeadWatch`'s thread when a load is stuck in a Ray
    call on a lost head (Ray would terminate the process a minute later). The CLI's handler
    prints the error and exits; a library caller may register its own."""
    _stuck_handlers.append(handler)


class HeadWatch:
    """A daemon thread that probes the head every :data:`PROBE_INTERVAL_S` during a load.

    ``phase`` is what the load is doing (set by the caller between steps, named in the
    error); ``last_words(error)`` records the failure (the trace) before the handlers run.
    :meth:`stop` ends the watch; it returns False when the watch already took over.
    """

    def __init__(self, last_words: Callable[[ClusterLostError], object]) -> None:
        self.phase = "connecting"
        self._last_words = last_words
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._claimed = False
        self._thread = threading.Thread(target=self._run, name="rayload-head-watch", daemon=True)

    def start(self) -> HeadWatch:
        """Start probing (not under Ray Client, where the head is not ours to probe)."""
        if gcs_address() is not None:
            self._thread.start()
        return self

    def stop(self) -> bool:
        with self._lock:
            claimed, self._claimed = self._claimed, True
        self._done.set()
        return not claimed

    def _run(self) -> None:
        probe = _HeadProbe(self.phase)
        while not self._done.wait(PROBE_INTERVAL_S):
            probe.phase = self.phase
            try:
                probe.check()
            except ClusterLostError as error:
                if self._done.wait(GRACE_S):
                    return
                self._take_over(error)
                return

    def _take_over(self, error: ClusterLostError) -> None:
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        try:
            self._last_words(error)
        except Exception:
            log.exception("could not write the trace of the failed load")
        if not _stuck_handlers:
            log.error("%s (Ray's core will end this process within a minute)", error)
        for handler in _stuck_handlers:
            handler(error)
