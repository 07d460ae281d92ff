"""OTLP export to real receivers, and to endpoints that refuse or never answer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from rayload.tracing import export_otlp
from rayload.tracing.exporters.otlp import OtlpTarget, resolve_target

_OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
)
STALL_BOUND_S = 3.0
"""Slack over the timeout before a failing export counts as stalled (not a benchmark)."""


@pytest.fixture(autouse=True)
def _clean_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def test_export_grpc_delivers_whole_trace(
    tp4_trace: Any, otlp_grpc_receiver: Any, assert_startup_trace: Callable[..., None]
) -> None:
    assert export_otlp(tp4_trace.spans, otlp_grpc_receiver.endpoint, timeout_s=10)
    assert otlp_grpc_receiver.wait_for_requests(1)
    assert_startup_trace(otlp_grpc_receiver.spans(), tp4_trace)


def test_export_grpc_accepts_bare_host_port(tp4_trace: Any, otlp_grpc_receiver: Any) -> None:
    assert export_otlp(tp4_trace.spans, f"127.0.0.1:{otlp_grpc_receiver.port}", timeout_s=10)
    assert len(otlp_grpc_receiver.spans()) == len(tp4_trace.spans)


def test_export_http_delivers_whole_trace(
    tp4_trace: Any, otlp_http_receiver: Any, assert_startup_trace: Callable[..., None]
) -> None:
    assert export_otlp(tp4_trace.spans, otlp_http_receiver.endpoint, timeout_s=10)
    assert otlp_http_receiver.wait_for_requests(1)
    assert_startup_trace(otlp_http_receiver.spans(), tp4_trace)


def test_export_uses_traces_endpoint_variable_when_no_endpoint(
    tp4_trace: Any, otlp_http_receiver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_http_receiver.endpoint)
    assert export_otlp(tp4_trace.spans, None, timeout_s=10)
    assert len(otlp_http_receiver.spans()) == len(tp4_trace.spans)


def test_export_uses_base_endpoint_and_protocol_variables(
    tp4_trace: Any, otlp_http_receiver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{otlp_http_receiver.port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert export_otlp(tp4_trace.spans, None, timeout_s=10)
    assert len(otlp_http_receiver.spans()) == len(tp4_trace.spans)


def test_export_without_endpoint_or_variables_sends_nothing(tp4_trace: Any) -> None:
    assert export_otlp(tp4_trace.spans, None) is False


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_export_to_closed_port_returns_false_and_warns(
    scheme: str, tp4_trace: Any, unused_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = f"http://127.0.0.1:{unused_port}" + ("/v1/traces" if scheme == "http" else "")
    _assert_fails_without_stalling(tp4_trace.spans, endpoint, caplog)


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_export_to_silent_receiver_returns_false_within_timeout(
    scheme: str, tp4_trace: Any, black_hole: Any, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = f"http://127.0.0.1:{black_hole.port}" + ("/v1/traces" if scheme == "http" else "")
    _assert_fails_without_stalling(tp4_trace.spans, endpoint, caplog)


def _assert_fails_without_stalling(
    spans: list[Any], endpoint: str, caplog: pytest.LogCaptureFixture, timeout_s: float = 1.5
) -> None:
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rayload.tracing.exporters.otlp"):
        assert export_otlp(spans, endpoint, timeout_s=timeout_s) is False
    assert time.monotonic() - started < timeout_s + STALL_BOUND_S
    assert any(
        record.name == "rayload.tracing.exporters.otlp" and record.levelno == logging.WARNING
        for record in caplog.records
    )


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("http://collector:4318/v1/traces", OtlpTarget("http", "http://collector:4318/v1/traces")),
        ("https://otlp.example/v1/traces/", OtlpTarget("http", "https://otlp.example/v1/traces/")),
        ("http://collector:4317", OtlpTarget("grpc", "http://collector:4317")),
        ("collector:4317", OtlpTarget("grpc", "collector:4317")),
        (
            "http://collector:4318/v1/metrics",
            OtlpTarget("grpc", "http://collector:4318/v1/metrics"),
        ),
    ],
)
def test_resolve_target_picks_protocol_from_url(endpoint: str, expected: OtlpTarget) -> None:
    assert resolve_target(endpoint) == expected


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, OtlpTarget("grpc", None)),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"},
            OtlpTarget("http", None),
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            OtlpTarget("http", None),
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
            },
            None,
        ),
    ],
)
def test_resolve_target_reads_standard_variables(
    variables: dict[str, str], expected: OtlpTarget | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert resolve_target(None) == expected
