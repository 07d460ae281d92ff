"""What a rank actor's start-up spent its time on: the children of ``rayload.spawn``.

Pure arithmetic on times already moved onto the driver's clock, so it is tested without
Ray. A spawn runs, in order::

    spawn call ─ worker_wait ─ process start ─ process_start ─ first rayload import
      ─ imports (torch, opentelemetry, rayload) ─ actor_init (Ray builds the actor, its
      __init__, with the CUDA context on a GPU rank) ─ end of __init__ = end of the spawn

Every boundary is clamped into the spawn and kept in order (a rank's times carry the
clock offset's error, up to half its round trip), and an empty phase is left out: a
worker Ray had started before the spawn gives no ``process_start``, and its
``worker_wait`` lasts until the actor's module began importing. A package's import has
children of its own where they were timed (torch's direct child imports:
``rayload.spawn.import.torch._C``, ...), clipped into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rayload.tracing import schema


@dataclass(frozen=True)
class SpawnPhase:
    """One span under ``rayload.spawn`` (or under another phase: ``children``)."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    children: tuple[SpawnPhase, ...] = ()


@dataclass(frozen=True)
class SpawnTimes:
    """A rank actor's own start-up times, on the driver's clock (None: not measured).

    ``imports`` are ``(package, start_ns, end_ns)`` in import order; ``import_children``
    are ``(package, module, start_ns, end_ns)`` of the modules a package's import imported
    directly, in order, not overlapping; ``cuda_context`` is ``(start_ns, end_ns)`` of the
    CUDA context creation in ``__init__``."""

    process_start_ns: int | None
    imports: Sequence[tuple[str, int, int]]
    init_start_ns: int
    cuda_context: tuple[int, int] | None = None
    import_children: Sequence[tuple[str, str, int, int]] = ()


def spawn_phases(start_ns: int, end_ns: int, times: SpawnTimes) -> tuple[SpawnPhase, ...]:
    """The children of a ``rayload.spawn`` from ``start_ns`` to ``end_ns`` (driver clock):
    contiguous, in order, together covering the whole spawn (which ends where the actor's
    ``__init__`` did, so ``actor_init`` ends with it)."""
    cursor = start_ns

    def until(t: int | None) -> int:
        """``t`` clamped into what is left of the spawn; the cursor moves there."""
        nonlocal cursor
        cursor = min(max(cursor, start_ns if t is None else t), end_ns)
        return cursor

    phases: list[SpawnPhase] = []
    first_code = times.imports[0][1] if times.imports else times.init_start_ns
    process = times.process_start_ns
    if process is not None and start_ns < process < first_code:
        phases.append(SpawnPhase(schema.SPAWN_WORKER_WAIT_SPAN, start_ns, until(process)))
        phases.append(SpawnPhase(schema.SPAWN_PROCESS_START_SPAN, cursor, until(first_code)))
    else:
        wait_attributes = {"worker_started_before_spawn": process is not None}
        phases.append(
            SpawnPhase(schema.SPAWN_WORKER_WAIT_SPAN, start_ns, until(first_code), wait_attributes)
        )
    if times.imports:
        imports_start = cursor
        children = [
            _import_phase(package, until(a), until(b), times.import_children)
            for package, a, b in times.imports
        ]
        phases.append(
            SpawnPhase(schema.SPAWN_IMPORTS_SPAN, imports_start, cursor, children=_kept(children))
        )
    init_start = cursor
    init_children: list[SpawnPhase] = []
    if times.cuda_context is not None:
        cuda_start, cuda_end = times.cuda_context
        init_children.append(
            SpawnPhase(schema.SPAWN_CUDA_CONTEXT_SPAN, until(cuda_start), until(cuda_end))
        )
    phases.append(
        SpawnPhase(
            schema.SPAWN_ACTOR_INIT_SPAN,
            init_start,
            until(end_ns),
            children=_kept(init_children),
        )
    )
    return _kept(phases)


def _import_phase(
    package: str, start_ns: int, end_ns: int, children: Sequence[tuple[str, str, int, int]]
) -> SpawnPhase:
    """``rayload.spawn.import.<package>`` from ``start_ns`` to ``end_ns``, with the
    ``rayload.spawn.import.<module>`` of its direct child imports clipped into it."""
    return SpawnPhase(
        schema.SPAWN_IMPORT_PREFIX + package,
        start_ns,
        end_ns,
        {"package": package},
        children=_kept(
            [
                SpawnPhase(
                    schema.SPAWN_IMPORT_PREFIX + module,
                    min(max(a, start_ns), end_ns),
                    min(max(b, start_ns), end_ns),
                    {"module": module},
                )
                for parent, module, a, b in children
                if parent == package
            ]
        ),
    )


def _kept(phases: Sequence[SpawnPhase]) -> tuple[SpawnPhase, ...]:
    return tuple(p for p in phases if p.end_ns > p.start_ns)
