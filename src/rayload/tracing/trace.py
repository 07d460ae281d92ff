"""Driver side: the one startup trace of a ``rayload.load()`` and the merge of every rank.

The driver records ``rayload.load`` (the root), ``rayload.placement`` and one
``rayload.spawn`` per rank with its own ``TracerProvider``. Each rank sends back its spans
as OTLP bytes (:func:`rayload.tracing.rank_spans.rank_spans_payload`); :meth:`StartupTrace.add_rank`
decodes them, moves them onto the driver's clock and keeps them with their own resource.
:meth:`StartupTrace.finish` returns every span of the trace, ready for any exporter.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Status, StatusCode

from rayload.tracing import schema
from rayload.tracing.clock import corrected
from rayload.tracing.decode import decode_spans
from rayload.tracing.ids import SecureIdGenerator
from rayload.tracing.rank_spans import format_traceparent, rank_spans_payload, record_span

logger = logging.getLogger(__name__)


class StartupTrace:
    """The startup trace of one ``rayload.load()``; the root span starts on construction.

    Invariants: every span :meth:`finish` returns has :attr:`trace_id`; driver spans are
    children of the root; a rank's ``rank.load`` is a child of the root (through
    :meth:`traceparent`) and its phases children of ``rank.load``; a rank's engine phases
    after the load (:meth:`add_engine`) are children of the root, which still ends where
    the load ended.
    """

    def __init__(
        self,
        *,
        tp_size: int,
        model_role: str = "main",
        service_name: str = schema.DRIVER_SERVICE,
        clock: Callable[[], int] = time.time_ns,
        start_ns: int | None = None,
        root_name: str = schema.ROOT_SPAN,
    ) -> None:
        """``start_ns`` backdates the root span to when the load really began (before the
        driver parsed config and headers and started Ray); default: now. ``root_name`` is
        ``rayload.load``, or ``rayload.reload`` for ``LoadResult.reload``'s own trace."""
        self._clock = clock
        self._tp_size = tp_size
        self._model_role = model_role
        self._provider = TracerProvider(
            resource=Resource.create(
                {"service.name": service_name, "host.name": socket.gethostname()}
            ),
            id_generator=SecureIdGenerator(),
            sampler=ALWAYS_ON,
            shutdown_on_exit=False,
        )
        self._driver_spans = InMemorySpanExporter()
        self._provider.add_span_processor(SimpleSpanProcessor(self._driver_spans))
        self._tracer = self._provider.get_tracer(schema.SCOPE_NAME)
        # An empty Context: the startup trace is its own trace, whatever span is current.
        self._root = self._tracer.start_span(
            root_name,
            context=Context(),
            start_time=clock() if start_ns is None else start_ns,
            attributes=schema.rayload_attributes({"tp_size": tp_size, "model_role": model_role}),
        )
        self._root_context = trace_api.set_span_in_context(self._root)
        self._rank_spans: list[tuple[int, ReadableSpan]] = []
        self._engine_spans: list[tuple[int, ReadableSpan]] = []
        self._finished: list[ReadableSpan] | None = None

    @property
    def trace_id(self) -> str:
        """The trace id, 32 lowercase hex characters."""
        return f"{self._root.get_span_context().trace_id:032x}"

    def traceparent(self) -> str:
        """The W3C ``traceparent`` of the root span; pass it to every rank."""
        return format_traceparent(self._root.get_span_context())

    def add_span(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
        error: str | None = None,
        *,
        parent: trace_api.Span | None = None,
    ) -> trace_api.Span:
        """Record a driver span (``rayload.placement``, ``rayload.spawn``) under the root,
        or under ``parent``, a span this method returned (the children of a spawn).

        Times are the driver's wall clock in nanoseconds; attribute keys get the
        ``rayload.`` prefix where missing. Returns the (ended) span.
        """
        self._check_open()
        return record_span(
            self._tracer,
            name,
            parent=self._root_context if parent is None else trace_api.set_span_in_context(parent),
            start_ns=start_ns,
            end_ns=end_ns,
            attributes=attributes,
            error=error,
        )

    def add_rank(self, payload: bytes, clock_offset_ns: int, rtt_ns: int | None = None) -> None:
        """Merge a rank's spans (OTLP protobuf bytes) measured ``clock_offset_ns`` ahead of
        the driver's clock: every time moves by ``-clock_offset_ns`` and the spans record
        ``rayload.clock_offset_ms``.

        A payload that does not decode, or spans of another trace, are left out with a
        warning: telemetry never fails a load.
        """
        self._check_open()
        self._rank_spans.extend(self._merged(payload, clock_offset_ns, rtt_ns))

    def add_engine(self, payload: bytes, clock_offset_ns: int, rtt_ns: int | None = None) -> None:
        """Merge a rank's engine phases (``engine.<name>`` spans, children of the root),
        with the same clock correction as :meth:`add_rank`. Unlike the other ``add_``
        methods this works after :meth:`finish`: engine phases run after the load
        returned; :meth:`spans` includes them, the root keeps its end (the load's)."""
        merged = self._merged(payload, clock_offset_ns, rtt_ns)
        (self._rank_spans if self._finished is None else self._engine_spans).extend(merged)

    def add_missing_rank(
        self, rank: int, node_id: str | None, error: str, start_ns: int, end_ns: int
    ) -> None:
        """A stand-in ``rank.load`` (status ERROR, times on the driver's clock) for a rank
        whose actor died and returned no spans, so the trace still shows every rank."""
        payload = rank_spans_payload(
            traceparent=self.traceparent(),
            rank=rank,
            tp_size=self._tp_size,
            start_ns=start_ns,
            end_ns=end_ns,
            phases=(),
            attributes={"node_id": node_id, "model_role": self._model_role, "spans_lost": True},
            error=error,
            host_name=_UNKNOWN_HOST,
        )
        self._rank_spans.extend((rank, span) for span in decode_spans(payload))

    def spans(self) -> list[ReadableSpan]:
        """Every span of the trace once :meth:`finish` ran: what it returned, then the
        engine phases merged since, by rank and time. Before ``finish``: RuntimeError."""
        if self._finished is None:
            raise RuntimeError(f"startup trace {self.trace_id} is not finished yet")
        late = [span for _, span in sorted(self._engine_spans, key=_rank_order)]
        return [*self._finished, *late]

    def finish(self, error: str | None = None) -> list[ReadableSpan]:
        """End the root (status ERROR with ``error`` when given) and return every span:
        the root first, then the other driver spans, then each rank's by rank and time.
        Calling it again returns the same spans."""
        if self._finished is not None:
            return self._finished
        if error is not None:
            self._root.set_status(Status(StatusCode.ERROR, error))
            self._root.add_event(
                "exception", schema.exception_attributes(error), timestamp=self._clock()
            )
        self._root.end(end_time=self._clock())
        driver = sorted(
            self._driver_spans.get_finished_spans(),
            key=lambda s: (s.parent is not None, s.start_time or 0),
        )
        ranks = [span for _, span in sorted(self._rank_spans, key=_rank_order)]
        self._provider.shutdown()
        self._finished = [*driver, *ranks]
        return self._finished

    def _merged(
        self, payload: bytes, clock_offset_ns: int, rtt_ns: int | None
    ) -> list[tuple[int, ReadableSpan]]:
        """A rank's payload decoded, its spans of this trace moved onto the driver's clock."""
        try:
            spans = decode_spans(payload)
        except DecodeError as exc:
            logger.warning("a rank's trace payload (%d bytes) is not OTLP: %s", len(payload), exc)
            return []
        own_trace = self._root.get_span_context().trace_id
        merged = []
        for span in spans:
            if span.context is None or span.context.trace_id != own_trace:
                logger.warning(
                    "dropping span %r of trace %032x from a rank: this startup trace is %s "
                    "(was the rank given this trace's traceparent?)",
                    span.name,
                    0 if span.context is None else span.context.trace_id,
                    self.trace_id,
                )
                continue
            merged.append((_rank_of(span), corrected(span, clock_offset_ns, rtt_ns)))
        return merged

    def _check_open(self) -> None:
        if self._finished is not None:
            raise RuntimeError(f"startup trace {self.trace_id} is already finished")


_UNKNOWN_HOST = "unknown"


def _rank_of(span: ReadableSpan) -> int:
    rank = (span.attributes or {}).get(schema.RANK)
    if rank is None:
        rank = span.resource.attributes.get(schema.RANK, -1)
    return int(rank)  # type: ignore[arg-type]


def _rank_order(item: tuple[int, ReadableSpan]) -> tuple[int, bool, int]:
    rank, span = item
    return rank, span.name != schema.RANK_SPAN, span.start_time or 0
