"""The rank actor: one per TP rank, holding that rank's weights resident.

Thin on purpose: it owns state (the tensors, its clock, its identity) and delegates the
work to :func:`rayload.loading.load_rank` and :mod:`rayload.tracing`. Its methods return
small records, never tensors, except :meth:`RankActor.shard`, which a caller asks for
explicitly.

The class is plain Python; the driver wraps it with ``ray.remote`` and the resources of the
rank's bundle (see :mod:`rayload.actors.rank_group`).

Past 400 lines on purpose: a Ray actor is one class, and each of its methods is one thing a
driver asks of a rank (setup, load, reload, peers, apply, shutdown); what they call lives in
``loading/``, ``tracing/`` and ``actors/peers.py``. The timed imports below (each group
stamped for the spawn spans) must also stay in the module Ray's worker imports first.
"""

# ruff: noqa: E402  (the imports are timed: each group is stamped before and after)
from __future__ import annotations

import time

_ACTOR_MODULE_START_NS = time.time_ns()

import opentelemetry.sdk.trace
from opentelemetry.exporter.otlp.proto.common import trace_encoder

_OPENTELEMETRY_IMPORTED_NS = time.time_ns()

import logging
import os
import socket
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import ray
import torch

from rayload.actors import channel
from rayload.actors.channel import STALL_S
from rayload.actors.device import LOCAL_CUDA_DEVICE, rank_device
from rayload.actors.hooks import INIT_PHASE, FaultInjection, FaultyTimer
from rayload.actors.messages import (
    ActorInfo,
    Applied,
    LoadRequest,
    RankError,
    RankOutcome,
    RankSetup,
    RankState,
)
from rayload.actors.peer_receiver import RayPeerSource
from rayload.actors.peers import PEER_GROUP, PING_GROUP, PeerChannel, ShardServer, SharedCopy
from rayload.actors.process_group import free_port, join_process_group, leave_process_group
from rayload.import_clock import IMPORT_START_NS, TORCH_CHILD_IMPORTS, TORCH_IMPORTED_NS
from rayload.loading import load_rank
from rayload.loading.checkpoint import Checkpoint
from rayload.loading.model import (
    ModelContext,
    build_module,
    engine_phases,
    fill_module,
    model_destinations,
)
from rayload.loading.probe import EnvProbe, probe_environment, read_chars
from rayload.loading.rank import PostLoad, reload_rank
from rayload.loading.reader import pages
from rayload.loading.report import PhaseTimer, RankReport
from rayload.loading.storage import storage_deadline
from rayload.tracing.rank_spans import engine_spans_payload, rank_spans_payload, report_attributes

_IMPORTS_END_NS = time.time_ns()

IMPORT_TIMES: tuple[tuple[str, int, int], ...] = (
    ("torch", IMPORT_START_NS, TORCH_IMPORTED_NS),
    ("rayload", TORCH_IMPORTED_NS, _ACTOR_MODULE_START_NS),
    ("opentelemetry", _ACTOR_MODULE_START_NS, _OPENTELEMETRY_IMPORTED_NS),
    ("rayload.actors", _OPENTELEMETRY_IMPORTED_NS, _IMPORTS_END_NS),
)
"""``(package, start_ns, end_ns)`` of the imports that made this module, on this process's
wall clock, in order.

In a rank's worker, importing this module (Ray does, to build the actor) is what imports
rayload: ``import rayload`` first times torch on its own, then the rest of the package
(``rayload.loading``: numpy, safetensors headers, pydantic); this module then imports
OpenTelemetry (the rank's spans) and the actor's own modules. The driver turns them into
the ``rayload.spawn.import.<package>`` spans."""

IMPORT_CHILDREN: tuple[tuple[str, str, int, int], ...] = tuple(
    ("torch", module, a, b) for module, a, b in TORCH_CHILD_IMPORTS
)
"""``(package, module, start_ns, end_ns)`` of the modules torch's import imported directly
(see :data:`rayload.import_clock.TORCH_CHILD_IMPORTS`): the children of
``rayload.spawn.import.torch``."""

del opentelemetry, trace_encoder  # imported above only to time them

log = logging.getLogger(__name__)


