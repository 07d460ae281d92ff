"""Send the startup trace to an OTLP collector (or Jaeger, which speaks OTLP).

The SDK's own ``OTLPSpanExporter`` classes do the sending, so the standard
``OTEL_EXPORTER_OTLP_*`` variables (headers, certificates, compression, ...) apply.
Which one: an ``http(s)://.../v1/traces`` URL goes over HTTP/protobuf, any other endpoint
over gRPC. Without an endpoint, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT`` is used, over ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``
when set (``grpc`` or ``http/protobuf``), else by the same URL rule.

An unreachable collector never fails or stalls a load: the export runs on a daemon
thread that is waited for at most ``timeout_s`` (plus a short grace for the exporter's
own shutdown), and every failure is a logged warning and a ``False`` return.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlparse

from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_INSECURE,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_INSECURE,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)

_GRACE_S = 0.5
_PROTOCOLS: dict[str, Literal["grpc", "http"]] = {"grpc": "grpc", "http/protobuf": "http"}


@dataclass(frozen=True)
class OtlpTarget:
    """Where and how to send: ``endpoint`` None means "the exporter reads the environment"."""

    protocol: Literal["grpc", "http"]
    endpoint: str | None

    def describe(self) -> str:
        where = self.endpoint or _env_endpoint() or "?"
        return f"OTLP/{'gRPC' if self.protocol == 'grpc' else 'HTTP'} {where}"


def export_otlp(
    spans: Sequence[ReadableSpan], endpoint: str | None, *, timeout_s: float = 5.0
) -> bool:
    """Send ``spans`` over OTLP; True when the receiver acknowledged them.

    ``endpoint`` None and no ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` set: nothing is sent
    (False, debug log). Never raises; returns within ``timeout_s`` plus a fraction of a
    second even when the receiver accepts connections and never answers.
    """
    target = resolve_target(endpoint)
    if target is None:
        logger.debug("no OTLP endpoint given or configured; the trace is not exported")
        return False
    try:
        exporter = _exporter(target, timeout_s)
    except Exception as exc:  # a bad URL or credentials file must not fail the load
        logger.warning("cannot export the startup trace to %s: %s", target.describe(), exc)
        return False
    results: list[SpanExportResult] = []
    thread = threading.Thread(
        target=_export_into, args=(exporter, spans, results), name="rayload-otlp", daemon=True
    )
    thread.start()
    thread.join(timeout_s + _GRACE_S)
    stalled = thread.is_alive()
    try:
        exporter.shutdown()
    except Exception as exc:  # closing a broken channel is no reason to fail
        logger.debug("closing the OTLP exporter failed: %s", exc)
    if stalled:
        logger.warning(
            "exporting the startup trace to %s did not finish within %.1f s; gave up",
            target.describe(),
            timeout_s,
        )
        return False
    if results != [SpanExportResult.SUCCESS]:
        logger.warning(
            "exporting the startup trace (%d spans) to %s failed; the trace files are unaffected",
            len(spans),
            target.describe(),
        )
        return False
    logger.debug("exported %d spans to %s", len(spans), target.describe())
    return True


def resolve_target(endpoint: str | None) -> OtlpTarget | None:
    """The protocol and endpoint :func:`export_otlp` uses, None when there is none."""
    if endpoint:
        return OtlpTarget("http" if _is_http_traces_url(endpoint) else "grpc", endpoint)
    configured = _env_endpoint()
    if not configured:
        return None
    protocol = os.environ.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or os.environ.get(
        OTEL_EXPORTER_OTLP_PROTOCOL
    )
    if protocol:
        if protocol not in _PROTOCOLS:
            logger.warning(
                "OTLP protocol %r is not supported; use 'grpc' or 'http/protobuf'", protocol
            )
            return None
        return OtlpTarget(_PROTOCOLS[protocol], None)
    traces_endpoint = os.environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "")
    return OtlpTarget("http" if _is_http_traces_url(traces_endpoint) else "grpc", None)


def _export_into(
    exporter: SpanExporter, spans: Sequence[ReadableSpan], results: list[SpanExportResult]
) -> None:
    try:
        results.append(exporter.export(spans))
    except Exception as exc:  # the SDK exporters should not raise; telemetry never crashes
        logger.warning("the OTLP exporter raised: %s", exc)


def _exporter(target: OtlpTarget, timeout_s: float) -> SpanExporter:
    if target.protocol == "http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter(endpoint=target.endpoint, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )

    return GrpcExporter(
        endpoint=target.endpoint, insecure=_grpc_insecure(target.endpoint), timeout=timeout_s
    )


def _grpc_insecure(endpoint: str | None) -> bool | None:
    """Plaintext for a bare ``host:port`` (as Jaeger and collectors listen by default)
    unless ``OTEL_EXPORTER_OTLP_(TRACES_)INSECURE`` decides; a URL's scheme decides itself."""
    url = endpoint or _env_endpoint() or ""
    if "://" in url:
        return None
    if (
        OTEL_EXPORTER_OTLP_TRACES_INSECURE in os.environ
        or OTEL_EXPORTER_OTLP_INSECURE in os.environ
    ):
        return None
    return True


def _env_endpoint() -> str | None:
    return os.environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) or os.environ.get(
        OTEL_EXPORTER_OTLP_ENDPOINT
    )


def _is_http_traces_url(url: str) -> bool:
    parsed = urlparse(url)
    return parsed.scheme in ("http", "https") and parsed.path.rstrip("/").endswith("/v1/traces")
