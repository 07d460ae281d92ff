"""Rank side: turn a rank's timed phases into OpenTelemetry spans and serialize them.

Each rank process builds its *own* short-lived ``TracerProvider`` (never Ray's built-in
tracing, never the global provider): the spans carry the rank's resource
(``service.name=rayload-rank``, ``host.name``, ``rayload.rank``) and are returned to the
driver as OTLP protobuf bytes, the same bytes an OTLP exporter would send. The driver
decodes them (:mod:`rayload.tracing.decode`), corrects their clock and merges them.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from rayload.loading.report import PhaseRecord, RankReport
from rayload.tracing import schema
from rayload.tracing.ids import SecureIdGenerator

_PROPAGATOR = TraceContextTextMapPropagator()


def rank_spans_payload(
    *,
    traceparent: str,
    rank: int,
    tp_size: int,
    start_ns: int,
    end_ns: int,
    phases: Sequence[PhaseRecord],
    attributes: Mapping[str, Any],
    error: str | None = None,
    host_name: str | None = None,
    replica: int | None = None,
) -> bytes:
    """A rank's spans as OTLP protobuf bytes (a serialized ``ExportTraceServiceRequest``).

    ``rank.load`` spans ``start_ns``..``end_ns`` and is a child of the span named by
    ``traceparent``; each :class:`PhaseRecord` becomes a child of ``rank.load`` with its
    own times and attributes (keys prefixed ``rayload.`` where they are not already).
    Times are this process's wall clock; the driver shifts them by the measured offset.

    A phase with ``error`` ends with status ERROR and an ``exception`` event; so does
    ``rank.load`` when ``error`` is given or any phase failed.

    Raises ValueError if ``traceparent`` is not a valid W3C traceparent: spans that
    silently started a new trace would be lost from the startup trace.
    """
    parent = parse_traceparent(traceparent)
    provider, finished = _rank_provider(rank, host_name, replica)
    try:
        tracer = provider.get_tracer(schema.SCOPE_NAME)
        rank_error = error or next((p.error for p in phases if p.error), None)
        rank_attributes = {**dict(attributes), "rank": rank, "tp_size": tp_size}
        rank_span = record_span(
            tracer,
            schema.RANK_SPAN,
            parent=parent,
            start_ns=start_ns,
            end_ns=end_ns,
            attributes=rank_attributes,
            error=rank_error,
        )
        rank_context = trace_api.set_span_in_context(rank_span)
        for phase in phases:
            record_span(
                tracer,
                phase.name,
                parent=rank_context,
                start_ns=phase.start_ns,
                end_ns=phase.end_ns,
                attributes={"rank": rank, **phase.attributes},
                error=phase.error,
            )
        spans: tuple[ReadableSpan, ...] = finished.get_finished_spans()
    finally:
        provider.shutdown()
    return encode_spans(spans).SerializeToString()


def engine_spans_payload(
    *,
    traceparent: str,
    rank: int,
    tp_size: int,
    phases: Sequence[PhaseRecord],
    attributes: Mapping[str, Any],
    host_name: str | None = None,
    replica: int | None = None,
) -> bytes:
    """A rank's engine phases (``engine.<name>``, recorded after its load, e.g. in
    ``LoadResult.apply``) as OTLP protobuf bytes: each a child of the span ``traceparent``
    names (the load's root), with the rank's resource and ``attributes`` (node, device).
    Times are this process's wall clock, as for :func:`rank_spans_payload`."""
    parent = parse_traceparent(traceparent)
    provider, finished = _rank_provider(rank, host_name, replica)
    try:
        tracer = provider.get_tracer(schema.SCOPE_NAME)
        for phase in phases:
            record_span(
                tracer,
                phase.name,
                parent=parent,
                start_ns=phase.start_ns,
                end_ns=phase.end_ns,
                attributes={
                    **dict(attributes),
                    "rank": rank,
                    "tp_size": tp_size,
                    **phase.attributes,
                },
                error=phase.error,
            )
        spans: tuple[ReadableSpan, ...] = finished.get_finished_spans()
    finally:
        provider.shutdown()
    return encode_spans(spans).SerializeToString()


def _rank_provider(
    rank: int, host_name: str | None, replica: int | None = None
) -> tuple[TracerProvider, InMemorySpanExporter]:
    """A short-lived provider with the rank's resource (``replica``: its replica, in a
    load of several), collecting spans in memory."""
    attributes: dict[str, Any] = {
        "service.name": schema.RANK_SERVICE,
        "host.name": host_name or socket.gethostname(),
        schema.RANK: rank,
    }
    if replica is not None:
        attributes[schema.REPLICA] = replica
    resource = Resource.create(attributes)
    provider = TracerProvider(
        resource=resource,
        id_generator=SecureIdGenerator(),
        sampler=ALWAYS_ON,
        shutdown_on_exit=False,
    )
    finished = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(finished))
    return provider, finished