class RankActor:
    """Rank ``rank``'s actor.

    ``clock_skew_ns``, ``fault``, ``probe_overrides``, ``peer_pause_s``,
    ``peer_bucket_bytes``, ``peer_link_mbps``, ``prefault``, ``peer_stall_s`` and
    ``peer_pack`` are TEST HOOKS: the
    first shifts every time the actor reports (phases, spans, :meth:`clock`) to model
    another node's clock;
    the second makes this rank fail on purpose; the third changes what this rank's
    environment probe reports; the fourth pauses this rank's sending to a receiver after
    its first piece; the fifth sets the size of those pieces; the sixth paces its sends
    as a link of that speed; the seventh, False, stops this rank from faulting in its new
    memory ahead of the bytes (:mod:`rayload.loading.reader.pages`); the eighth shortens
    how long this rank, receiving, waits for a piece before it takes its holder as
    stalled; the ninth packs each piece of several tensors into a buffer of its own, as
    before they crossed in place (see :mod:`rayload.actors.hooks`).

    Once loaded, the rank is a *holder* for other replicas: :meth:`open_channel` and
    :meth:`shared_copy` run in the actor's ``peer`` concurrency group, :meth:`peer_ping`
    in a group of its own (it answers however many channel calls wait), so they answer
    while the main thread loads or runs engine code (:mod:`rayload.actors.peers`).
    """

    def __init__(
        self,
        rank: int,
        *,
        clock_skew_ns: int = 0,
        fault: FaultInjection | None = None,
        probe_overrides: dict[str, Any] | None = None,
        peer_pause_s: float = 0.0,
        peer_bucket_bytes: int | None = None,
        peer_link_mbps: float | None = None,
        prefault: bool = True,
        peer_stall_s: float | None = None,
        peer_pack: bool = False,
    ) -> None:
        pages.enabled = prefault
        channel.in_place = not peer_pack
        self._stall_s = peer_stall_s or STALL_S
        self._skew_ns = clock_skew_ns
        self._shards = ShardServer(
            pause_s=peer_pause_s, bucket_bytes=peer_bucket_bytes, link_mbps=peer_link_mbps
        )
        self._replica = ""
        self._probe_overrides = probe_overrides
        init_start_ns = self.clock()
        if fault is not None and fault.phase == INIT_PHASE:
            fault.trigger()
        self._rank = rank
        self._fault = fault
        self._tensors: dict[str, Any] = {}
        self._report: RankReport | None = None
        self._request: LoadRequest | None = None
        self._model: Any = None
        self._process_group: Any = None
        self._engine_timer = PhaseTimer(clock=self.clock)
        self._host_name = socket.gethostname()
        context = ray.get_runtime_context()
        self._node_id = context.get_node_id()
        gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        cuda_context, cuda_skipped = self._create_cuda_context(gpu_ids)
        self._info = ActorInfo(
            rank=rank,
            node_id=self._node_id,
            host_name=self._host_name,
            pid=os.getpid(),
            gpu_ids=gpu_ids,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            init_start_ns=init_start_ns,
            init_end_ns=self.clock(),
            process_start_ns=self._process_start_ns(),
            imports=tuple(
                (name, a + self._skew_ns, b + self._skew_ns) for name, a, b in IMPORT_TIMES
            ),
            import_children=tuple(
                (package, module, a + self._skew_ns, b + self._skew_ns)
                for package, module, a, b in IMPORT_CHILDREN
            ),
            cuda_context=cuda_context,
            cuda_skipped=cuda_skipped,
        )

    def _create_cuda_context(
        self, gpu_ids: tuple[str, ...]
    ) -> tuple[tuple[int, int] | None, str | None]:
        """Create the CUDA context on the rank's GPU now, while the actor starts, so its
        cost is its own span (``rayload.spawn.cuda_context``), not hidden in the first read.
        Returns its ``(start_ns, end_ns)``, or None and why it was skipped."""
        if not gpu_ids:
            return None, "no GPU assigned to the actor"
        if not torch.cuda.is_available():
            return None, "torch sees no CUDA device"
        start = self.clock()
        torch.zeros(1, device=LOCAL_CUDA_DEVICE)
        torch.cuda.synchronize(LOCAL_CUDA_DEVICE)
        return (start, self.clock()), None

    def _probe(self) -> EnvProbe | None:
        """The environment probe with the TEST HOOK's overrides; None: probe as usual."""
        if not self._probe_overrides:
            return None
        return replace(probe_environment(), **self._probe_overrides)

    def clock(self) -> int:
        """This actor's wall clock in ns: the remote half of a clock-offset round trip."""
        return time.time_ns() + self._skew_ns

    def ready(self) -> ActorInfo:
        return self._info

    def setup(self, device: str) -> RankSetup:
        """Before a load with a process group: this rank's resolved device and, on rank 0,
        where the group meets (this node's IP and a port free a moment ago). Never raises:
        a device this rank cannot have comes back as ``error``."""
        try:
            resolved = self._device(device)
        except Exception as exc:
            return RankSetup(rank=self._rank, error=RankError.from_exception(exc))
        if self._rank != 0:
            return RankSetup(rank=self._rank, device=resolved)
        return RankSetup(
            rank=self._rank,
            device=resolved,
            node_ip=ray.util.get_node_ip_address(),
            port=free_port(),
        )

    def load(self, request: LoadRequest) -> RankOutcome:
        """Join the load's process group (when asked), load this rank's shard and keep it
        resident, then build and fill the engine's module (when asked). Never raises for a
        failed load: the outcome carries the error and the spans recorded up to it."""
        timer = self._timer()
        start_ns = self.clock()
        report: RankReport | None = None
        error: RankError | None = None
        self._request = request
        self._replica = request.replica
        self._shards.loading()
        rchar = read_chars()
        try:
            device = self._device(request.device)
            if request.process_group is not None:
                self._process_group = join_process_group(
                    request.process_group, rank=self._rank, device=device, timer=timer
                )
            peer = self._peer_source(request)
            module = self._build_model(request, device, timer)
            with _storage_deadline(request):
                self._tensors, report = load_rank(
                    request.path,
                    self._rank,
                    request.tp_size,
                    request.method,
                    device,
                    strict=request.strict,
                    rules=request.rules,
                    model_role=request.model_role,
                    probe=self._probe(),
                    timer=timer,
                    post_load=self._model_filler(module, timer),
                    expert_parallel=request.expert_parallel,
                    peer=peer,
                    checkpoint=_drivers_checkpoint(request),
                    group=self._storage_group(request),
                    into=None
                    if module is None
                    else model_destinations(
                        module, str(request.method), device, peer=peer is not None
                    ),
                    publish=self._shards.publish,
                )
            report = _with_node(report, self._node_id, request.replica_index)
            self._report = report
            self._shards.loaded(self._tensors)
            if request.shared_copy:  # in the background: the load returns now
                threading.Thread(target=self._shards.share, daemon=True).start()
        except Exception as exc:
            log.exception("rank %d failed to load %s", self._rank, request.path)
            error = RankError.from_exception(exc)
            self._tensors, self._model = {}, None
            self._shards.failed(error.describe())
        return self._outcome(request, timer, start_ns, report, error, rchar=rchar)

    def _storage_group(self, request: LoadRequest) -> Any:
        """The load's process group when this replica's ranks all read storage (none of
        them receives from a peer): then they fetch split-1 tensors from object storage
        once between them (``load_rank``'s ``group``)."""
        return None if request.peers else self._process_group

    def _peer_source(self, request: LoadRequest) -> RayPeerSource | None:
        """The rank of another replica this rank is to load from (None: storage)."""
        ref = request.peers[self._rank] if self._rank < len(request.peers) else None
        if ref is None:
            return None
        return RayPeerSource(
            ref,
            host=ray.util.get_node_ip_address(),
            node_id=self._node_id,
            wait_s=request.peer_wait_s,
            stall_s=self._stall_s,
        )

    @ray.method(concurrency_group=PEER_GROUP)
    def open_channel(
        self,
        wait_s: float,
        want: dict[str, int],
        stream: bool = False,
        part: bool = False,
        offsets: dict[str, int] | None = None,
    ) -> PeerChannel:
        """A channel that sends this rank's shards to the same rank of another replica,
        whose plan wants ``want`` (name -> bytes; ``part``: what it still lacks, some of
        them; ``offsets``: where the ones cut short resume). Waits at most ``wait_s`` for a
        load still running (``stream``: only until it knows its tensors, then sends each
        piece as it lands); raises PeerUnavailable when it failed or the shards differ."""
        host = ray.util.get_node_ip_address()
        return self._shards.open(host, wait_s, want, stream=stream, part=part, offsets=offsets)

    @ray.method(concurrency_group=PEER_GROUP)
    def shared_copy(self, want: dict[str, int], part: bool = False) -> SharedCopy | None:
        """This rank's shards in its node's object store (a load with ``shared_copy``), for
        a receiver on this node whose plan wants ``want`` (``part``: some of them); None
        when there is none."""
        return self._shards.shared_copy(want, part=part)

    @ray.method(concurrency_group=PING_GROUP)
    def peer_ping(self) -> int:
        """Alive (answers even while loading); how many sends to receivers this rank has
        begun (their first bucket sent)."""
        return self._shards.started

    def _outcome(
        self,
        request: LoadRequest,
        timer: PhaseTimer,
        start_ns: int,
        report: RankReport | None,
        error: RankError | None,
        *,
        overwritten: set[str] | None = None,
        rchar: int | None = None,
    ) -> RankOutcome:
        """The load's (or reload's) outcome, with this rank's spans. ``rchar``: this
        process's ``read_chars()`` when the load began (``rayload.io.rchar`` is what the
        load read through ``read()`` calls: files, and Ray's small messages)."""
        end_ns = self.clock()
        rchar_now = read_chars()
        if report is not None:
            attributes = report_attributes(report)
            # rank.load also covers joining the process group, before the report starts.
            start_ns, end_ns = min(start_ns, report.start_ns), report.end_ns
        else:
            attributes = {"node_id": self._node_id, "model_role": request.model_role}
        if overwritten is not None:
            attributes["reload.overwritten_tensors"] = len(overwritten)
        if request.replica:
            attributes["replica_id"] = request.replica
        if rchar is not None and rchar_now is not None:
            attributes["io.rchar"] = rchar_now - rchar
        spans = rank_spans_payload(
            traceparent=request.traceparent,
            rank=self._rank,
            tp_size=request.tp_size,
            start_ns=start_ns,
            end_ns=end_ns,
            phases=report.phases if report is not None else tuple(timer.records),
            attributes=attributes,
            error=error.describe() if error else None,
            host_name=self._host_name,
            replica=request.replica_index,
        )
        return RankOutcome(
            rank=self._rank,
            node_id=self._node_id,
            spans=spans,
            start_ns=start_ns,
            end_ns=end_ns,
            report=report,
            error=error,
            overwritten=tuple(sorted(overwritten or ())),
        )

    def reload(self, request: LoadRequest) -> RankOutcome:
        """Read ``request.path`` into this rank's resident tensors, in place (see
        :func:`rayload.loading.rank.reload_rank`): no tensor is allocated or replaced, so
        the ``model=`` module, whose parameters share their storage, has the new weights.
        ``request`` is the load's, with the new path, method and traceparent. Never raises
        for a failed reload: the outcome carries the error, the spans and the tensors the
        reader had begun to write (``overwritten``)."""
        timer = self._timer()
        start_ns = self.clock()
        report: RankReport | None = None
        error: RankError | None = None
        written: set[str] = set()
        self._shards.loading()
        rchar = read_chars()
        try:
            if self._report is None:
                raise RuntimeError(f"rank {self._rank} has no loaded weights to reload into")
            with _storage_deadline(request):
                report = reload_rank(
                    request.path,
                    self._rank,
                    request.tp_size,
                    self._tensors,
                    request.method,
                    self._report.device,
                    strict=request.strict,
                    rules=request.rules,
                    model_role=request.model_role,
                    probe=self._probe(),
                    timer=timer,
                    expert_parallel=request.expert_parallel,
                    written=written,
                    peer=self._peer_source(request),
                    checkpoint=_drivers_checkpoint(request),
                    group=self._storage_group(request),
                )
            report = _with_node(report, self._node_id, request.replica_index)
            self._report = report
            self._request = replace(self._request or request, path=request.path)
            self._shards.loaded(self._tensors)
            if request.shared_copy:  # in the background: the load returns now
                threading.Thread(target=self._shards.share, daemon=True).start()
        except Exception as exc:
            log.exception("rank %d failed to reload %s", self._rank, request.path)
            error = RankError.from_exception(exc)
            # Some tensors may hold new bytes and some old: never served to a peer.
            self._shards.failed(f"its reload failed: {error.describe()}")
        return self._outcome(
            request, timer, start_ns, report, error, overwritten=written, rchar=rchar
        )

    def shutdown(self, timeout_s: float) -> bool:
        """Leave the load's process group (best effort, at most ``timeout_s``) and drop the
        model; the driver kills the actor next. True when a group was destroyed."""
        self._model = None
        destroyed = leave_process_group(timeout_s) if self._process_group is not None else False
        self._process_group = None
        return destroyed

    def shard(self, name: str) -> Any:
        """A CPU copy of this rank's tensor ``name``."""
        if name not in self._tensors:
            raise KeyError(
                f"rank {self._rank} holds no tensor {name!r} ({len(self._tensors)} loaded)"
            )
        return self._tensors[name].to("cpu", copy=True)

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(RankState, *args, **kwargs)`` on this rank's resident weights. Engine phases
        ``fn`` records wait here until :meth:`engine_spans` (or :meth:`apply_traced`)."""
        if self._report is None:
            raise RuntimeError(f"rank {self._rank} has not loaded weights yet")
        state = RankState(
            rank=self._rank,
            tp_size=self._report.tp_size,
            device=self._report.device,
            tensors=self._tensors,
            report=self._report,
            replica=(self._request.replica_index if self._request else None) or 0,
            model=self._model,
            process_group=self._process_group,
            phase=engine_phases(self._engine_timer),
        )
        return fn(state, *args, **kwargs)

    def apply_traced(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Applied:
        """:meth:`apply`, returning its value with the engine phases recorded so far."""
        value = self.apply(fn, *args, **kwargs)
        return Applied(value=value, spans=self.engine_spans())

    def engine_spans(self) -> bytes | None:
        """The engine phases recorded since the last call, as OTLP bytes (children of the
        load's root span, on this actor's clock); None when there are none."""
        records, self._engine_timer.records = self._engine_timer.records, []
        if not records or self._request is None or self._report is None:
            return None
        return engine_spans_payload(
            traceparent=self._request.traceparent,
            rank=self._rank,
            tp_size=self._report.tp_size,
            phases=records,
            attributes={
                "node_id": self._node_id,
                "device": self._report.device,
                "model_role": self._report.model_role,
            },
            host_name=self._host_name,
            replica=self._request.replica_index,
        )

    def _device(self, requested: str) -> str:
        return rank_device(
            requested,
            gpu_ids=self._info.gpu_ids,
            cuda_device_count=_cuda_device_count(),
            rank=self._rank,
        )

    def _build_model(self, request: LoadRequest, device: str, timer: PhaseTimer) -> Any:
        """The ``model=`` factory's module (``rank.model.build``), built before any byte is
        read so that the shards can be read into its memory; None without a factory."""
        factory = request.model
        if factory is None:
            return None
        context = ModelContext(
            rank=self._rank,
            tp_size=request.tp_size,
            device=device,
            config=dict(request.model_config or {}),
            process_group=self._process_group,
            phase=engine_phases(timer),
            expert_parallel=request.expert_parallel,
        )
        return build_module(factory, context, timer=timer)

    def _model_filler(self, module: Any, timer: PhaseTimer) -> PostLoad | None:
        """The post-load step that fills ``module`` from the shards (``rank.model.fill``)."""
        if module is None:
            return None

        def fill(tensors: dict[str, Any]) -> None:
            fill_module(module, tensors, rank=self._rank, timer=timer)
            self._model = module

        return fill

    def _timer(self) -> PhaseTimer:
        if self._fault is not None and self._fault.rank == self._rank:
            return FaultyTimer(self._fault, clock=self.clock)
        return PhaseTimer(clock=self.clock)

    def _process_start_ns(self) -> int | None:
        start = process_start_ns()
        return None if start is None else start + self._skew_ns


def process_start_ns() -> int | None:
    """When this process was created, on the wall clock, in ns (None where unknown).

    On Linux from ``/proc/self/stat`` (its start in clock ticks since boot, 10 ms) against
    ``CLOCK_BOOTTIME`` now: psutil's ``create_time`` adds the boot time, which the kernel
    gives in whole seconds, so it can be off by up to a second. Elsewhere psutil's."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime; fields[0] is field 3
        since_boot_s = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time_ns() - int(since_boot_s * 1e9)
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().create_time() * 1e9)


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _storage_deadline(request: LoadRequest) -> AbstractContextManager[None]:
    """The rank's storage deadline: what was left of the load's when the driver sent
    ``request`` (none for a request without one)."""
    if request.storage_deadline is None:
        return nullcontext()
    left, timeout = request.storage_deadline
    return storage_deadline(left, of=timeout)


def _drivers_checkpoint(request: LoadRequest) -> Checkpoint | None:
    """The driver's opened checkpoint the request carries a reference to (object storage)."""
    return None if request.checkpoint is None else ray.get(request.checkpoint)


def _with_node(report: RankReport, node_id: str, replica: int | None) -> RankReport:
    return replace(report, node_id=node_id, replica=replica or 0)
