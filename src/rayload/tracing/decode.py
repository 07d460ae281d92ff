"""Driver side: OTLP protobuf bytes back into SDK :class:`ReadableSpan` objects.

Decoding a rank's payload into the SDK's own span type lets every exporter (the SDK's
OTLP exporters and rayload's file exporters) handle driver and rank spans alike. Each
span keeps its SpanContext, parent, kind, status, events, links, instrumentation scope
and the :class:`Resource` of the process that recorded it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from opentelemetry import trace as trace_api
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PBSpan
from opentelemetry.proto.trace.v1.trace_pb2 import SpanFlags
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.util.types import AttributeValue

_KINDS = {
    PBSpan.SPAN_KIND_UNSPECIFIED: SpanKind.INTERNAL,
    PBSpan.SPAN_KIND_INTERNAL: SpanKind.INTERNAL,
    PBSpan.SPAN_KIND_SERVER: SpanKind.SERVER,
    PBSpan.SPAN_KIND_CLIENT: SpanKind.CLIENT,
    PBSpan.SPAN_KIND_PRODUCER: SpanKind.PRODUCER,
    PBSpan.SPAN_KIND_CONSUMER: SpanKind.CONSUMER,
}


def decode_spans(payload: bytes) -> list[ReadableSpan]:
    """Every span of a serialized ``ExportTraceServiceRequest``.

    Raises ``google.protobuf.message.DecodeError`` on bytes that are not one.
    """
    request = ExportTraceServiceRequest()
    request.ParseFromString(payload)
    return list(spans_from_request(request))


def spans_from_request(request: ExportTraceServiceRequest) -> Iterable[ReadableSpan]:
    """The spans of a parsed request, each carrying its resource and scope."""
    for resource_spans in request.resource_spans:
        resource = Resource(
            _attributes(resource_spans.resource.attributes),
            schema_url=resource_spans.schema_url,
        )
        for scope_spans in resource_spans.scope_spans:
            scope = InstrumentationScope(
                scope_spans.scope.name,
                scope_spans.scope.version or None,
                scope_spans.schema_url or None,
            )
            for span in scope_spans.spans:
                yield _span(span, resource, scope)


def _span(span: PBSpan, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    trace_id = int.from_bytes(span.trace_id, "big")
    context = trace_api.SpanContext(
        trace_id=trace_id,
        span_id=int.from_bytes(span.span_id, "big"),
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
        trace_state=_trace_state(span.trace_state),
    )
    parent = None
    if span.parent_span_id:
        parent = trace_api.SpanContext(
            trace_id=trace_id,
            span_id=int.from_bytes(span.parent_span_id, "big"),
            is_remote=_is_remote(span.flags),
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
    return ReadableSpan(
        name=span.name,
        context=context,
        parent=parent,
        resource=resource,
        attributes=_attributes(span.attributes),
        events=[
            Event(event.name, _attributes(event.attributes), event.time_unix_nano)
            for event in span.events
        ],
        links=[_link(link) for link in span.links],
        kind=_KINDS.get(span.kind, SpanKind.INTERNAL),
        status=_status(span.status.code, span.status.message),
        start_time=span.start_time_unix_nano,
        end_time=span.end_time_unix_nano,
        instrumentation_scope=scope,
    )


def _status(code: int, message: str) -> Status:
    status_code = StatusCode(code)
    # The SDK ignores (and warns about) a description on a status other than ERROR.
    if status_code is StatusCode.ERROR:
        return Status(status_code, message or None)
    return Status(status_code)


def _is_remote(flags: int) -> bool:
    return bool(flags & SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK) and bool(
        flags & SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
    )


def _trace_state(encoded: str) -> TraceState | None:
    if not encoded:
        return None
    return TraceState.from_header([encoded])


def _link(link: PBSpan.Link) -> Link:
    context = trace_api.SpanContext(
        trace_id=int.from_bytes(link.trace_id, "big"),
        span_id=int.from_bytes(link.span_id, "big"),
        is_remote=_is_remote(link.flags),
    )
    return Link(context, _attributes(link.attributes))


def _attributes(key_values: Sequence[KeyValue]) -> dict[str, AttributeValue]:
    return {kv.key: _value(kv.value) for kv in key_values}


def _value(value: AnyValue) -> AttributeValue:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        return value.double_value
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "bytes_value":
        return value.bytes_value.hex()
    if kind == "kvlist_value":
        # Span attributes cannot nest; keep the content readable rather than drop it.
        return str({kv.key: _value(kv.value) for kv in value.kvlist_value.values})
    return ""