def report_attributes(report: RankReport) -> dict[str, Any]:
    """The ``rank.load`` attributes docs/design.md "Spans" fixes, taken from a :class:`RankReport`.

    Pass the result as ``attributes`` of :func:`rank_spans_payload`. ``fallback_reason``,
    ``peer_switch`` and ``node_id`` are None when not applicable and are then left off
    the span.
    """
    return {
        "node_id": report.node_id,
        "device": report.device,
        "method.requested": report.method.requested.value,
        "method.selected": report.method.selected.value,
        "method.effective": report.method.effective.value,
        "fallback_reason": report.method.fallback_reason,
        "peer_switch": report.peer_switch,
        "bytes": report.bytes_read,
        "bytes_from_storage": report.bytes_from_storage,
        "bytes_from_peers": report.bytes_from_peers,
        "source": report.source,
        "storage": report.storage,
        "storage.endpoint": report.storage_endpoint,
        "storage.bucket": report.storage_bucket,
        "requests": report.requests,
        "retries": report.retries,
        "tensors": report.tensors,
        "model_role": report.model_role,
    }


def report_spans_payload(
    report: RankReport, *, traceparent: str, error: str | None = None, host_name: str | None = None
) -> bytes:
    """:func:`rank_spans_payload` for a finished (or failed) rank's :class:`RankReport`."""
    return rank_spans_payload(
        traceparent=traceparent,
        rank=report.rank,
        tp_size=report.tp_size,
        start_ns=report.start_ns,
        end_ns=report.end_ns,
        phases=report.phases,
        attributes=report_attributes(report),
        error=error,
        host_name=host_name,
    )


def parse_traceparent(traceparent: str) -> Context:
    """The context of the remote parent span a W3C ``traceparent`` header names."""
    context = _PROPAGATOR.extract({"traceparent": traceparent})
    if not trace_api.get_current_span(context).get_span_context().is_valid:
        raise ValueError(
            f"invalid W3C traceparent {traceparent!r}: expected "
            "'00-<32 hex trace id>-<16 hex span id>-<2 hex flags>' from StartupTrace.traceparent()"
        )
    return context


def format_traceparent(span_context: trace_api.SpanContext) -> str:
    """The W3C ``traceparent`` header naming ``span_context`` (always sampled)."""
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-01"


def record_span(
    tracer: trace_api.Tracer,
    name: str,
    *,
    parent: Context,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any] | None = None,
    error: str | None = None,
) -> trace_api.Span:
    """Record one finished span with explicit times; an ``error`` sets status ERROR and adds
    an ``exception`` event at the end time. Returns the (ended) span, whose context can
    still parent other spans."""
    span = tracer.start_span(
        name,
        context=parent,
        start_time=start_ns,
        attributes=schema.rayload_attributes(attributes),
    )
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
        span.add_event("exception", schema.exception_attributes(error), timestamp=end_ns)
    span.end(end_time=end_ns)
    return span
