"""What travels between the driver and a rank actor: small frozen records, never tensors.

A rank that fails does not raise through Ray: its :class:`RankOutcome` carries a
:class:`RankError` plus the spans recorded up to the failure, so the driver can both raise a
clear error and still write the trace (with ``log_to_driver=False`` the actor's own log
would not reach the user).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rayload.actors.peers import PeerRef
from rayload.actors.process_group import ProcessGroupSpec
from rayload.errors import InputError
from rayload.loading.model import ModelFactory, no_phase
from rayload.loading.report import RankReport


@dataclass(frozen=True)
class LoadRequest:
    """What every rank of one replica is asked to load.

    ``replica`` is the replica's id (its entry in the peer directory), ``replica_index``
    its place in a load of several (None with one: the trace's lanes); ``peers[r]`` is
    where rank ``r`` gets its shards from (None, or no entry: storage), and
    ``peer_wait_s`` how long it may wait for a holder that is still loading;
    ``shared_copy`` makes each loaded rank keep a copy of its shards in its node's object
    store for receivers on that node. ``checkpoint`` is an ObjectRef of the driver's
    opened checkpoint when it is in object storage (:func:`rayload.driver.ship_checkpoint`;
    None for files, whose headers each node reads from its own copy): the ranks read no
    header or listing again, only their byte ranges, of the versions the driver planned
    from (``Checkpoint.versions``), so no two ranks load different versions.
    ``storage_deadline``:
    (seconds left of the load's timeout when the driver sent this, that timeout): the
    rank's storage requests end within it (:func:`~rayload.loading.storage.storage_deadline`),
    so an endpoint that stops answering is the rank's StorageError before the driver's
    wait ends, not a timed-out rank. Seconds, not a time: the nodes' clocks differ.
    """

    path: str
    tp_size: int
    method: str
    device: str
    traceparent: str
    strict: bool = False
    rules: Any = None
    model_role: str = "main"
    process_group: ProcessGroupSpec | None = None
    model: ModelFactory | None = None
    model_config: Mapping[str, Any] | None = None
    expert_parallel: bool = False
    replica: str = ""
    replica_index: int | None = None
    peers: tuple[PeerRef | None, ...] = ()
    peer_wait_s: float = 600.0
    shared_copy: bool = False
    checkpoint: Any = None
    storage_deadline: tuple[float, float] | None = None

    def until(self, deadline: float, timeout: float) -> LoadRequest:
        """This request with its ``storage_deadline`` set from the driver's ``deadline``
        (``time.monotonic()``) of a load of ``timeout`` seconds, as of now."""
        return replace(self, storage_deadline=(max(0.0, deadline - time.monotonic()), timeout))


@dataclass(frozen=True)
class ActorInfo:
    """A rank actor's identity, reported once it is ready.

    Times are the actor's wall clock (``time.time_ns``, plus any injected skew): the driver
    corrects them with the measured clock offset. ``process_start_ns`` is when the worker
    process was launched; Ray may reuse a pre-started worker, so it can precede the spawn.
    ``imports`` are ``(package, start_ns, end_ns)`` of the actor module's imports (see
    ``rank_actor.IMPORT_TIMES``); ``import_children`` are ``(package, module, start_ns,
    end_ns)`` of the modules a package's import imported directly (torch's: see
    ``rayload.import_clock.TORCH_CHILD_IMPORTS``); ``cuda_context`` is when ``__init__``
    created the CUDA context, None with the reason in ``cuda_skipped`` when it did not (no
    GPU).
    """

    rank: int
    node_id: str
    host_name: str
    pid: int
    gpu_ids: tuple[str, ...]
    cuda_visible_devices: str | None
    init_start_ns: int
    init_end_ns: int
    process_start_ns: int | None
    imports: tuple[tuple[str, int, int], ...] = ()
    import_children: tuple[tuple[str, str, int, int], ...] = ()
    cuda_context: tuple[int, int] | None = None
    cuda_skipped: str | None = None


@dataclass(frozen=True)
class RankSetup:
    """A rank's answer before the load, when the load has a process group: its resolved
    torch device and, from rank 0, where the group meets (node IP and a free port).
    ``error`` is set instead when the rank cannot resolve its device."""

    rank: int
    device: str | None = None
    node_ip: str | None = None
    port: int | None = None
    error: RankError | None = None


@dataclass(frozen=True)
class RankError:
    """Why a rank failed, in a form that survives pickling.

    ``input_error`` keeps a rayload :class:`InputError` (strict method fallback, a device
    the rank lacks, a checkpoint problem only the rank saw) so the driver re-raises it as
    bad input (exit 2) rather than as a failed rank.
    """

    type_name: str
    message: str
    traceback: str
    input_error: InputError | None = None

    @classmethod
    def from_exception(cls, exc: BaseException) -> RankError:
        return cls(
            type_name=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            input_error=exc if isinstance(exc, InputError) else None,
        )

    def describe(self) -> str:
        """``RuntimeError: disk on fire``: the cause as one line."""
        return f"{self.type_name}: {self.message}" if self.message else self.type_name


@dataclass(frozen=True)
class RankOutcome:
    """The result of one rank's ``load``: the report (None when it failed), the rank's
    spans as OTLP bytes (always, failed phases marked), and the error if any."""

    rank: int
    node_id: str
    spans: bytes
    start_ns: int
    end_ns: int
    report: RankReport | None = None
    error: RankError | None = None
    overwritten: tuple[str, ...] = ()
    """A reload: the tensors it had begun to write (every one when it succeeded; after a
    failure those may hold new bytes, the others keep the old ones). Empty for a load."""


@dataclass(frozen=True)
class RankState:
    """What a function passed to ``LoadResult.apply`` receives on each rank: the rank's
    resident tensors and where they live. ``tensors`` is the live dict, not a copy.

    ``replica`` is the rank's replica in a load of several (0 with one). ``model`` is the
    module the load's ``model=`` factory built and filled (None without
    one); ``process_group`` the load's ``torch.distributed`` group (None without one);
    ``with state.phase("warmup"):`` records the engine phase ``engine.warmup`` of this rank
    into the load's trace (see ``LoadResult.write_trace``).
    """

    rank: int
    tp_size: int
    device: str
    tensors: dict[str, Any]
    report: RankReport
    replica: int = 0
    model: Any = None
    process_group: Any = None
    phase: Callable[..., Any] = field(default=no_phase, repr=False, compare=False)


@dataclass(frozen=True)
class Applied:
    """What a rank's ``apply_traced`` returns: ``fn``'s ``value`` and the engine phases
    recorded since they were last sent, as OTLP bytes (None when there were none)."""

    value: Any
    spans: bytes | None = None


__all__ = [
    "ActorInfo",
    "Applied",
    "LoadRequest",
    "RankError",
    "RankOutcome",
    "RankSetup",
    "RankState",
]
