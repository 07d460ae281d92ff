"""Where the startup trace goes: OTLP receivers and the ``--trace-dir`` files."""

from rayload.tracing.exporters.chrome import to_chrome_trace
from rayload.tracing.exporters.files import (
    TRACE_FILES,
    FileSpanExporter,
    prepare_trace_dir,
    write_trace_files,
)
from rayload.tracing.exporters.html import render_html
from rayload.tracing.exporters.jaeger import to_jaeger_json
from rayload.tracing.exporters.otlp import export_otlp, resolve_target
from rayload.tracing.exporters.otlp_json import to_otlp_json

__all__ = [
    "TRACE_FILES",
    "FileSpanExporter",
    "export_otlp",
    "prepare_trace_dir",
    "render_html",
    "resolve_target",
    "to_chrome_trace",
    "to_jaeger_json",
    "to_otlp_json",
    "write_trace_files",
]
