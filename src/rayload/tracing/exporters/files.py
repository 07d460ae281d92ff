"""The trace files of ``--trace-dir``: one renderer per format, written atomically.

``trace.otlp.json``   OTLP/JSON (hex ids), for collectors and tools that read OTLP files
``trace.jaeger.json`` the Jaeger UI's "Upload" JSON
``trace.chrome.json`` Chrome trace events, for ui.perfetto.dev and chrome://tracing
``trace.html``        a self-contained timeline page
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from rayload.errors import ConfigError
from rayload.tracing.exporters.chrome import to_chrome_trace
from rayload.tracing.exporters.html import render_html
from rayload.tracing.exporters.jaeger import to_jaeger_json
from rayload.tracing.exporters.otlp_json import to_otlp_json

logger = logging.getLogger(__name__)

Renderer = Callable[[Sequence[ReadableSpan]], str]


def _json(build: Callable[[Sequence[ReadableSpan]], Any]) -> Renderer:
    return lambda spans: json.dumps(build(spans), indent=1) + "\n"


TRACE_FILES: dict[str, tuple[str, Renderer]] = {
    "otlp": ("trace.otlp.json", _json(to_otlp_json)),
    "jaeger": ("trace.jaeger.json", _json(to_jaeger_json)),
    "chrome": ("trace.chrome.json", _json(to_chrome_trace)),
    "html": ("trace.html", render_html),
}
"""Format name -> (file name, renderer)."""


def write_trace_files(spans: Sequence[ReadableSpan], trace_dir: str | Path) -> dict[str, Path]:
    """Write every format of :data:`TRACE_FILES` into ``trace_dir`` (created if needed).

    Returns format name -> path. Raises :class:`ConfigError` naming the directory when it
    cannot be written; call :func:`prepare_trace_dir` before a load to fail early.
    """
    directory = prepare_trace_dir(trace_dir)
    written: dict[str, Path] = {}
    for fmt, (name, render) in TRACE_FILES.items():
        path = directory / name
        try:
            _write_atomically(path, render(spans))
        except OSError as exc:
            raise ConfigError(
                f"cannot write trace file {path}: {exc.strerror or exc}; "
                "pass a writable --trace-dir"
            ) from exc
        written[fmt] = path
    return written


def prepare_trace_dir(trace_dir: str | Path) -> Path:
    """Create ``trace_dir`` if needed and check it is a writable directory."""
    directory = Path(trace_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create trace directory {directory}: {exc.strerror or exc}; "
            "pass a writable --trace-dir"
        ) from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(
            f"trace directory {directory} is not writable; pass a writable --trace-dir"
        )
    return directory


class FileSpanExporter(SpanExporter):
    """A :class:`SpanExporter` writing one trace file per :meth:`export` call, e.g.
    ``FileSpanExporter("t.html", render_html)``. Failures are logged, never raised."""

    def __init__(self, path: str | Path, render: Renderer) -> None:
        self._path = Path(path)
        self._render = render

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            _write_atomically(self._path, self._render(spans))
        except OSError as exc:
            logger.warning("cannot write trace file %s: %s", self._path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing is held open between exports."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _write_atomically(path: Path, text: str) -> None:
    """Readers never see a half-written file: write a sibling, then rename over. The file
    gets the mode a plain ``open`` would give it (0o644 under the usual umask), not
    ``mkstemp``'s private 0o600: traces are shared and uploaded."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            os.fchmod(handle.fileno(), 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask: from ``/proc/self/status`` on Linux (no side effect); elsewhere
    by setting it and straight back (another thread creating a file in between would see
    0o022)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
