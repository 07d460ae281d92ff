"""Spans, clock-offset correction, cross-rank merge, exporters and startup metrics.

Importable without Ray. One ``rayload.load()`` produces ONE trace::

    driver                                   rank actor (one per rank)
    ------                                   -------------------------
    trace = StartupTrace(tp_size=4)          # root span rayload.load starts
    trace.add_span("rayload.placement", t0, t1)
    trace.add_span("rayload.spawn", t0, t1, {"rank": r})
    offset, rtt = best_clock_offset(samples) # samples: (t_send, actor.now_ns(), t_recv)
                     -- trace.traceparent() -->
                                             payload = rank_spans_payload(
                                                 traceparent=..., rank=r, tp_size=4,
                                                 start_ns=..., end_ns=..., phases=...,
                                                 attributes=report_attributes(report))
                     <-- payload (OTLP protobuf bytes) --
    trace.add_rank(payload, offset, rtt)     # or add_missing_rank(...) for a dead actor
    spans = trace.finish(error=None)
    write_trace_files(spans, trace_dir)      # trace.{otlp,jaeger,chrome}.json, trace.html
    export_otlp(spans, endpoint)             # never raises, never stalls
    metrics = startup_metrics(reports, placement_seconds=..., actor_startup_seconds={...})
    print(format_metrics_table(metrics)); publish_ray_metrics(metrics)

Span and attribute names are fixed in :mod:`rayload.tracing.schema` (docs/design.md "Spans").
"""

from rayload.tracing.clock import best_clock_offset, corrected, sample_clock_offset
from rayload.tracing.decode import decode_spans
from rayload.tracing.exporters import (
    FileSpanExporter,
    export_otlp,
    prepare_trace_dir,
    render_html,
    to_chrome_trace,
    to_jaeger_json,
    to_otlp_json,
    write_trace_files,
)
from rayload.tracing.ids import SecureIdGenerator
from rayload.tracing.metrics import (
    format_metrics_table,
    metric_key,
    publish_ray_metrics,
    startup_metrics,
)
from rayload.tracing.rank_spans import rank_spans_payload, report_attributes, report_spans_payload
from rayload.tracing.trace import StartupTrace

__all__ = [
    "FileSpanExporter",
    "SecureIdGenerator",
    "StartupTrace",
    "best_clock_offset",
    "corrected",
    "decode_spans",
    "export_otlp",
    "format_metrics_table",
    "metric_key",
    "prepare_trace_dir",
    "publish_ray_metrics",
    "rank_spans_payload",
    "render_html",
    "report_attributes",
    "report_spans_payload",
    "sample_clock_offset",
    "startup_metrics",
    "to_chrome_trace",
    "to_jaeger_json",
    "to_otlp_json",
    "write_trace_files",
]
