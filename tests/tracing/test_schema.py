"""Span and phase names are written once: driver spans in rayload.tracing.schema, rank
phases in rayload.loading.report."""

from __future__ import annotations

import ast
from pathlib import Path

import rayload
from rayload.tracing import schema

SRC = Path(rayload.__file__).parent
DRIVER_SPANS = {
    schema.ROOT_SPAN,
    schema.PREPARE_SPAN,
    schema.CONNECT_SPAN,
    *schema.CONNECT_SPANS,
    schema.PLACEMENT_SPAN,
    schema.SPAWN_SPAN,
    schema.SPAWN_WORKER_WAIT_SPAN,
    schema.SPAWN_PROCESS_START_SPAN,
    schema.SPAWN_IMPORTS_SPAN,
    schema.SPAWN_ACTOR_INIT_SPAN,
    schema.SPAWN_CUDA_CONTEXT_SPAN,
    schema.CLOCK_SYNC_SPAN,
    schema.RELOAD_ROOT_SPAN,
}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            found.add(id(body[0].value))
    return found


def _hard_coded(names: set[str], *, home: Path) -> list[str]:
    """``path:line: name`` for each string constant in ``names`` outside ``home`` that is
    not a docstring."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path == home:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = _docstrings(tree)
        offenders += [
            f"{path.relative_to(SRC)}:{node.lineno}: {node.value}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
        ]
    return offenders


def test_rank_phase_names_are_not_hard_coded_outside_report() -> None:
    from rayload.loading import report

    assert _hard_coded(set(report.PHASES), home=Path(report.__file__)) == []


def test_driver_span_names_are_not_hard_coded_outside_schema() -> None:
    assert _hard_coded(DRIVER_SPANS, home=Path(schema.__file__)) == []
