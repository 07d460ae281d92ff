"""Driver span names are written once, in rayload.tracing.schema."""

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
    schema.PLACEMENT_SPAN,
    schema.SPAWN_SPAN,
}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            found.add(id(body[0].value))
    return found


def test_driver_span_names_are_not_hard_coded_outside_schema() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path == Path(schema.__file__):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = _docstrings(tree)
        offenders += [
            f"{path.relative_to(SRC)}:{node.lineno}: {node.value}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and node.value in DRIVER_SPANS
            and id(node) not in docstrings
        ]
    assert offenders == []
