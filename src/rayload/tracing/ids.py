"""Span and trace ids drawn from the operating system's entropy pool.

The SDK's default :class:`~opentelemetry.sdk.trace.id_generator.RandomIdGenerator` uses
the ``random`` module. Rank processes are forked or spawned by Ray and user code commonly
calls ``random.seed(0)`` for reproducible weights, so every rank would then produce the
*same* span ids and the merged trace would collide. ``secrets`` reads ``os.urandom`` and
is independent of any seed.
"""

from __future__ import annotations

import secrets

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace.id_generator import IdGenerator


class SecureIdGenerator(IdGenerator):
    """An :class:`IdGenerator` whose ids cannot repeat across identically seeded processes."""

    def generate_span_id(self) -> int:
        span_id = secrets.randbits(64)
        while span_id == trace_api.INVALID_SPAN_ID:
            span_id = secrets.randbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = secrets.randbits(128)
        while trace_id == trace_api.INVALID_TRACE_ID:
            trace_id = secrets.randbits(128)
        return trace_id

    def is_trace_id_random(self) -> bool:
        return True
