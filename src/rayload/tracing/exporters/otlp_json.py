"""``trace.otlp.json``: the OTLP/JSON encoding of the trace.

The protobuf message is exactly what the OTLP exporters send; protobuf's own JSON mapping
differs from the OTLP/JSON spec in two ways that are fixed here: trace and span ids are
hex strings (not base64) and enums are integers (not names). 64-bit integers, including
the ``*UnixNano`` times, stay decimal strings as both specify.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def to_otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """The ``{"resourceSpans": [...]}`` OTLP/JSON document of ``spans``."""
    document: dict[str, Any] = json_format.MessageToDict(
        encode_spans(spans), use_integers_for_enums=True
    )
    for resource_spans in document.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                _hex_ids(span)
                for link in span.get("links", []):
                    _hex_ids(link)
    return document


def _hex_ids(message: dict[str, Any]) -> None:
    for field in _ID_FIELDS:
        if field in message:
            message[field] = base64.b64decode(message[field]).hex()
