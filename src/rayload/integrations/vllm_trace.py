"""One trace of a vLLM engine's ``load_format="rayload"`` loads: every worker's rank spans.

Each vLLM worker records what rayload's own ranks record (``rank.load`` and its phases,
:mod:`rayload.tracing.rank_spans`, with rank and method attributes), plus the two vLLM
steps around rayload's read, as phases of the same ``rank.load``:

* ``rank.model.build``: vLLM building the model (its ``initialize_model``, the loader's
  ``create_model``: vLLM's own span "Initialize model");
* ``rank.model.fill``: vLLM's weight loaders copying the shards into its partitioned
  parameters (``model.load_weights``).

Where the spans go, both when configured:

* OTLP: the endpoint vLLM traces to (``otlp_traces_endpoint``, ``--otlp-traces-endpoint``)
  or else ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT``, sent by rayload's
  :func:`~rayload.tracing.export_otlp` on a background thread (it never fails or delays
  the load);
* files: ``trace_dir`` in ``model_loader_extra_config``: each worker writes its spans there
  and the last worker to finish merges all of them into rayload's trace files
  (``trace.otlp.json``, ``trace.jaeger.json``, ``trace.chrome.json``, ``trace.html``).

Which trace: vLLM 0.32 traces its own start-up when it has an endpoint ("SyncMPClient
init" or "Overall Loading" in the engine process, then "EngineCoreProc init", "Executor
init", each worker's "Worker init", "Loading (CPU)"/"Loading (GPU)", "Load model"), and
propagates its context to the workers through ``traceparent`` in their environment (with
its core in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, no span encloses the start-up:
"Executor init", the workers' spans under it, and "Prepare model" are two traces). The
worker's current span at load time is then vLLM's "Load model", and ``rank.load`` is its
child. When the engine's config asks for tracing (its endpoint or ``trace_dir``), rank 0
broadcasts its parent over vLLM's TP group; a worker whose own context is of another
trace, or has none, takes rank 0's instead. Without a vLLM context rank 0 records the
root itself: ``rayload.load``, spanning its own load. Tracing asked for by a worker's
environment alone (``OTEL_EXPORTER_OTLP_*``, which may differ between nodes) does not
broadcast: each worker then keeps vLLM's context, or records a root of its own.

vLLM's own span ids are drawn from ``random``, seeded alike in every worker: rayload
gives vLLM's tracer provider its secure ids when vLLM loads the plugin
(:func:`secure_span_ids`), so the workers' spans stay apart.

Times are each worker's wall clock, uncorrected: exact for the workers of one host (vLLM's
mp executor), not measured across hosts (vLLM's Ray executor on several nodes).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Status, StatusCode, TraceFlags

from rayload.loading.report import PhaseTimer, RankReport
from rayload.tracing import schema
from rayload.tracing.decode import decode_spans
from rayload.tracing.exporters import export_otlp, prepare_trace_dir, write_trace_files
from rayload.tracing.ids import SecureIdGenerator
from rayload.tracing.rank_spans import (
    format_traceparent,
    parse_traceparent,
    rank_spans_payload,
    report_attributes,
)

logger = logging.getLogger(__name__)

ENGINE = "vllm"
"""The ``rayload.engine`` attribute of the spans a vLLM worker records."""

_PAYLOAD_SUFFIX = ".otlp.pb"


@dataclass(frozen=True)
class TraceTarget:
    """Where a worker's spans go: an OTLP endpoint (None: the environment's, when set)
    and/or a directory of trace files. ``agreed``: the tracing comes from the engine's
    config (its endpoint or ``trace_dir``), the same in every worker, so the workers may
    agree on the trace over the TP group; tracing from a worker's environment alone
    (which may differ between nodes) never waits for the other workers."""

    otlp: bool
    endpoint: str | None
    trace_dir: Path | None
    agreed: bool = True


def trace_target(trace_dir: str | None) -> TraceTarget | None:
    """The worker's trace target from vLLM's config and the environment; None: no
    tracing (vLLM has no endpoint, none is in the environment, no ``trace_dir``)."""
    from vllm.config import get_current_vllm_config

    secure_span_ids()
    endpoint = get_current_vllm_config().observability_config.otlp_traces_endpoint
    otlp = bool(
        endpoint
        or os.environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
        or os.environ.get(OTEL_EXPORTER_OTLP_ENDPOINT)
    )
    if not otlp and trace_dir is None:
        return None
    directory = None if trace_dir is None else prepare_trace_dir(trace_dir)
    return TraceTarget(otlp, endpoint, directory, agreed=bool(endpoint) or directory is not None)


def secure_span_ids() -> None:
    """Give vLLM's tracer provider in this process (when it has one) rayload's
    :class:`~rayload.tracing.SecureIdGenerator`. vLLM's draws ids from ``random``, which
    vLLM seeds alike in every worker (``seed=``), so the workers' spans after the seed
    ("Load model", "Initialize model", ...) would share their span ids and a trace could
    not tell whose child ``rank.load`` is. Called when vLLM loads the plugin in a process,
    before the seed, and again at load time."""
    provider = trace_api.get_tracer_provider()
    ids = getattr(provider, "id_generator", None)
    if isinstance(provider, TracerProvider) and type(ids) is RandomIdGenerator:
        # The provider's tracers (cached) share this object: give it secure draws.
        secure = SecureIdGenerator()
        ids.generate_span_id = secure.generate_span_id  # type: ignore[method-assign]
        ids.generate_trace_id = secure.generate_trace_id  # type: ignore[method-assign]


class WorkerTrace:
    """One worker's load in the engine's trace: its phases, then :meth:`finish`."""

    def __init__(self, target: TraceTarget | None) -> None:
        self.target = target
        self.timer = PhaseTimer()
        self.start_ns: int | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[dict[str, Any]]:
        """Time a vLLM step of the load as a phase of ``rank.load`` (the first one also
        starts ``rank.load``)."""
        if self.start_ns is None:
            self.start_ns = self.timer.clock()
        with self.timer.phase(name, engine=ENGINE) as attributes:
            yield attributes

    def finish(self, rank: int, tp_size: int, report: RankReport | None, error: str | None) -> None:
        """Record ``rank.load`` (rayload's report, or ``error`` when the load failed) and
        send it. Every rank of the TP group must call it (rank 0 broadcasts the trace);
        the sending never raises."""
        if self.target is None:
            return
        end_ns = self.timer.clock()
        start_ns = self.start_ns if self.start_ns is not None else end_ns
        if report is not None:
            start_ns = min(start_ns, report.start_ns)
        parent, root_ids = _parent(rank, tp_size if self.target.agreed else 1)
        phases = sorted(
            (*self.timer.records, *(() if report is None else report.phases)),
            key=lambda p: p.start_ns,
        )
        attributes = {"engine": ENGINE, **({} if report is None else report_attributes(report))}
        payload = rank_spans_payload(
            traceparent=parent,
            rank=rank,
            tp_size=tp_size,
            start_ns=start_ns,
            end_ns=end_ns,
            phases=phases,
            attributes=attributes,
            error=error,
        )
        spans = decode_spans(payload)
        if root_ids is not None:
            spans.insert(0, _root_span(root_ids, tp_size, start_ns, end_ns, error))
        if self.target.trace_dir is not None:
            _write_files(self.target.trace_dir, rank, tp_size, spans)
        if self.target.otlp:
            threading.Thread(
                target=export_otlp,
                args=(spans, self.target.endpoint),
                name="rayload-vllm-trace",
                daemon=True,
            ).start()


def _parent(rank: int, tp_size: int) -> tuple[str, tuple[int, int] | None]:
    """The traceparent of this worker's ``rank.load``, and the ``(trace id, span id)`` of
    the root this worker records (None: another span is the parent). ``tp_size`` 1: no
    agreement with the other workers."""
    own = trace_api.get_current_span().get_span_context()
    root_ids = None
    if own.is_valid:
        mine = format_traceparent(own)
    else:
        ids = SecureIdGenerator()
        root_ids = (ids.generate_trace_id(), ids.generate_span_id())
        mine = f"00-{root_ids[0]:032x}-{root_ids[1]:016x}-01"
    if tp_size == 1:
        return mine, root_ids
    from vllm.distributed import get_tp_group

    shared = get_tp_group().broadcast_object(mine if rank == 0 else None, src=0)
    if rank == 0:
        return mine, root_ids
    if own.is_valid and f"{own.trace_id:032x}" == shared.split("-")[1]:
        return mine, None
    parse_traceparent(shared)  # rank 0 sent a valid one
    return shared, None


def _root_span(
    ids: tuple[int, int], tp_size: int, start_ns: int, end_ns: int, error: str | None
) -> ReadableSpan:
    """Rank 0's ``rayload.load`` when vLLM has no trace of its own: the root its
    ``rank.load`` and every other worker's hang from (``ids`` were broadcast)."""
    trace_id, span_id = ids
    return ReadableSpan(
        name=schema.ROOT_SPAN,
        context=trace_api.SpanContext(trace_id, span_id, False, TraceFlags(TraceFlags.SAMPLED)),
        parent=None,
        resource=Resource.create(
            {"service.name": schema.DRIVER_SERVICE, "host.name": socket.gethostname()}
        ),
        attributes=schema.rayload_attributes({"tp_size": tp_size, "engine": ENGINE}),
        start_time=start_ns,
        end_time=end_ns,
        status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
        instrumentation_scope=InstrumentationScope(schema.SCOPE_NAME),
    )


def _write_files(trace_dir: Path, rank: int, tp_size: int, spans: list[ReadableSpan]) -> None:
    """:func:`_merge_into`, logged; a trace that cannot be written never fails the load."""
    try:
        merged = _merge_into(trace_dir, rank, tp_size, spans)
    except OSError as exc:
        logger.warning(
            "rayload: rank %d could not write its trace into %s: %s", rank, trace_dir, exc
        )
        return
    if merged is not None:
        logger.info("rayload: the load's trace (%d spans) is in %s", merged, trace_dir)


def _merge_into(trace_dir: Path, rank: int, tp_size: int, spans: list[ReadableSpan]) -> int | None:
    """Write this worker's spans into ``trace_dir``; once every rank of the trace wrote
    its own, merge them into the trace files (under a lock: two last workers write the
    same files in turn). Returns the merged span count, or None while ranks are missing."""
    trace_id = f"{spans[0].context.trace_id:032x}" if spans[0].context else "0" * 32
    own = trace_dir / f"rank{rank}-{trace_id}{_PAYLOAD_SUFFIX}"
    partial = own.with_suffix(".part")
    partial.write_bytes(encode_spans(spans).SerializeToString())
    partial.replace(own)
    with open(trace_dir / ".rayload-merge.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        payloads = sorted(trace_dir.glob(f"rank*-{trace_id}{_PAYLOAD_SUFFIX}"))
        if len(payloads) < tp_size:
            return None
        merged = [span for path in payloads for span in decode_spans(path.read_bytes())]
        merged.sort(key=lambda s: (s.parent is not None, s.start_time or 0))
        write_trace_files(merged, trace_dir)
        return len(merged)
