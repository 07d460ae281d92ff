"""A ``torch.distributed`` process group across the rank actors of one load.

Ray-free, so the resolution is unit-tested and a rank can join a group in a plain process.
The driver asks every rank for its device and rank 0 for an address (:func:`rendezvous`),
resolves one backend for all (:func:`resolve_backend`) and sends a
:class:`ProcessGroupSpec` with the load; each rank joins (:func:`join_process_group`,
phase ``rank.process_group``) before it loads its shards, and leaves on ``close()``
(:func:`leave_process_group`).

Each rank actor is its own process, so the group is the process's *default* group and
two loads in one cluster get two independent groups.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rayload.errors import ConfigError
from rayload.loading.report import PhaseTimer
from rayload.options import PROCESS_GROUPS
from rayload.options import check_process_group as check_process_group  # checked there
from rayload.tracing.schema import PROCESS_GROUP_SPAN

log = logging.getLogger(__name__)

PROCESS_GROUP_CHOICES = PROCESS_GROUPS
"""What ``load(process_group=...)`` accepts, besides None (no group)."""

LOOPBACK = "127.0.0.1"
"""The rendezvous host when every rank runs on one node."""

MIN_INIT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class ProcessGroupSpec:
    """The group every rank of a load joins: ``backend`` (``gloo`` or ``nccl``), the
    rendezvous ``init_method`` (``tcp://host:port`` of rank 0), ``world_size`` (the TP
    size) and ``timeout_s``, bounded by what is left of the load's deadline."""

    backend: str
    init_method: str
    world_size: int
    timeout_s: float


def resolve_backend(requested: str, devices: Mapping[int, str]) -> str:
    """The backend of every rank: ``nccl`` when ``requested`` is ``nccl``, or ``auto`` and
    every rank's device (rank -> torch device string) is CUDA; ``gloo`` otherwise.
    ``nccl`` with a rank on the CPU is a :class:`ConfigError` naming that rank."""
    if requested not in PROCESS_GROUP_CHOICES:
        raise ConfigError(f"unknown process group backend {requested!r}")
    cpu_ranks = sorted(rank for rank, device in devices.items() if not device.startswith("cuda"))
    if requested == "gloo":
        return "gloo"
    if requested == "nccl" and cpu_ranks:
        rank = cpu_ranks[0]
        raise ConfigError(
            f"rank {rank}: process_group='nccl' needs a CUDA device but the rank's device is "
            f"{devices[rank]} (ranks on the CPU: {cpu_ranks}); use process_group='gloo' or "
            "'auto'"
        )
    return "gloo" if cpu_ranks else "nccl"


def rendezvous_host(node_ips: Mapping[int, str], node_ids: Mapping[int, str | None]) -> str:
    """Where the ranks meet: loopback when they all run on one node, else rank 0's IP."""
    if len(set(node_ids.values())) == 1 and None not in node_ids.values():
        return LOOPBACK
    return node_ips[0]


def free_port() -> int:
    """A TCP port free on every interface of this node a moment ago (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def init_method(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def join_process_group(spec: ProcessGroupSpec, *, rank: int, device: str, timer: PhaseTimer) -> Any:
    """Join the load's group as ``rank`` (phase ``rank.process_group``); returns the default
    group. A rank that does not arrive within ``spec.timeout_s`` makes this raise."""
    import torch
    import torch.distributed as dist

    with timer.phase(
        PROCESS_GROUP_SPAN,
        backend=spec.backend,
        world_size=spec.world_size,
        init_method=spec.init_method,
    ):
        device_id = None
        if spec.backend == "nccl":
            device_id = torch.device(device)
            torch.cuda.set_device(device_id)
        dist.init_process_group(
            backend=spec.backend,
            init_method=spec.init_method,
            world_size=spec.world_size,
            rank=rank,
            timeout=timedelta(seconds=max(spec.timeout_s, MIN_INIT_TIMEOUT_S)),
            device_id=device_id,
        )
        return dist.group.WORLD


def leave_process_group(timeout_s: float) -> bool:
    """Destroy this process's default group, waiting at most ``timeout_s`` (a peer that is
    gone can make it block); True when it was destroyed, False when there was none or it
    did not finish in time (the process is about to be killed anyway)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    finished = threading.Event()
    destroyed: list[bool] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
            destroyed.append(True)
        except (RuntimeError, ValueError) as exc:
            log.warning("destroying the process group failed: %s", exc)
        finally:
            finished.set()

    threading.Thread(target=destroy, name="rayload-destroy-pg", daemon=True).start()
    if not finished.wait(timeout_s):
        log.warning("the process group was not destroyed within %.1f s", timeout_s)
    return bool(destroyed)
