"""write_trace_files: the four --trace-dir files, and clear errors for unwritable dirs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SpanExportResult

from rayload.errors import ConfigError
from rayload.tracing import FileSpanExporter, prepare_trace_dir, to_jaeger_json, write_trace_files


def test_write_trace_files_creates_all_four(tp4_trace: Any, tmp_path: Path) -> None:
    paths = write_trace_files(tp4_trace.spans, tmp_path / "deep" / "trace")
    assert {name: path.name for name, path in paths.items()} == {
        "otlp": "trace.otlp.json",
        "jaeger": "trace.jaeger.json",
        "chrome": "trace.chrome.json",
        "html": "trace.html",
    }
    assert json.loads(paths["jaeger"].read_text())["data"][0]["traceID"] == tp4_trace.trace_id
    assert json.loads(paths["chrome"].read_text())["otherData"]["trace_id"] == tp4_trace.trace_id
    otlp = json.loads(paths["otlp"].read_text())
    assert len(otlp["resourceSpans"]) == tp4_trace.tp_size + 1
    assert tp4_trace.trace_id in paths["html"].read_text()
    assert sorted(p.name for p in paths["html"].parent.iterdir()) == sorted(
        p.name for p in paths.values()
    )  # no temporary files left behind


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_trace_files_get_the_mode_open_would_give(
    tp4_trace: Any, tmp_path: Path, umask: int, mode: int
) -> None:
    old = os.umask(umask)
    try:
        paths = write_trace_files(tp4_trace.spans, tmp_path / "trace")
    finally:
        os.umask(old)
    assert {name: p.stat().st_mode & 0o777 for name, p in paths.items()} == {
        name: mode for name in paths
    }


def test_write_trace_files_into_file_path_raises_config_error(
    tp4_trace: Any, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"not-a-dir.*--trace-dir"):
        write_trace_files(tp4_trace.spans, blocker / "trace")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only directories")
def test_prepare_trace_dir_read_only_raises_config_error(tmp_path: Path) -> None:
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="not writable"):
        prepare_trace_dir(read_only)


def test_file_span_exporter_writes_and_reports_failure(tp4_trace: Any, tmp_path: Path) -> None:
    def render(spans: Any) -> str:
        return json.dumps(to_jaeger_json(spans))

    target = tmp_path / "jaeger.json"
    assert FileSpanExporter(target, render).export(tp4_trace.spans) is SpanExportResult.SUCCESS
    assert json.loads(target.read_text())["data"][0]["traceID"] == tp4_trace.trace_id
    missing_dir = FileSpanExporter(tmp_path / "missing" / "x.json", render)
    assert missing_dir.export(tp4_trace.spans) is SpanExportResult.FAILURE
